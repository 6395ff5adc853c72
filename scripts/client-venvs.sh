#!/usr/bin/env bash
# The ecosystem's client libraries, each in a virtual environment whose pins suit it, for
# tests/test_client_ecosystem.py (which runs small scripts with each one's python against the gateway):
#   scripts/client-venvs.sh [DIR]      # DIR defaults to .venv-clients/ (git-ignored); one folder per group
# Their pins conflict: instructor 1.17 wants jiter<0.15 (so openai<=3.3), llama-index-llms-openai 0.8 wants openai<3,
# the rest take the newest openai (outlines 1.3 and guidance 0.3 too: they only add packages to that group). Each
# group is what `pip install LIBRARY` gives a user who installs it alone.
# A group whose pins are already installed is left as it is (re-running is a no-op); a changed pin rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-${DSTOOL_CLIENT_VENVS:-.venv-clients}}
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
for group in openai instructor llamaindex; do
  venv="$dir/$group"
  pins=${groups[$group]}
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dstool-pins" 2>/dev/null)" = "$pins" ]; then
    continue
  fi
  start=$SECONDS
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $pins
  LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c "import ${imports[$group]}"  # litellm: no fetch at import
  echo "$pins" > "$venv/.dstool-pins"
  echo "client venv $venv: $pins ($((SECONDS - start)) s)"
done
