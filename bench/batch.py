"""Offline batch generation: `dstool batch` on Spark against serving the same rows one request at a time and against
plain onnxruntime loops on the same decoder graph, measured in the same run.

    .venv/bin/python bench/batch.py [--repository model_repository] [--rows 1000] [--max-new-tokens 24] [--rounds 3]

The same ROWS embedded held-out prompts (dstool.corpus.heldout_prompts), MAX_NEW_TOKENS new tokens each, greedy,
stopping at the end of sequence as every system does; rows/s, medians of interleaved rounds (each round starts with
the next system):
- dstool batch (run_batch, engine onnx, master local[2]) in a fresh Python process each round, output overwritten:
  the Spark job's own time (the manifest's figures.seconds), run_batch's wall time (Spark's start, reading and
  counting the rows, the job, the manifest) and the whole process's (Python's imports too);
- dstool infer's path: tritonclient gRPC to a Triton this benchmark starts on the repository, one request after
  another (MODEL_generate), on the first --infer-rows rows only;
- the limit: one process, onnxruntime with every core (intra-op threads = cores), greedy, one row at a time with
  the key/value cache (a prefill, then one step per token);
- the same loop on static batches of --static-batch rows (left-padded, masked): what batching alone buys.
Target (the issue): dstool batch >= 0.8x the limit at 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import cpu_name

# Runs in a fresh Python process (a Spark session per process, as `dstool batch` has): argv = config JSON.
BATCH_CHILD = """
import json, sys, time
began = time.perf_counter()
from dstool.serve.batch import run_batch
from dstool.serve.config.client_config import BatchConfig
cfg = BatchConfig(**json.loads(sys.argv[1]))
called = time.perf_counter()
m = run_batch(cfg)
done = time.perf_counter()
print(json.dumps({"run_batch_s": done - called, "imports_s": called - began, "job_s": m.figures.seconds,
                  "rows": m.figures.rows, "failed": m.figures.failed,
                  "generated_tokens": m.figures.generated_tokens, "partitions": len(m.partitions)}))
