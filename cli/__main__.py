"""`python -m dstool.cli ARGS`: the `dstool` command."""

import sys

from dstool.cli.commands import main

sys.exit(main())
