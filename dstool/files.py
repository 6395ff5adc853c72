"""File helpers every stage shares: sha256 digests and atomic writes (temp file, fsync, rename; a folder written
whole beside its place, then renamed into it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(temp file)` beside `path`, fsync, then rename over it: a reader sees the old file or the whole new
    one, never a part (the temp file is removed if writing fails)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_folder(staging: Path, target: Path) -> None:
    """Put `staging` (a folder written whole beside `target`) in `target`'s place: the old folder, if any, is moved
    aside first and removed after, so `target` is never a mix of the two (only missing for the moment between)."""
    staging, target = Path(staging), Path(target)
    old = target.with_name(f".{target.name}.old{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def cache_dir() -> Path:
    """Where dstool keeps what it can make again (Triton's files from the wheel, compress baselines):
    $DSTOOL_CACHE_DIR, else $XDG_CACHE_HOME/dstool, else ~/.cache/dstool."""
    given = os.environ.get("DSTOOL_CACHE_DIR")
    return Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dstool"