"""


def repository(path: str | None) -> Path | None:
    from dstool.artifacts import kind_of

    repo = Path(path or "model_repository")
    return repo if kind_of(repo) == "model-repository" else None


def deployment(repo: Path, name: str | None):
    from dstool.artifacts import Repository

    ds = [d for d in Repository.read(repo).deployments if name in (None, d.name)]
    if not ds:
        raise SystemExit(f"{repo} holds no model {name!r}: pass --model")
    first = ds[0].name
    return max((d for d in ds if d.name == first), key=lambda d: d.version)


class Loop:
    """The plain onnxruntime loop on the exported decoder graph: greedy, the cache the graph returns fed back."""

    def __init__(self, repo: Path, d, threads: int):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from dstool.serve.config.export_config import model_names
        from dstool.serve.export import repository as repos

        names = model_names(d.name)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(repo / names["decoder"] / str(d.version) / "model.onnx"), opts,
                                            providers=["CPUExecutionProvider"])
        llm = repo / names["llm"]
        self.tokenizer = AutoTokenizer.from_pretrained(llm / str(d.version))
        self.shapes = repos.cache_shapes(llm / "config.pbtxt")
        params = repos.read_config(llm / "config.pbtxt").parameters
        self.eos = set(json.loads(params["eos_token_ids"].string_value))
        self.outputs = ["logits", *(n.replace("past_key_values.", "cache.", 1) for n in self.shapes)]

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `prompts` decoded together (left-padded, the padding masked)."""
        rows, width = len(prompts), max(len(p) for p in prompts)
        ids = np.zeros((rows, width), np.int64)
        mask = np.zeros((rows, width), np.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        positions = np.maximum(mask.cumsum(1) - 1, 0)
        past = {n: np.zeros((rows, h, 0, d), np.float32) for n, (h, d) in self.shapes.items()}
        out: list[list[int]] = [[] for _ in prompts]
        live = np.ones(rows, bool)
        tokens = ids
        for _ in range(new_tokens):
            logits, *caches = self.session.run(self.outputs, {"input_ids": tokens, "attention_mask": mask,
                                                              "position_ids": positions, **past})
            past = dict(zip(self.shapes, caches))
            chosen = logits[:, -1].argmax(-1)
            for i in np.flatnonzero(live):
                out[i].append(int(chosen[i]))
                live[i] = chosen[i] not in self.eos
            if not live.any():
                break
            tokens = chosen[:, None].astype(np.int64)
            positions = positions[:, -1:] + 1
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
        return out

    def run(self, prompts: list[str], new_tokens: int, batch: int = 1) -> dict:
        started = time.perf_counter()
        made = 0
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            outputs = self._generate([self.tokenizer(p)["input_ids"] for p in chunk], new_tokens)
            made += sum(len(o) for o in outputs)
            for o in outputs:
                self.tokenizer.decode(o, skip_special_tokens=True)
        wall = time.perf_counter() - started
        return {"rows_per_s": len(prompts) / wall, "seconds": wall, "generated_tokens": made, "rows": len(prompts)}


def run_dstool_batch(repo: Path, d, work: Path, rows: int, new_tokens: int, input_path: str | None) -> dict:
    cfg = {"output": str(work / "batch-out"), "repository": str(repo), "model": d.name, "version": d.version,
           "max_new_tokens": new_tokens, "overwrite": True, "master": "local[2]"}
    cfg.update({"input": input_path} if input_path else {"max_rows": rows} if rows < 1000 else {})
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", BATCH_CHILD, json.dumps(cfg)], capture_output=True, text=True)
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"dstool batch failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["rows"] != rows or got["failed"]:
        raise RuntimeError(f"dstool batch wrote {got['rows']} rows ({got['failed']} failed), not {rows}")
    return {**got, "process_s": process_s, "job_rows_per_s": rows / got["job_s"],
            "run_batch_rows_per_s": rows / got["run_batch_s"], "process_rows_per_s": rows / process_s}


def run_infer(url: str, name: str, prompts: list[str], new_tokens: int) -> dict:
    from dstool.serve.runtime.client import generate_text

    started = time.perf_counter()
    made = sum(len(generate_text(url, "grpc", name, p, new_tokens)[1]) for p in prompts)
    wall = time.perf_counter() - started
    return {"rows_per_s": len(prompts) / wall, "seconds": wall, "generated_tokens": made, "rows": len(prompts)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", help="a dstool export repository (default: model_repository)")
    p.add_argument("--model", default=None, help="the model family's name in the repository (default: its first)")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--infer-rows", type=int, default=100, help="rows timed through Triton one request at a time")
    p.add_argument("--static-batch", type=int, default=16, help="rows per static batch of the batched loop; 0: skip")
    p.add_argument("--skip", action="append", default=[], help="a system not to run: batch, infer, loop, static")
    a = p.parse_args()
    repo = repository(a.repository)
    if repo is None:
        print(f"{a.repository or 'model_repository'} is not a model repository written by dstool: run `dstool "
              "pipeline` or `dstool export MODEL --repository REPO` first, or pass --repository", file=sys.stderr)
        return 2
    import onnxruntime as ort

    from dstool.corpus import heldout_prompts
    from dstool.proc import free_port
    from dstool.serve.config.export_config import model_names
    from dstool.serve.runtime import triton

    d = deployment(repo, a.model)
    # more rows than the 1,000 embedded prompts: those again, in turn (a jsonl file for dstool batch)
    embedded = heldout_prompts()
    prompts = [embedded[i % len(embedded)] for i in range(a.rows)]
    cores = os.cpu_count() or 1
    skip = set(a.skip) | ({"static"} if a.static_batch <= 0 else set())
    with tempfile.TemporaryDirectory(prefix="dstool-bench-batch-") as tmp:
        work = Path(tmp)
        server = None
        systems = {}
        try:
            if "batch" not in skip:
                # the embedded prompts are dstool batch's default input; more rows than those: a jsonl file
                input_path = None
                if a.rows > 1000:
                    input_path = str(work / "prompts.jsonl")
                    Path(input_path).write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
                systems["dstool batch (Spark local[2], onnx)"] = lambda: run_dstool_batch(
                    repo, d, work, a.rows, a.max_new_tokens, input_path)
            if "infer" not in skip:
                print("starting Triton ...", flush=True)
                server = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                                      work / "triton.log", timeout=300)
                subset = prompts[:a.infer_rows]
                run_infer(server.grpc_url, d.name, subset[:2], a.max_new_tokens)  # warm up
                systems[f"dstool infer path: Triton gRPC, one request at a time ({len(subset)} rows)"] = \
                    lambda: run_infer(server.grpc_url, d.name, subset, a.max_new_tokens)
            loop = Loop(repo, d, cores)
            loop.run(prompts[:2], a.max_new_tokens)  # warm up
            if "loop" not in skip:
                systems[f"onnxruntime loop, 1 row at a time, {cores} threads (the limit)"] = \
                    lambda: loop.run(prompts, a.max_new_tokens)
            if "static" not in skip:
                systems[f"onnxruntime loop, static batches of {a.static_batch}, {cores} threads"] = \
                    lambda: loop.run(prompts, a.max_new_tokens, a.static_batch)
            results: dict[str, list[dict]] = {k: [] for k in systems}
            order = list(systems)
            for r in range(a.rounds):
                for label in order[r % len(order):] + order[:r % len(order)]:
                    time.sleep(1.0)
                    results[label].append(systems[label]())
                print(f"round {r + 1} of {a.rounds} done", flush=True)
        finally:
            if server is not None:
                code = server.stop()
                if code != 0:
                    print(f"Triton exited {code}; its log ends:\n{server.log_tail(15)}", file=sys.stderr)
    folder = repo / model_names(d.name)["decoder"] / str(d.version)
    report(results, a, cores, ort.__version__, sum(f.stat().st_size for f in folder.glob("model.onnx*")) / 1e6)
    return 0


def report(results: dict[str, list[dict]], a, cores: int, ort_version: str, weights_mb: float) -> None:
    def med(label: str, key: str) -> float | None:
        rows = results.get(label)
        return float(np.median([r[key] for r in rows])) if rows and key in rows[0] else None

    def spread(label: str, key: str) -> str:
        values = [r[key] for r in results.get(label, []) if key in r]
        return f"{min(values):.1f}–{max(values):.1f}" if values else "–"

    cpu = cpu_name()
    print(f"\n{cpu}, {cores} cores; onnxruntime {ort_version}; decoder graph {weights_mb:.1f} MB; {a.rows} held-out "
          f"prompts, {a.max_new_tokens} new "
          f"tokens at most, greedy, stopping at the end of sequence; medians of {a.rounds} interleaved rounds\n")
    table = []
    for label in results:
        if label.startswith("dstool batch"):
            for key, what in (("job_rows_per_s", "the Spark job (figures.seconds)"),
                              ("run_batch_rows_per_s", "run_batch wall, Spark's start included"),
                              ("process_rows_per_s", "the whole process, Python's imports included")):
                table.append((f"{label}: {what}", med(label, key), spread(label, key),
                              med(label, "generated_tokens")))
        else:
            table.append((label, med(label, "rows_per_s"), spread(label, "rows_per_s"),
                          med(label, "generated_tokens")))
    limit = next((v for k, v, _, _ in table if k.endswith("(the limit)")), None)
    print("| system | rows/s | rounds, min–max | ratio to the limit | generated tokens |\n|---|---:|---:|---:|---:|")
    for label, value, rounds, tokens in table:
        ratio = f"{value / limit:.2f}x" if value and limit else "–"
        cells = f"{value:.1f} | {rounds} | {ratio} | {tokens:.0f}" if value else "– | – | – | –"
        print(f"| {label} | {cells} |")
    batch = next((label for label in results if label.startswith("dstool batch")), None)
    if batch:
        parts = {k: med(batch, k) for k in ("imports_s", "run_batch_s", "job_s", "process_s", "partitions")}
        print(f"\ndstool batch, seconds (medians): process {parts['process_s']:.1f} = imports {parts['imports_s']:.1f}"
              f" + run_batch {parts['run_batch_s']:.1f} (of which the job {parts['job_s']:.1f}, "
              f"{parts['partitions']:.0f} partitions) + the rest (interpreter start, exit)")
    print("target (the issue): dstool batch >= 0.8x the limit at 2 cores", end="")
    got = [(what, v / limit) for what, (k, v, _, _) in zip(("job", "run_batch wall", "process wall"), table[:3])
           if batch and limit and v and k.startswith("dstool batch")]
    print(": " + ", ".join(f"{what} {r:.2f}x ({'met' if r >= 0.8 else 'not met'})" for what, r in got) if got else "")


if __name__ == "__main__":
    sys.exit(main())
