#!/usr/bin/env bash
# The ecosystem's client libraries, each in a virtual environment whose pins suit it, for
# tests/test_client_ecosystem.py (which runs small scripts with each one's python against the gateway):
#   scripts/client-venvs.sh [DIR]      # DIR defaults to <dstool cache>/client-venvs; one folder per group
# In the user's cache (as lm-eval's venv), so a fresh clone on a machine that made them finds them (2 minutes saved).
# Their pins conflict: instructor 1.17 wants jiter<0.15 (so openai<=3.3), llama-index-llms-openai 0.8 wants openai<3,
# the rest take the newest openai (outlines 1.3 and guidance 0.3 too: they only add packages to that group). Each
# group is what `pip install LIBRARY` gives a user who installs it alone.
# A group whose pins (and python) are already installed is left as it is (re-running is a no-op); a change rebuilds it.
# Two set-ups at once take turns (a lock in DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${DSTOOL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dstool}
dir=${1:-${DSTOOL_CLIENT_VENVS:-$cache/client-venvs}}
python=${PYTHON:-python3}
declare -A groups=(
  [openai]="openai==3.63.0 langchain-openai==1.8.1 litellm==1.110.2 openai-agents==0.24.0 pydantic-ai-slim[openai]==2.78.0 anthropic==2.17.0 outlines==1.3.3 guidance==0.3.1"
  [instructor]="instructor==1.17.0 openai==3.3.0"
  [llamaindex]="llama-index-llms-openai-like==0.8.1 openai==2.54.0"
)
# what each group's python must import (a broken install fails here, not in the tests)
declare -A imports=(
  [openai]="openai, langchain_openai, litellm, agents, pydantic_ai, anthropic, outlines, guidance"
  [instructor]="instructor, openai"
  [llamaindex]="llama_index.llms.openai_like, openai"
)
mkdir -p "$dir"
exec 9>"$dir/.lock"
command -v flock >/dev/null && flock 9  # util-linux
for group in openai instructor llamaindex; do
  venv="$dir/$group"
  pins="${groups[$group]} ($("$python" -V))"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dstool-pins" 2>/dev/null)" = "$pins" ]; then
    continue
  fi
  start=$SECONDS
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check ${groups[$group]}
  LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c "import ${imports[$group]}"  # litellm: no fetch at import
  echo "$pins" > "$venv/.dstool-pins"
  echo "client venv $venv: $pins ($((SECONDS - start)) s)"
done
