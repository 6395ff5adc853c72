"""`python -m dstool.cli ARGS`: the `dstool` command."""

from dstool.cli.commands import run

run()
