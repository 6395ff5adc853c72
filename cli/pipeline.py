"""`run_pipeline(config)`: the whole dstool job on one machine, as `dstool pipeline` runs it — a list of
steps, each with a gate (`dstool.steps`):

  train      DeepSpeed, N ranks                    gate: model/ reloads with the engine's logits (train's own)
  compress   int8 and a pruned variant             gate: compress's own (parity, integer ops, speed, reload)
  export     the int8 output -> Triton repository  gate: every config against Triton's schema and the graphs
  serve      Triton behind the cache gateway       gate: the generation entry point is ready
  infer      prompts over HTTP and gRPC            gate: both protocols return the same text
  stream     a chat completion, OpenAI route       gate: token by token, and the cached stream the same
  report     compression table, cache hit rate     gate: the repeated prompts were cache hits
  shutdown   SIGTERM (runs whatever failed)        gate: exit code 0

Each stage's own lines go to the run's log (OUTPUT/pipeline.log); the console gets the step lines and results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pydantic import Field, model_validator

from dstool import log as dlog
from dstool.config import CommandConfig
from dstool.errors import StageFailed
from dstool.proc import check_port_free, stop_process
from dstool.serve.cache_url import AUTO, CacheURL
from dstool.serve.config.export_config import ExportConfig
from dstool.steps import Step, run_steps

log = dlog.log
# %: an int8 variant that keeps less of the model's held-out perplexity is refused (measured: 99.1 on SmolLM2 and on
# its fine-tune here; int8 kernels differ between CPUs, so the gate leaves a point)
INT8_MIN_RECOVERY = 98.0
PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach", "JULIET:\nO Romeo, Romeo,"]
REAL_PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):"]
# The structured answer and the tool call the chat step asks a real model for.
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER_TOOL: dict = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class PipelineConfig(CommandConfig):
    """`dstool pipeline`: train -> compress -> export -> serve -> infer on the embedded default."""

    model: str = Field("tiny", description="tiny: a model trained from scratch here (the quick run); or a real "
                       "pretrained model (smollm2, a .gguf file or a Hugging Face folder), fine-tuned with LoRA on "
                       "real conversations, then compressed, served and asked for a structured answer and a tool "
                       "call")
    output: str = Field("runs/pipeline", description="folder of the train run, the compress outputs and the logs")
    repository: str = Field("model_repository", description="the Triton model repository written")
    nproc: int = Field(2, ge=1, description="training ranks")
    train_steps: int = Field(300, ge=1, description="training steps (a real model: its LoRA fine-tune's, 10 unless "
                             "given)")
    lora: int = Field(16, ge=1, description="a real model: the LoRA rank of its fine-tune")
    prune: float = Field(0.3, gt=0, lt=1, description="pruned variant's share of decoder-layer parameters")
    prune_ppl_tolerance: float = Field(50.0, ge=0, description="pruned variant: of the layouts whose calibration "
                                       "perplexity is within this % of the best's, the fastest on ONNX Runtime (0: "
                                       "the lowest-loss layout, untimed; as dstool compress)")
    recover_steps: int = Field(30, ge=0, description="pruned variant's recovery fine-tuning steps")
    # lower than compress's default: docs/pipeline.md has the recovery lr measured on the pipeline's model
    recover_lr: float = Field(2e-4, gt=0, description="recovery peak learning rate")
    cache: CacheURL = Field(AUTO, description="gateway cache URL, or auto: $DSTOOL_REDIS_URL or the local Redis if "
                            "it answers, else an in-process LRU", json_schema_extra={"cli": {"metavar": "URL"}})
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(8001, ge=1, le=65535)
    metrics_port: int = Field(8002, ge=1, le=65535)
    max_new_tokens: int = Field(24, ge=1, description="tokens generated per prompt")
    prompts: list[str] = Field(default_factory=lambda: list(PROMPTS), description="a prompt (repeat the flag; "
                               "default: three built in)", json_schema_extra={"cli": {"flag": "--prompt",
                                                                                      "metavar": "TEXT"}})
    latency_repeats: int = Field(20, ge=1, description="timed runs per latency figure in the compression reports")
    ready_timeout: float = Field(300.0, gt=0, description="seconds to wait for the served models")

    @model_validator(mode="after")
    def _for_this_model(self) -> PipelineConfig:
        """A flag of the other kind of run is refused, not ignored."""
        pruned = {"prune", "prune_ppl_tolerance", "recover_steps", "recover_lr"} & self.model_fields_set
        if self.model != "tiny" and pruned:
            raise ValueError(f"{', '.join(sorted(pruned))}: a real model's pipeline makes no pruned variant (only "
                             "int8); drop them, or compress it with dstool compress --prune")
        if self.model == "tiny" and "lora" in self.model_fields_set:
            raise ValueError("lora: the tiny model is trained from scratch, not fine-tuned; drop it, or give a real "
                             "model (--model smollm2)")
        return self


def run_pipeline(cfg: PipelineConfig) -> dict:
    """Run every step; returns a summary (the answers, the compression table, the cache hit rate)."""
    for port in (cfg.http_port, cfg.grpc_port, cfg.metrics_port):  # before minutes of training, not after
        check_port_free("127.0.0.1", port)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    dlog.to_file(out / "pipeline.log")
    run = _Run(cfg, out)
    if run.real:
        first = [Step("fine-tune", f"{cfg.model}: LoRA rank {cfg.lora} on real conversations, ZeRO-3, {cfg.nproc} "
                      f"DeepSpeed ranks, {run.train_steps} steps, merged", run.train),
                 Step("compress", f"int8 weight-only (ONNX Runtime), refused under {INT8_MIN_RECOVERY:g} % recovery",
                      run.compress)]
    else:
        first = [Step("train", f"tiny model, {cfg.nproc} DeepSpeed ranks, {cfg.train_steps} steps", run.train),
                 Step("compress", f"int8 (ONNX Runtime), and a variant pruned {cfg.prune:.0%}"
                      + (f" with {cfg.recover_steps} recovery steps" if cfg.recover_steps else ""), run.compress)]
    steps = [
        *first,
        Step("export", f"the int8 output -> {cfg.repository}/ (tensor model, decoder with cache, text models)",
             run.export),
        Step("serve", "Triton behind the cache gateway", run.serve),
        Step("infer", f"{len(run.prompts)} prompts, each sent over HTTP, then gRPC, then HTTP again", run.infer,
             gate=run.same_text),
        Step("stream", "a chat completion streamed through the gateway's OpenAI route (the openai client), twice",
             run.stream, gate=run.streamed),
        *([Step("chat", "a structured answer (json_schema) and a tool call, the OpenAI client; the greedy answer "
                "against transformers' generate on the fine-tuned folder", run.chat, gate=run.chatted)]
          if run.real else []),
        Step("report", "compression table and cache hit rate", run.report, gate=run.cache_hits),
        Step("shutdown", "SIGTERM to dstool serve", run.shutdown, gate=lambda code: None if code == 0 else
             f"dstool serve exited with {code}; see {out / 'serve.log'}", cleanup=True),
    ]
    started = time.monotonic()
    try:
        run_steps(steps, "pipeline")
    finally:
        (out / "pipeline.json").write_text(json.dumps({"steps": [s.summary() for s in steps],
                                                       **run.summary}, indent=1) + "\n")
    log.info(f"[pipeline] done in {time.monotonic() - started:.0f} s; steps, answers and figures: "
             f"{out / 'pipeline.json'}, log: {out / 'pipeline.log'}")
    return run.summary


class _Run:
    """The steps' shared state: what each step made, for the next."""

    def __init__(self, cfg: PipelineConfig, out: Path):
        self.cfg, self.out = cfg, out
        self.summary: dict = {}
        self.real = cfg.model != "tiny"
        self.train_steps = cfg.train_steps if not self.real or "train_steps" in cfg.model_fields_set else 10
        self.prompts = cfg.prompts if not self.real or "prompts" in cfg.model_fields_set else list(REAL_PROMPTS)
        # a real model's timings take seconds each: 5 rounds unless given (measured: 20 took 335 s of the 530)
        self.latency_repeats = cfg.latency_repeats if not self.real or "latency_repeats" in cfg.model_fields_set \
            else 5
        self.server: subprocess.Popen | None = None

    def train(self):
        from dstool import corpus  # noqa: PLC0415 (numpy: the CLI's parser imports this module)
        from dstool.train import TrainConfig, train  # noqa: PLC0415 (a stage, loaded when the pipeline reaches it)

        c, steps = self.cfg, self.train_steps
        if self.real:  # LoRA on the shipped real conversations (chatterbot-corpus' train split), merged into model/
            run = TrainConfig(model=c.model, output=str(self.out / "train"), nproc=c.nproc, zero=3, lora=c.lora,
                              data=str(corpus.conversations("train")), data_format="chat", seq_len=256,
                              micro_batch_size=2, max_steps=steps, save_every=steps, lr=1e-3, tensorboard=False)
        else:
            run = TrainConfig(output=str(self.out / "train"), nproc=c.nproc, max_steps=steps, save_every=steps,
                              lr=3e-3, tensorboard=False)
        with dlog.details_to_file():
            result = train(run)
        self.model_dir = result.model_dir
        log.info(f"held-out loss {result.val_loss:.3f}; model: {result.model_dir}")
        return result

    def compress(self):
        from dstool.compress import CompressConfig, compress  # noqa: PLC0415 (a stage, loaded when the pipeline reaches it)

        c, model = self.cfg, str(self.model_dir)
        variants = {"int8": CompressConfig(model=model, output=str(self.out / "int8"), bits=8,
                                           latency_repeats=self.latency_repeats, min_recovery=INT8_MIN_RECOVERY)}
        if not self.real:
            variants[f"prune {c.prune:g}"] = CompressConfig(
                model=model, output=str(self.out / "pruned"), prune=c.prune, prune_ppl_tolerance=c.prune_ppl_tolerance,
                recover_steps=c.recover_steps, recover_lr=c.recover_lr, latency_repeats=c.latency_repeats)
        self.compressed = {}
        for name, variant in variants.items():
            with dlog.details_to_file():
                m = self.compressed[name] = compress(variant)
            f = m.figures
            log.info(f"{name}: size {f.compression_ratio:.3f}x, perplexity {f.perplexity_change_pct:+.2f} %, "
                     f"prefill speed-up {f.speedup['1']:.2f}x / {f.speedup['8']:.2f}x (batch 1 / 8), decoding "
                     f"{f.decode_speedup['1']:.2f}x / {f.decode_speedup['16']:.2f}x (batch 1 / 16); {variant.output}")
        self.summary["compression"] = {name: m.figures.model_dump(mode="json") for name, m in self.compressed.items()}
        return self.compressed

    def export(self):
        from dstool.serve.export import export  # noqa: PLC0415 (a stage, loaded when the pipeline reaches it)

        with dlog.details_to_file():
            deployment = export(ExportConfig(model=str(self.out / "int8"), repository=self.cfg.repository))
        log.info(f"{self.cfg.repository}: version {deployment.version} of {', '.join(deployment.models.values())}")
        self.summary["repository_version"] = deployment.version
        return deployment

    def serve(self):
        """`dstool serve --cache` as a user starts it, in its own process; returns once generation is ready."""
        import tritonclient.http as http

        c, serve_log = self.cfg, self.out / "serve.log"
        command = [sys.executable, "-m", "dstool.cli", "serve", "--repository", c.repository, "--http-port",
                   str(c.http_port), "--grpc-port", str(c.grpc_port), "--metrics-port", str(c.metrics_port),
                   "--log-file", str(self.out / "tritonserver.log"), "--cache",
                   *([str(c.cache)] if c.cache.kind != "auto" else [])]
        with open(serve_log, "w") as sink:
            self.server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + c.ready_timeout
        client = http.InferenceServerClient(f"127.0.0.1:{c.http_port}")
        try:
            while time.monotonic() < deadline:
                if self.server.poll() is not None:
                    tail = serve_log.read_text().strip().splitlines()[-3:]
                    raise StageFailed(f"dstool serve exited with {self.server.returncode}: {' | '.join(tail)}",
                                      log=serve_log)
                try:
                    if client.is_model_ready("dstool_lm_generate"):
                        log.info(f"gateway on HTTP 127.0.0.1:{c.http_port}, gRPC 127.0.0.1:{c.grpc_port}; logs: "
                                 f"{serve_log}, {self.out / 'tritonserver.log'}")
                        return self.server
                except Exception:  # noqa: BLE001 (not listening yet)
                    pass
                time.sleep(1)
        finally:
            client.close()
        raise StageFailed(f"the served models were not ready after {c.ready_timeout:.0f} s", log=serve_log)

    def infer(self):
        from dstool.serve.runtime.client import generate_text  # noqa: PLC0415 (a stage, loaded when the pipeline reaches it)

        answers = []
        for prompt in self.prompts:
            calls = []  # (protocol, text, ms) in the order sent: the first is computed, the repeats are cache hits
            for protocol, port in (("http", self.cfg.http_port), ("grpc", self.cfg.grpc_port),
                                   ("http", self.cfg.http_port)):
                started = time.perf_counter()
                text, _ = generate_text(f"127.0.0.1:{port}", protocol, "dstool_lm", prompt, self.cfg.max_new_tokens)
                calls.append((protocol, text, (time.perf_counter() - started) * 1e3))
            log.info(f"{prompt!r} -> {calls[0][1]!r}  ({', '.join(f'{p} {ms:.0f} ms' for p, _, ms in calls)})")
            answers.append({"prompt": prompt, "texts": [text for _, text, _ in calls]})
        self.summary["answers"] = [{"prompt": a["prompt"], "text": a["texts"][0]} for a in answers]
        return answers

    def stream(self) -> list[list[str]]:
        """The chat completion's pieces as they arrive, twice (computed, then replayed from the cache); shown live
        on a terminal."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.cfg.http_port}/v1", api_key="dstool",
                               max_retries=0, timeout=120)
        messages: list = [{"role": "user", "content": "Describe Paris in one sentence." if self.real else
                           "Speak, Juliet."}]
        runs, times = [], []
        live = sys.stdout.isatty()
        for attempt in range(2):
            pieces, started = [], time.perf_counter()
            chunks = client.chat.completions.create(model="dstool_lm", messages=messages, temperature=0,
                                                    max_tokens=self.cfg.max_new_tokens, stream=True)
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if live and attempt == 0:
                        sys.stdout.write(("    " if len(pieces) == 1 else "") + pieces[-1].replace("\n", " "))
                        sys.stdout.flush()
            if live and attempt == 0:
                sys.stdout.write("\r\033[K")
            runs.append(pieces)
            times.append((time.perf_counter() - started) * 1e3)
        log.info(f"{messages[0]['content']!r} -> {''.join(runs[0])!r}  ({len(runs[0])} pieces in {times[0]:.0f} ms; "
                 f"again from the cache: {times[1]:.0f} ms)")
        self.summary["stream"] = {"messages": messages, "pieces": runs[0]}
        return runs

    def chat(self) -> dict:
        """A structured answer and a tool call from the served model, and its greedy answer beside transformers'
        generate on the fine-tuned folder (the same chat template, the same tokens)."""
        import openai
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.cfg.http_port}/v1", api_key="dstool",
                               max_retries=0, timeout=120)
        ask: list = [{"role": "user", "content": "Name the capital of France and its country as JSON."}]
        structured = client.chat.completions.create(
            model="dstool_lm", messages=ask, temperature=0, max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        weather: list = [{"role": "user", "content": "What is the weather in Paris?"}]
        called = client.chat.completions.create(  # type: ignore[call-overload]
            model="dstool_lm", messages=weather,
            tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=48)
        greeting: list = [{"role": "user", "content": "Hello! How are you today?"}]
        served = client.chat.completions.create(model="dstool_lm", messages=greeting, temperature=0,
                                                max_tokens=self.cfg.max_new_tokens)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        ids = tokenizer.apply_chat_template(greeting, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=self.cfg.max_new_tokens, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        call = (called.choices[0].message.tool_calls or [None])[0]
        result = {"structured": structured.choices[0].message.content,
                  "tool_call": {"name": call.function.name, "arguments": call.function.arguments} if call else None,
                  "served_greedy": served.choices[0].message.content, "transformers_greedy": expected}
        log.info(f"structured: {result['structured']}; tool call: {result['tool_call']}; greedy "
                 f"{greeting[0]['content']!r} -> {result['served_greedy']!r} (transformers on the fine-tuned fp32 "
                 f"folder: {expected!r})")
        self.summary["chat"] = result
        return result

    @staticmethod
    def chatted(result: dict) -> str | None:
        try:
            city = json.loads(result["structured"] or "")
        except ValueError:
            return f"the structured answer is not JSON: {result['structured']!r}"
        if set(city) != {"city", "country"}:
            return f"the structured answer does not follow its schema: {city}"
        call = result["tool_call"]
        if not call or call["name"] != "get_weather" or "city" not in json.loads(call["arguments"] or "{}"):
            return f"no get_weather call with a city: {call}"
        return None

    @staticmethod
    def streamed(runs) -> str | None:
        if len(runs[0]) < 2:
            return f"the answer came in {len(runs[0])} piece(s), not token by token"
        return None if runs[0] == runs[1] else "the cached stream differs from the computed one"

    @staticmethod
    def same_text(answers) -> str | None:
        differ = [a["prompt"] for a in answers if len(set(a["texts"])) != 1]
        return f"HTTP and gRPC gave different text for {differ[0]!r}" if differ else None

    def report(self):
        hits, misses = _cache_counts(self.cfg.http_port)
        log.info(_table(self.compressed))
        rate = hits / (hits + misses) if hits + misses else 0.0
        log.info(f"cache: {hits:.0f} hits, {misses:.0f} misses, hit rate {rate:.0%}")
        self.summary.update(cache_hits=hits, cache_misses=misses, hit_rate=rate)
        return hits

    def cache_hits(self, hits: float) -> str | None:
        repeats = len(self.prompts)
        return None if hits >= repeats else f"repeated prompts should be cache hits: {hits:.0f} hits for {repeats}"

    def shutdown(self) -> int:
        return 0 if self.server is None else stop_process(self.server, grace=60)


def _cache_counts(http_port: int) -> tuple[float, float]:
    """(hits, misses) from the gateway's Prometheus /metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    totals = {"hits": 0.0, "misses": 0.0}
    for line in body.splitlines():
        for kind in totals:
            if line.startswith(f"dstool_gateway_cache_{kind}_total{{"):
                totals[kind] += float(line.rsplit(" ", 1)[1])
    return totals["hits"], totals["misses"]


def _table(compressed: dict) -> str:
    rows = ["| variant | size | perplexity | change | top-1 agreement | speed-up: prefill b1 | prefill b8 | decode b1 "
            "| decode b16 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in compressed.items():
        f = m.figures
        rows.append(f"| {name} | {f.compression_ratio:.3f}x | {f.before.perplexity:.2f} -> {f.after.perplexity:.2f} | "
                    f"{f.perplexity_change_pct:+.2f} % | {f.top1_agreement:.1%} | {f.speedup['1']:.2f}x | "
                    f"{f.speedup['8']:.2f}x | {f.decode_speedup['1']:.2f}x | {f.decode_speedup['16']:.2f}x |")
    return "\n".join(rows)
