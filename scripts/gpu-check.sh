#!/usr/bin/env bash
# The GPU checks issue 25 asks for, as one short script for a lent GPU machine (the `device` tool: about 15 minutes
# of device time for a session, no network there). It uses the machine's own python3 (PyTorch with CUDA) and
# installs dstool from this tree without its dependencies; DeepSpeed, onnxruntime-gpu, nvidia-ml-py and
# prometheus-client come as wheels carried in .whl/ (prepare them here: `python3 -m pip download --no-deps -d .whl
# deepspeed onnxruntime-gpu nvidia-ml-py prometheus-client`; a wheel over the carry limit is left out, and the check
# that needs it says so instead of failing).
#
#   bash scripts/gpu-check.sh [OUT]      # figures in OUT/gpu-check.txt (default $OUT or ./gpu-check)
#
# 1. bf16 and fp16 training steps with DeepSpeed ZeRO-2 on the GPU (nccl), the tiny preset: loss and step time.
# 2. The exported decoder and the fused-attention decoder on ONNX Runtime's CUDA execution provider: logit parity
#    with PyTorch on the GPU, and one decoding step at 1 and 16 rows.
#    Then --micro-batch-size auto: the sizes that ran out of memory, the one kept.
# 3. GPU hardware metrics (issue 28, train/hardware.py) during a run with --metrics-port: dstool_train_gpus >= 1 and
#    each GPU's temperature, power, memory used/total and utilisation above 0 in the scrapes; PCIe TX/RX printed (a
#    tiny model may move next to nothing); the same figures in TensorBoard as gpu/KEY/INDEX.
# 4. Issue 29: DeepSpeed AutoEP's MoE layer (grouped GEMM on CUDA) in bf16 on one GPU (autoep_size 1: NCCL takes no
#    two ranks on one GPU, so the all-to-all itself needs a second GPU), its losses beside the model's own MoE blocks
#    and its gathered model/ through the reload gate; `dstool doctor`'s GPU topology line.
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
  # issue 28: --micro-batch-size auto probes the real step at 4096, 2048, ... sequences of 1024 tokens (~40 KB of
  # activations per token for the tiny preset: ~170 GB at 4096) and keeps the global batch by accumulation
  "$python" -m dstool.cli train --output "$out/train-auto" --nproc 1 --zero 2 --micro-batch-size auto \
    --global-batch-size 4096 --seq-len 1024 --max-steps 2 2>&1 \
    | grep -E "micro batch|error" | tail -4
  echo "auto micro batch: exit $? (the lines above name the sizes that ran out of memory and the one kept)"
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
from dstool.decoding.engine import FusedRunner
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
echo "== 3. GPU hardware metrics (NVML) during a training run"
if "$python" -c "import deepspeed, pynvml, prometheus_client" 2>/dev/null; then
  "$python" - "$out/train-hardware" <<'EOF'
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

run = Path(sys.argv[1])
log = open(f"{run}.log", "w")
proc = subprocess.Popen([sys.executable, "-m", "dstool.cli", "train", "--output", str(run), "--nproc", "1", "--zero",
                         "2", "--max-steps", "600", "--save-every", "600", "--log-every", "50", "--seq-len", "256",
                         "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)
gpus, peak, labels, scrapes = set(), {}, set(), 0
while proc.poll() is None:  # the sampler reads NVML every 5 s: several samples while it trains
    time.sleep(1)
    if not (run / "metrics_endpoint.json").is_file():
        continue
    port = json.loads((run / "metrics_endpoint.json").read_text())["port"]
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        continue
    scrapes += 1
    for s in (s for family in text_string_to_metric_families(text) for s in family.samples):
        if s.name == "dstool_train_gpus":
            gpus.add(s.value)
        elif s.name.startswith("dstool_train_gpu_"):
            peak[s.name] = max(peak.get(s.name, 0.0), s.value)
            labels.add(tuple(sorted(s.labels)))
print(f"exit {proc.returncode}, {scrapes} scrapes; dstool_train_gpus {sorted(gpus)}; labels {sorted(labels)}")
for name, value in sorted(peak.items()):
    print(f"  {name}: peak {value:g}")
need = ["temperature_celsius", "power_watts", "memory_used_bytes", "memory_total_bytes", "utilization_percent"]
zero = [key for key in need if peak.get(f"dstool_train_gpu_{key}", 0.0) <= 0]
events = EventAccumulator(str(run / "tensorboard"))
events.Reload()
tags = sorted(t for t in events.Tags()["scalars"] if t.startswith("gpu/"))
print(f"TensorBoard: {len(tags)} gpu/ tags, e.g. {tags[:3]}")
ok = proc.returncode == 0 and gpus and min(gpus) >= 1 and not zero and "gpu/temperature_celsius/0" in tags
print("GPU hardware metrics:", "OK" if ok else f"FAILED (zero or missing: {zero}; see {run}.log)")
EOF
else
  echo "deepspeed, pynvml (nvidia-ml-py) or prometheus_client is not installed there (carry their wheels): not checked"
fi
echo "== 4. AutoEP's MoE layer on the GPU (bf16) and doctor's GPU topology"
if "$python" -c "import deepspeed" 2>/dev/null; then
  echo '{"expert_parallel": {"enabled": true, "autoep_size": 1, "preset_model": "deepseek_v3"}}' > "$out/autoep.json"
  for mode in plain autoep; do
    extra=(); [ "$mode" = autoep ] && extra=(--deepspeed-config "$out/autoep.json")
    "$python" -m dstool.cli train --output "$out/moe-$mode" --model tiny-moe --nproc 1 --zero 2 --precision bf16 \
      --max-steps 20 --save-every 20 --log-every 5 --seq-len 256 "${extra[@]}" 2>&1 | grep -E "^step|wrote|error"
    echo "$mode: exit ${PIPESTATUS[0]}"
  done
else
  echo "deepspeed is not installed there: AutoEP not checked"
fi
"$python" -m dstool.cli doctor --nproc 1 --output "$out/doctor-run" 2>&1 | grep -E "GPU|layout"
echo "== done"
