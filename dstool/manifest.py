"""Artefact manifests: what a folder is, who wrote it, and the sha256 of every file in it."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dstool import __version__

MANIFEST = "dstool.json"


class ManifestError(Exception):
    """A folder's files do not match its manifest (missing, truncated or altered), or it has none."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _walk(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, kind: str, hash_files: bool = True, **extra) -> dict:
    """Write `folder/dstool.json` (atomically) naming the artefact kind and, optionally, every file's sha256."""
    folder = Path(folder)
    manifest = {"kind": kind, "dstool_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
    if hash_files:
        manifest["files"] = {str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                             for p in _walk(folder)}
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def verify_manifest(folder: Path, kind: str | None = None) -> dict:
    """Check every listed file's size and sha256; raise ManifestError naming the first problem."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise ManifestError(f"{folder} has no readable {MANIFEST} (partial or foreign write)")
    if kind and manifest.get("kind") != kind:
        raise ManifestError(f"{folder} is a '{manifest.get('kind')}', not a '{kind}'")
    for rel, info in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            raise ManifestError(f"{folder}: file {rel} is missing")
        if p.stat().st_size != info["bytes"]:
            raise ManifestError(f"{folder}: file {rel} has {p.stat().st_size} bytes, manifest says {info['bytes']}")
        if sha256_file(p) != info["sha256"]:
            raise ManifestError(f"{folder}: file {rel} fails its sha256 check")
    return manifest


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file beside `path`, fsync, then rename over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
