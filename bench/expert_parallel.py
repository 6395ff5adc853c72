"""Expert parallelism against replicated experts: peak memory per rank and tokens/s of `dstool train` on the same
DeepSeek-V3-shaped MoE model, data, ranks, ZeRO stage, global batch and steps, interleaved rounds, medians; then
`dstool plan`'s projection of the same comparison for DeepSeek-V3 on GPUs (a projection, not a measurement).

    .venv/bin/python bench/expert_parallel.py [--experts 32] [--hidden 256] [--moe-layers 4] [--nproc 2] [--zero 1]
        [--steps 8] [--rounds 2]

The model is a random-weight DeepseekV3 folder (MLA attention, one dense layer, then MoE layers of --experts routed
experts, top-2, one shared expert); the tokenizer is a BPE trained on the embedded corpus. Peak memory: the largest
resident set of any rank, sampled every 0.1 s while it trains (and over the whole run, which ends with rank 0
gathering model/). Tokens/s: median of the metrics rows after the first two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _model(folder: Path, a) -> int:
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from dstool.corpus import read_documents
    from dstool.train import data

    tok = data.train_tokenizer(read_documents(None), 4096)
    config = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden, moe_intermediate_size=2 * a.hidden,
        num_hidden_layers=a.moe_layers + 1, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=a.experts, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        q_lora_rank=a.hidden // 2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=False, rope_scaling=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def _ranks_rss(pid: int) -> int:
    """The largest resident set among the training ranks under `pid` (0 when none is up)."""
    import psutil

    try:
        ranks = [c for c in psutil.Process(pid).children(recursive=True) if "dstool.train.worker" in c.cmdline()]
        return max((c.memory_info().rss for c in ranks), default=0)
    except psutil.Error:
        return 0


def run(a, model: Path, ep: int, out: Path) -> tuple[int, int, list[float]]:
    """(peak rank RSS while training, peak rank RSS of the whole run incl. gathering model/, tokens/s rows)."""
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--model", str(model), "--nproc",
           str(a.nproc), "--zero", str(a.zero), "--expert-parallel", str(ep), "--max-steps", str(a.steps),
           "--save-every", str(a.steps), "--log-every", "1", "--seq-len", str(a.seq_len), "--micro-batch-size",
           str(a.micro_batch_size), "--eval-batches", "1", "--no-tensorboard", "--resume", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    training = whole = 0
    while proc.poll() is None:
        rss = _ranks_rss(proc.pid)
        whole = max(whole, rss)
        if not (out / "model").exists() and not (out / ".model.tmp").exists():
            training = max(training, rss)
        time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return training, whole, [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]


def projection(a) -> str:
    """`dstool plan`'s memory per GPU and all-to-all volume for DeepSeek-V3 on the guides' 16 x 8 A100s, replicated
    experts against expert parallelism (ZeRO-2 with optimizer offload: the only way it fits 128 of them)."""
    lines = [f"{'layout':22s} {'GiB/GPU':>8s} {'fits':>5s} {'all-to-all GB/step/GPU':>23s} {'GPU-hours':>10s}"]
    for ep in (1, *a.plan_ep):
        proc = subprocess.run([sys.executable, "-m", "dstool.cli", "plan", "--model", "deepseek-v3", "--tokens", "1e11",
                               "--gpu", "A100", "--gpus", "128", "--expert-parallel", str(ep), "--zero", "2",
                               "--offload-optimizer", "--seq-len", "4096", "--micro-batch-size", "1",
                               "--global-batch-size", "1024", "--activation-checkpointing", "--format", "json"],
                              capture_output=True, text=True)
        name = "replicated experts" if ep == 1 else f"EP{ep}"
        if proc.returncode:  # fits nowhere: the plan's one-line reason
            lines.append(f"{name:22s} {proc.stderr.strip().splitlines()[-1][:160]}")
            continue
        c = json.loads(proc.stdout)["clusters"][0]
        mem = next(m for m in c["memory"] if m["zero"] == 2)
        lines.append(f"{name:22s} {mem['device_gib']:8.1f} {'yes' if mem['fits'] else 'no':>5s} "
                     f"{c['communication']['expert_parallel'] / 1e9:23.0f} {c['gpu_hours'] or 0:10.0f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--plan-ep", type=int, nargs="*", default=[8, 32, 128], help="expert-parallel sizes projected")
    p.add_argument("--projection-only", action="store_true", help="print the plan's projection only")
    a = p.parse_args()
    if a.projection_only:
        print(projection(a))
        return
    layouts = (1, a.nproc)
    results: dict[int, tuple[list[int], list[int], list[float]]] = {ep: ([], [], []) for ep in layouts}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-ep-") as tmp:
        root = Path(tmp)
        expert_params = _model(root / "model", a)
        for r in range(a.rounds):
            for ep in layouts:
                training, whole, rates = run(a, root / "model", ep, root / f"ep{ep}-{r}")
                results[ep][0].append(training)
                results[ep][1].append(whole)
                results[ep][2].extend(rates)
    print(f"DeepSeek-V3 shape: hidden {a.hidden}, {a.moe_layers} MoE layers x {a.experts} routed experts (top-2, 1 "
          f"shared), {expert_params / 1e6:.1f} M routed-expert parameters; {a.nproc} ranks, ZeRO-{a.zero}, fp32, "
          f"micro-batch {a.micro_batch_size} x {a.seq_len} tokens, {a.steps} steps x {a.rounds} rounds")
    print(f"{'layout':22s} {'peak MiB/rank training':>22s} {'whole run':>9s} {'tokens/s':>9s} {'memory':>7s} "
          f"{'speed':>6s}")
    base = [statistics.median(x) for x in results[1]]
    for ep in layouts:
        training, whole, rate = (statistics.median(x) for x in results[ep])
        name = "replicated experts" if ep == 1 else f"expert-parallel EP{ep}"
        print(f"{name:22s} {training / 2**20:22.0f} {whole / 2**20:9.0f} {rate:9.0f} {training / base[0]:6.2f}x "
              f"{rate / base[2]:5.2f}x")
    print("Projection, not a measurement (dstool plan: DeepSeek-V3, 16 nodes x 8 A100-80GB, ZeRO-2 + optimizer "
          "offload, seq 4096, 1,024 sequences per step, activation checkpointing, 1e11 tokens):")
    print(projection(a))


if __name__ == "__main__":
    main()
