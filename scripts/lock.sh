#!/usr/bin/env bash
# Write the set-up's lock, requirements/lock-pyX.Y.txt: the version of every package .venv holds but dstool and torch
# (setup.sh pins torch itself), as `pip freeze` names them. setup.sh installs through it (a constraints file), so that
# every machine gets the versions the suite last passed with, and the suite's kept artefacts (keyed by them) stay
# valid however the registry moves. After adding a dependency: setup.sh (the new one comes unlocked), then this.
# To move everything to the newest allowed: rm -rf .venv && DSTOOL_UNLOCKED=1 bash scripts/setup.sh, the suite, this.
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
lock="requirements/lock-py$pyver.txt"
mkdir -p requirements
{
  echo "# scripts/lock.sh on $(date -u +%Y-%m-%d), python $pyver: the versions scripts/setup.sh installs (docs/setup.md)"
  .venv/bin/python -m pip freeze --disable-pip-version-check --exclude-editable | grep -viE '^(torch|dstool)([=@ ]|$)'
} > "$lock.tmp"
mv "$lock.tmp" "$lock"
echo "$lock: $(grep -vc '^#' "$lock") packages"
