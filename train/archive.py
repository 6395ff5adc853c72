"""Cold storage for checkpoints (`dstool train --archive URL`): a folder or any fsspec URL (file://, s3://, gs://...).

A checkpoint leaving the --keep-checkpoints window is copied to URL/step-N/ and only then deleted from the run's
checkpoints/ (checkpoint.prune). The copy is written under URL/.partial-step-N/ (the source hashed as it is read),
every file is read back from the archive and checked against the checkpoint's own sha256 manifest (dstool.json), the
folder is renamed to URL/step-N/, and only then is its marker URL/step-N/archived.json written: a copy without its
marker (a run killed mid-copy, a rename an object store did half) is never taken as valid, and is made again.
Restoring copies the manifest's files back into checkpoints/ under a partial name, verifies them there (and the
manifest against the marker), then renames the folder into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import time
from pathlib import Path

import fsspec

from dstool.artifacts import MANIFEST, Checkpoint, ManifestError
from dstool.errors import UsageError
from dstool.files import replace_folder, sha256_file

MARKER = "archived.json"
PARTIAL = ".partial-"
CHUNK = 1 << 22


class Archive:
    """The cold location of a run's checkpoints. UsageError at once for a protocol fsspec does not know (or whose
    package is missing); `check()` refuses a location that cannot be written."""

    def __init__(self, url: str):
        self.url = url
        try:
            self.fs, base = fsspec.core.url_to_fs(url)
        except ValueError as e:
            raise UsageError(f"--archive {url}: {e}: give a folder or a URL fsspec knows (file://, s3://, gs://, "
                             "...)") from None
        except ImportError as e:
            raise UsageError(f"--archive {url}: {e}") from None
        self.base = base.rstrip("/") or "/"

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.base, *parts)

    def where(self, tag: str) -> str:
        """The URL of an archived tag folder (for messages and the index)."""
        return str(self.fs.unstrip_protocol(self._path(tag)))

    def check(self) -> None:
        """Create the location, write a probe file there, read it back and delete it; UsageError when any fails."""
        probe = self._path(f".dstool-probe-{os.getpid()}")
        try:
            self.fs.makedirs(self.base, exist_ok=True)
            self.fs.pipe_file(probe, b"dstool")
            if self.fs.cat_file(probe) != b"dstool":
                raise OSError("a file written there reads back different")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - whatever the backend raises (OSError, its own client errors)
            raise UsageError(f"--archive {self.url} cannot be written ({type(e).__name__}: {e}): give a folder or "
                             "URL this machine can create and write files in") from None

    def tags(self) -> list[str]:
        """Tags whose copy is complete (its marker is written), oldest first."""
        try:
            found = self.fs.glob(self._path("step-*", MARKER))
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(posixpath.dirname(p)) for p in found)

    def marker(self, tag: str) -> dict | None:
        """The completion record of an archived tag, None when it has none (an unfinished or foreign copy)."""
        try:
            raw = json.loads(self.fs.cat_file(self._path(tag, MARKER)))
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            return None
        return raw if isinstance(raw, dict) and raw.get("manifest_sha256") else None

    def put(self, tag_dir: Path) -> dict:
        """Copy a hot checkpoint here, verified against its manifest; returns its marker. ManifestError when the hot
        files or the archived copy do not match the manifest (nothing is marked complete then). A tag archived
        before with the same manifest (one restored from here) is not copied again."""
        tag = tag_dir.name
        manifest = Checkpoint.read(tag_dir)  # its files are hashed below, as they are read for the copy
        digest = sha256_file(tag_dir / MANIFEST)
        done = self.marker(tag)
        if done is not None and done["manifest_sha256"] == digest:
            return done
        want = {rel: (info.sha256, info.bytes) for rel, info in manifest.files.items()}
        want[MANIFEST] = (digest, (tag_dir / MANIFEST).stat().st_size)
        partial, final = self._path(PARTIAL + tag), self._path(tag)
        self._remove(partial)
        for rel, (sha, _) in want.items():
            if not (tag_dir / rel).is_file():
                raise ManifestError(f"{tag_dir}: file {rel} is missing (not archived)")
            if self._upload(tag_dir / rel, posixpath.join(partial, rel)) != sha:
                raise ManifestError(f"{tag_dir}: file {rel} fails its sha256 check (not archived)")
        for rel, (sha, size) in want.items():  # what the archive now holds, read back
            self._check(posixpath.join(partial, rel), rel, sha, size, self.where(PARTIAL + tag))
        self._remove(self._path(tag, MARKER))  # first: a half-removed copy must never look complete
        self._remove(final)  # an unmarked copy left by a killed run, or another checkpoint of this step
        self.fs.mv(partial, final, recursive=True)
        marker = {"tag": tag, "step": manifest.step, "manifest_sha256": digest, "files": len(want),
                  "bytes": sum(size for _, size in want.values()), "verified": "sha256 of every file read back",
                  "archived": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.fs.pipe_file(self._path(tag, MARKER), (json.dumps(marker, indent=1) + "\n").encode())
        return marker

    def restore(self, tag: str, root: Path) -> Path:
        """Copy an archived checkpoint back to root/tag: into a partial folder, verified there against its manifest
        (and the manifest against the marker), then renamed into place. ManifestError when it does not verify."""
        where = self.where(tag)
        marker = self.marker(tag)
        if marker is None:
            raise ManifestError(f"{where} has no readable {MARKER} (an unfinished copy)")
        tmp = root / (PARTIAL + tag)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self._download(tag, MANIFEST, tmp)
            if sha256_file(tmp / MANIFEST) != marker["manifest_sha256"]:
                raise ManifestError(f"{where}: its {MANIFEST} is not the one archived (its sha256 differs from "
                                    f"{MARKER}'s)")
            try:
                manifest = Checkpoint.read(tmp)
                for rel in manifest.files:
                    self._download(tag, rel, tmp)
                manifest.verify(tmp)
            except ManifestError as e:
                raise ManifestError(f"{where}: {str(e).replace(f'{tmp}: ', '').replace(str(tmp), '')}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_folder(tmp, root / tag)
        return root / tag

    # ---- transfers -----------------------------------------------------------------------------------------
    def _upload(self, src: Path, dest: str) -> str:
        """Copy a local file to the archive; the sha256 of the bytes read."""
        h = hashlib.sha256()
        self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
        with open(src, "rb") as f, self.fs.open(dest, "wb") as out:
            while block := f.read(CHUNK):
                h.update(block)
                out.write(block)
        return h.hexdigest()

    def _check(self, path: str, rel: str, sha: str, size: int, where: str) -> None:
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
        if self.fs.size(path) != size or h.hexdigest() != sha:
            raise ManifestError(f"{where}: file {rel} reads back with another sha256 (the archive copy is damaged)")

    def _download(self, tag: str, rel: str, into: Path) -> None:
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get_file(self._path(tag, rel), str(into / rel))
        except FileNotFoundError:
            raise ManifestError(f"{self.where(tag)}: file {rel} is missing") from None

    def _remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def check(url: str) -> Archive:
    """The archive of `--archive URL`, refused (UsageError) before any rank starts when it cannot be written."""
    archive = Archive(url)
    archive.check()
    return archive
