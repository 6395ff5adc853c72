"""Artefacts the suite keeps between runs (a trained model, an export), keyed by the code and inputs that made them.

An artefact's key hashes the source of every dstool module its stage imports, directly or not (grimp's import graph
over the installed layout, as import-linter reads it), the CLI, the packaged data, every installed distribution's
version, the interpreter, the CPU and GPU, the source of the test module that builds it and of the conftest, and its
inputs (its command line; the kept artefacts it was made from, by their listing): change any of them and it is made
again. It lives in the dstool cache (`test-artefacts/NAME-KEY`) with a listing of its files: one changed since (a test
that wrote into it) has it made again. `DSTOOL_TEST_CACHE=off` makes every artefact in the run's temporary folder
instead (a cold run); entries of a name unused for a day are removed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from dstool.files import cache_dir

ROOT = Path(__file__).resolve().parent.parent
KEEP_S = 24 * 3600
_GRAPH = """
import grimp, json
graph = grimp.build_graph("dstool", cache_dir=None)
print(json.dumps({m: sorted(graph.find_upstream_modules(m)) for m in graph.modules}))
"""


def enabled() -> bool:
    return os.environ.get("DSTOOL_TEST_CACHE", "on") != "off"


def root() -> Path:
    return cache_dir() / "test-artefacts"


@functools.cache
def _check() -> dict:
    """scripts/check.py's names: its tree of links laid out as the installed package, the TOML reader."""
    return runpy.run_path(str(ROOT / "scripts" / "check.py"))


@functools.cache
def _upstream() -> dict[str, list[str]]:
    """Every dstool module -> the modules it imports, directly or not (one graph a process)."""
    with tempfile.TemporaryDirectory(prefix="dstool-graph-") as tmp:
        _check()["package_tree"](Path(tmp))
        proc = subprocess.run([sys.executable, "-c", _GRAPH], cwd=tmp, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": tmp}, check=True)
    return json.loads(proc.stdout)


@functools.cache
def modules(entries: tuple[str, ...]) -> frozenset[str]:
    """The dstool modules the packages `entries` hold or import, directly or not, with the packages above them and
    the CLI (the flags every command reads)."""
    found = {"dstool.cli", "dstool.cli.commands", "dstool.cli.__main__"}
    for module, imported in _upstream().items():
        if any(module == e or module.startswith(e + ".") for e in entries):
            for name in (module, *imported):
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(found)


@functools.cache
def _package_dirs() -> dict[str, str]:
    return _check()["tomllib"].loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _file(module: str) -> Path | None:
    """A module's source file in this checkout (setuptools' package-dir: dstool.train is train/)."""
    folders = _package_dirs()
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in folders:
            base = ROOT / folders[".".join(parts[:n])] / Path(*parts[n:])
            for file in (base / "__init__.py", base.with_suffix(".py")):
                if file.is_file():
                    return file
            return None
    return None


@functools.cache
def _sources(entries: tuple[str, ...]) -> str:
    """A digest of the files of `modules(entries)` and of the packaged data."""
    digest = hashlib.sha256()
    for module in sorted(modules(entries)):
        file = _file(module)
        if file is not None:
            digest.update(module.encode() + b"\0" + file.read_bytes() + b"\0")
    for data in sorted((ROOT / "dstool" / "data").iterdir()):
        digest.update(data.name.encode() + b"\0" + data.read_bytes())
    return digest.hexdigest()


@functools.cache
def _machine() -> str:
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith(("model name", "flags"))][:2] if Path("/proc/cpuinfo").exists() else []
    accelerator = [os.path.exists("/dev/nvidiactl"), os.environ.get("CUDA_VISIBLE_DEVICES"),
                   os.environ.get("DS_ACCELERATOR")]  # a GPU changes what train and compress run on
    return json.dumps([sys.version, platform.platform(), cpu, accelerator, dists])


def _listing(path: Path) -> dict[str, list[int]]:
    return {str(f.relative_to(path)): [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.rglob("*"))
            if f.is_file() and "__pycache__" not in f.parts}


def _recipe(build: Callable) -> list[str]:
    """The source of the test module that defines `build` (its helpers too) and of the suite's conftest."""
    files = {Path(__file__).parent / "conftest.py"}
    try:
        files.add(Path(inspect.getsourcefile(build) or ""))
    except TypeError:
        pass
    return [f.read_text() for f in sorted(files) if f.is_file()]


def _parents(base: Path, given: list[str]) -> list[str]:
    """The kept artefacts named in `given` (a trained model an export reads), each by its listing: one made again
    under the same name makes its children again too."""
    names = sorted({m.group(1) for text in given for m in re.finditer(re.escape(str(base)) + r"/([^/\s'\"]+)", text)})
    return [hashlib.sha256((base / f"{n}.files").read_bytes()).hexdigest() for n in names
            if (base / f"{n}.files").exists()]


def built(name: str, build: Callable[[Path], object], code: tuple[str, ...], inputs: tuple[object, ...]) -> Path:
    """The artefact `build(path)` makes from the stages `code` (packages, e.g. "dstool.train") and `inputs`: kept
    from an earlier run when nothing of either changed, else made now (under a lock that xdist workers and runs
    share)."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    given = [str(i) for i in inputs]
    key = hashlib.sha256(json.dumps([_sources(tuple(sorted(code))), _machine(), _recipe(build), given,
                                     _parents(base, given)]).encode()).hexdigest()[:20]
    path, seal = base / f"{name}-{key}", base / f"{name}-{key}.files"
    with FileLock(f"{path}.lock"):
        if not (seal.exists() and json.loads(seal.read_text()) == _listing(path)):
            shutil.rmtree(path, ignore_errors=True)
            seal.unlink(missing_ok=True)
            build(path)
            seal.write_text(json.dumps(_listing(path)))
        os.utime(seal)  # last used now
    _evict(base, name, keep=path)
    return path


def _evict(base: Path, name: str, keep: Path) -> None:
    """Other entries of `name` unused for KEEP_S (a run of older code may still be reading a recent one)."""
    def stale(seal: Path) -> bool:
        try:
            return time.time() - seal.stat().st_mtime >= KEEP_S
        except FileNotFoundError:  # another worker removed it
            return False

    for seal in base.glob(f"{name}-*.files"):
        entry = seal.with_suffix("")
        if entry == keep or entry.name.count("-") != name.count("-") + 1 or not stale(seal):
            continue
        try:
            with FileLock(f"{entry}.lock", timeout=0):
                if stale(seal):  # not used since by another run
                    seal.unlink(missing_ok=True)
                    shutil.rmtree(entry, ignore_errors=True)
        except Timeout:
            pass
