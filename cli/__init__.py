"""The roof: the `dstool` command line (`commands`, thin over each stage's typed API) and `dstool pipeline`
(`pipeline`, the stages in turn). The only package that imports every stage; the core (`dstool/`) imports none."""

from dstool.cli.commands import COMMANDS, build_parser, main, run

__all__ = ["COMMANDS", "build_parser", "main", "run"]
