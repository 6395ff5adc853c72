"""The peak memory of a command and everything it starts, for the bench scripts."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter per run: RUSAGE_CHILDREN's maxrss is the largest descendant it waited for (torchrun waits
# for its ranks), so it is one run's peak only when nothing else ran before it there.
_MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def peak_rss(cmd: list[str]) -> int:
    """Run `cmd` to the end; the largest resident set (bytes) of any process it started."""
    return int(subprocess.run([sys.executable, "-c", _MEASURE, *cmd], check=True, capture_output=True,
                              text=True).stdout.split()[-1])
