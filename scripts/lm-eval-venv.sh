#!/usr/bin/env bash
# lm-evaluation-harness (lm_eval) in a virtual environment of its own, for `dstool eval` (docs/eval.md),
# tests/test_completions.py and for scoring a served model by hand: its pins need not suit .venv's. torch is pinned
# first, as in setup.sh, so that nothing resolves a bare `torch` to a multi-GB CUDA build.
#   scripts/lm-eval-venv.sh            # -> $DSTOOL_LM_EVAL_VENV, else <dstool cache>/lm-eval-venv
# The folder it made is printed last; `VENV/bin/lm_eval --model local-completions ...` then scores a model served
# by the gateway's /v1/completions (docs/export-serve.md, "Completions").
set -euo pipefail
cache=${DSTOOL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dstool}
venv=${DSTOOL_LM_EVAL_VENV:-$cache/lm-eval-venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$venv/bin/python" -c "import torch" 2>/dev/null || \
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==${DSTOOL_TORCH:-2.13.0}"
torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==$torch_version" > "$venv/constraints.txt"
# onnxruntime: `dstool eval` scores ONNX graphs (a compress output's logits graph) with lm-eval's onnxruntime model
"$venv/bin/pip" install -q --disable-pip-version-check "lm-eval[api,hf]==${DSTOOL_LM_EVAL:-0.4.13}" \
  "onnxruntime==${DSTOOL_LM_EVAL_ORT:-1.32.0}" -c "$venv/constraints.txt"
"$venv/bin/python" -c "import lm_eval, lm_eval.models.openai_completions, lm_eval.models.huggingface, \
lm_eval.models.onnxruntime_ort, onnxruntime" >/dev/null
echo "$venv"
