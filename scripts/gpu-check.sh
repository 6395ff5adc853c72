#!/usr/bin/env bash
# The GPU checks issue 25 asks for, as one short script for a lent GPU machine (the `device` tool: about 15 minutes
# of device time for a session, no network there). It uses the machine's own python3 (PyTorch with CUDA) and
# installs dstool from this tree without its dependencies; DeepSpeed and onnxruntime-gpu come as wheels carried in
# .whl/ (prepare them here: `python3 -m pip download --no-deps -d .whl deepspeed onnxruntime-gpu`; a wheel over the
# carry limit is left out, and the check that needs it says so instead of failing).
#
#   bash scripts/gpu-check.sh [OUT]      # figures in OUT/gpu-check.txt (default $OUT or ./gpu-check)
#
# 1. bf16 and fp16 training steps with DeepSpeed ZeRO-2 on the GPU (nccl), the tiny preset: loss and step time.
# 2. The exported decoder and the fused-attention decoder on ONNX Runtime's CUDA execution provider: logit parity
#    with PyTorch on the GPU, and one decoding step at 1 and 16 rows.
set -uo pipefail
out=${1:-${OUT:-./gpu-check}}
mkdir -p "$out"
report="$out/gpu-check.txt"
python=${PYTHON:-python3}
exec > >(tee "$report") 2>&1
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
"$python" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name())" \
  || { echo "no CUDA device seen by PyTorch: nothing checked"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$python" -m pip install -q --no-deps --no-index .whl/*.whl || echo "carried wheels: install failed"
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . || { echo "dstool did not install"; exit 1; }

echo "== 1. DeepSpeed training steps on the GPU"
if "$python" -c "import deepspeed" 2>/dev/null; then
  for precision in bf16 fp16; do
    started=$(date +%s.%N)
    "$python" -m dstool.cli train --output "$out/train-$precision" --nproc 1 --zero 2 --precision "$precision" \
      --max-steps 30 --seq-len 256 2>&1 | tail -3
    echo "$precision: exit $?, $(echo "$(date +%s.%N) - $started" | bc) s for 30 steps (start-up included)"
  done
else
  echo "deepspeed is not installed there (carry its wheel in .whl/): training not checked"
fi

echo "== 2. Decoders on ONNX Runtime's CUDA execution provider"
"$python" - <<'EOF'
import time

import numpy as np
import onnxruntime as ort
import torch
from pathlib import Path

if "CUDAExecutionProvider" not in ort.get_available_providers():
    print(f"onnxruntime {ort.__version__} has no CUDA execution provider (carry onnxruntime-gpu): not checked")
    raise SystemExit(0)
from transformers import LlamaConfig, LlamaForCausalLM

from dstool.fused_decoder import export_fused_decoder
from dstool.onnx_export import export_decoder_model

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)).eval()
work = Path("gpu-check-graphs")
graphs = {"exported": export_decoder_model(model, work / "exported").path,
          "fused": export_fused_decoder(model, work / "fused")}
providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
from dstool.engine import FusedRunner
from dstool.onnx_export import empty_cache, run_decoder

prompt = torch.randint(0, 4096, (3, 11), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    reference = model(input_ids=prompt).logits.numpy()
for name, path in graphs.items():
    session = ort.InferenceSession(str(path), providers=providers)
    print(name, "runs on", session.get_providers()[0])
    shapes = {i.name: (i.shape[1], i.shape[3]) for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    if name == "exported":
        logits, _ = run_decoder(session, prompt.numpy(), empty_cache(session, 3), 0)
    else:
        logits = FusedRunner(session).run(prompt.numpy(), np.zeros(3, np.int64),
                                          {n: np.zeros((3, h, 32, d), np.float32) for n, (h, d) in shapes.items()})
    print(f"{name}: prefill max |logit diff| to PyTorch {np.abs(logits - reference).max():.2g}")
    for rows in (1, 16):
        ids = np.ones((rows, 1), np.int64)
        if name == "exported":
            feeds = {"input_ids": ids, "attention_mask": np.ones((rows, 129), np.int64), "position_ids": ids * 128,
                     **{n: np.zeros((rows, h, 128, d), np.float32) for n, (h, d) in shapes.items()}}
            step = lambda: session.run(["logits"], feeds)  # noqa: E731
        else:
            runner = FusedRunner(session)
            buffers = {n: np.zeros((rows, h, 256, d), np.float32) for n, (h, d) in shapes.items()}
            step = lambda: runner.run(ids, np.full(rows, 128), buffers)  # noqa: E731
        step()
        started = time.perf_counter()
        for _ in range(50):
            step()
        print(f"{name}: {rows} rows, 128 cached positions: {(time.perf_counter() - started) / 50 * 1e3:.2f} ms a step")
EOF
echo "== done"
