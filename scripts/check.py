"""The static checks the test suite runs: ruff over the tree, mypy over the dstool.* packages, and import-linter's
layer contract (pyproject.toml: the roof over the stages over the core).

    .venv/bin/python scripts/check.py

The source folders are mapped into one namespace by setuptools (`package-dir`: train/ is dstool.train, ...),
which mypy cannot follow from an editable install, so mypy reads a tree of links laid out as the installed
package is (dstool/, dstool/train -> train/, ...) and reports the real paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def package_tree(into: Path) -> dict[str, Path]:
    """Links laid out as the installed `dstool` package; returns link folder -> real folder (to map paths back)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = into / "dstool"
    top.mkdir(parents=True)
    for entry in (ROOT / mapping["dstool"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    links = {}
    for package, folder in sorted(mapping.items()):
        parts = package.split(".")
        if len(parts) == 2:  # dstool.train -> train/ (deeper packages come along inside it)
            (top / parts[1]).symlink_to(ROOT / folder)
            links[str(top / parts[1])] = ROOT / folder
    links[str(top)] = ROOT / mapping["dstool"]
    return links


def run_mypy() -> int:
    with tempfile.TemporaryDirectory(prefix="dstool-mypy-") as tmp:
        links = package_tree(Path(tmp))
        proc = subprocess.run([str(BIN / "mypy"), "--config-file", str(ROOT / "pyproject.toml"), "-p", "dstool"],
                              cwd=tmp, capture_output=True, text=True, env={**os.environ, "MYPYPATH": tmp})
        out = proc.stdout + proc.stderr
        for link, real in sorted(links.items(), key=lambda kv: -len(kv[0])):  # dstool/train/ before dstool/
            out = out.replace(os.path.relpath(link, tmp) + "/", str(real.relative_to(ROOT)) + "/")
        print(out, end="")
        return proc.returncode


def run_import_linter() -> int:
    """The layer contract of pyproject.toml ([tool.importlinter]) over the same tree of links."""
    with tempfile.TemporaryDirectory(prefix="dstool-layers-") as tmp:
        package_tree(Path(tmp))
        proc = subprocess.run([str(BIN / "lint-imports"), "--no-cache", str(ROOT / "pyproject.toml")], cwd=tmp,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tmp})
        if proc.returncode:
            print(proc.stdout + proc.stderr, end="")
        return proc.returncode


def main() -> int:
    ruff = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=ROOT)
    return max(ruff.returncode, run_mypy(), run_import_linter())


if __name__ == "__main__":
    sys.exit(main())
