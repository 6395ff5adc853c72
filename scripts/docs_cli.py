"""Write each `dstool SUBCOMMAND --help` into the docs pages between `<!-- cli: SUBCOMMAND -->` and
`<!-- /cli -->` (100 columns), so the option lists in docs/ are the CLI's own.

    .venv/bin/python scripts/docs_cli.py          # rewrite the blocks
    .venv/bin/python scripts/docs_cli.py --check  # exit 1 if a block differs (the tests run this)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!-- cli: ([\w-]+) -->\n)(.*?)(<!-- /cli -->)", re.S)


def cli_help(command: str) -> str:
    """`dstool COMMAND --help` at 100 columns, formatted in this process (argparse reads COLUMNS when it formats)."""
    from dstool.cli import build_parser

    os.environ["COLUMNS"] = "100"
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices[command].format_help()


def render(text: str) -> str:
    return BLOCK.sub(lambda m: f"{m.group(1)}```\n{cli_help(m.group(2))}```\n{m.group(4)}", text)


def main() -> int:
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(page.name)
            if "--check" not in sys.argv:
                page.write_text(fresh)
    if stale and "--check" in sys.argv:
        print(f"option lists out of date in {', '.join(stale)}: run python scripts/docs_cli.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
