"""Generated blocks of the docs pages, so they say what the code does:

    <!-- cli: SUBCOMMAND --> ... <!-- /cli -->         `dstool SUBCOMMAND --help` (100 columns)
    <!-- schema: KIND --> ... <!-- /schema -->          the fields of the manifest of that kind (dstool.artifacts)

    .venv/bin/python scripts/docs_cli.py          # rewrite the blocks
    .venv/bin/python scripts/docs_cli.py --check  # exit 1 if a block differs (the tests run this)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel

DOCS = Path(__file__).resolve().parent.parent / "docs"
CLI = re.compile(r"(<!-- cli: ([\w-]+) -->\n)(.*?)(<!-- /cli -->)", re.S)
SCHEMA = re.compile(r"(<!-- schema: ([\w-]+) -->\n)(.*?)(<!-- /schema -->)", re.S)


def cli_help(command: str) -> str:
    """`dstool COMMAND --help` at 100 columns, formatted in this process (argparse reads COLUMNS when it formats)."""
    from dstool.cli import build_parser

    os.environ["COLUMNS"] = "100"
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices[command].format_help()


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        return f"map {_type_name(args[0])} → {_type_name(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _nested(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested(a)]


def schema_markdown(kind: str, shown: set) -> str:
    """Tables of the manifest of `kind` and of every model it holds, in the order they appear (those already
    `shown` on the page are linked, not repeated)."""
    from dstool import artifacts

    root = next(cls for cls in artifacts.KINDS if cls.model_fields["kind"].default == kind)
    order, seen = [root], {root} | shown
    for model in order:
        for field in model.model_fields.values():
            for nested in _nested(field.annotation):
                if nested not in seen:
                    seen.add(nested)
                    order.append(nested)
    shown.update(order)
    out = []
    for model in order:
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        out += [f"#### {model.__name__}", ""] + ([doc, ""] if doc else [])
        out += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            default = "required" if field.is_required() else (
                "[]" if field.default_factory is list else "{}" if field.default_factory is dict else
                "now" if field.default_factory else f"`{field.default!r}`")
            meaning = (field.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | {_type_name(field.annotation)} | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


def render(text: str) -> str:
    text = CLI.sub(lambda m: f"{m.group(1)}```\n{cli_help(m.group(2))}```\n{m.group(4)}", text)
    shown: set = set()
    return SCHEMA.sub(lambda m: f"{m.group(1)}{schema_markdown(m.group(2), shown)}{m.group(4)}", text)


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
        print(f"generated blocks out of date in {', '.join(stale)}: run python scripts/docs_cli.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
