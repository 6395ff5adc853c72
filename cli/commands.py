"""`dstool` command line: a thin layer over the Python API. Every command's options are one config model
(its flags generated from the fields, `--config FILE.yaml` for all); the one logging setup happens here."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import BaseModel

from dstool import __version__
from dstool import log as dlog
from dstool.cli.pipeline import PipelineConfig, run_pipeline
from dstool.compress.config import CompressConfig
from dstool.config import add_options, changed, load_config, overrides
from dstool.errors import Failed, UsageError
from dstool.evaluation.config import EvalConfig
from dstool.serve.config.client_config import BatchConfig, InferConfig
from dstool.serve.config.export_config import ExportConfig
from dstool.serve.config.gateway_config import GatewayConfig
from dstool.serve.config.keys_config import KeysConfig, seconds
from dstool.serve.config.serve_config import ServeConfig
from dstool.train.config import DoctorConfig, PlanConfig, TrainCommand


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage block too)
        raise UsageError(f"{message} (see '{self.prog} --help')")


@dataclass
class Command:
    config: Callable[[], type[BaseModel]]  # the command's options (pydantic only, no torch)
    run: Callable[[Any], int | None]
    help: str
    description: str


def _train(cmd) -> int:
    if cmd.emit == "k8s":
        return _emit_k8s(cmd)
    from dstool.train import train  # noqa: PLC0415 (a stage, loaded for its command only)

    result = train(cmd.train_config())
    val = f", held-out loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    dlog.log.info(f"dstool train: done at step {result.step}, train loss {result.train_loss:.4f}{val}; "
                  f"model: {result.model_dir}")
    return 0


def _emit_k8s(cmd) -> int:
    from dstool.train import deepspeed_config, k8s, launch  # noqa: PLC0415 (a stage, loaded for its command only)

    cfg = cmd.train_config()
    topo = launch.plan(cfg.model_copy(update={"hostfile": None, "node_rank": 0 if cfg.num_nodes > 1 else None}))
    if cfg.hostfile:
        hosts = launch.parse_hostfile(cfg.hostfile)
        topo.nodes, topo.procs_per_node = len(hosts), next(iter(hosts.values()))
    deepspeed_config.batch_plan(cfg, topo.nodes * topo.procs_per_node)  # the batch must divide on that world
    print(yaml.safe_dump(k8s.pytorchjob(cfg, topo.nodes, topo.procs_per_node, cmd.image, cmd.pvc), sort_keys=False),
          end="")
    return 0


def _doctor(cfg) -> int:
    from dstool.train import doctor  # noqa: PLC0415 (a stage, loaded for its command only)

    return doctor.run(cfg.hostfile, cfg.master_addr, cfg.master_port, cfg.output, cfg.nproc, cfg.env,
                      cfg.pipeline_stages, cfg.tensor_parallel, cfg.expert_parallel)


def _plan(cfg) -> int:
    from dstool.train.plan import format_table, plan  # noqa: PLC0415 (a stage, loaded for its command only)

    p = plan(cfg)
    print(p.model_dump_json(indent=2) if cfg.format == "json" else format_table(p))
    return 0


def _compress(cfg) -> int:
    from dstool.compress import compress  # noqa: PLC0415 (a stage, loaded for its command only)

    m = compress(cfg)
    f = m.figures
    dlog.log.info(f"dstool compress: {Path(cfg.output) / m.graphs['logits'].path}: size {f.compression_ratio:.3f}x, "
                  f"perplexity {f.before.perplexity:.3f} -> {f.after.perplexity:.3f} "
                  f"({f.perplexity_change_pct:+.2f} %), "
                  f"top-1 agreement {f.top1_agreement:.1%}, prefill speed-up {f.speedup['1']:.2f}x / "
                  f"{f.speedup['8']:.2f}x (batch 1 / 8), decoding {f.decode_speedup['1']:.2f}x / "
                  f"{f.decode_speedup['16']:.2f}x (batch 1 / 16); report: "
                  f"{Path(cfg.output) / m.report}")
    return 0


def _export(cfg) -> int:
    if cfg.target == "edge":
        from dstool.serve.export.edge_package import export_edge  # noqa: PLC0415 (a stage, loaded for its command only)

        export_edge(cfg)
        return 0
    from dstool.serve.export import export  # noqa: PLC0415 (a stage, loaded for its command only)

    export(cfg)
    return 0


def _serve(cfg) -> int:
    if cfg.emit == "k8s":
        from dstool.serve.runtime.k8s import admin_secret_hint, serving_manifests  # noqa: PLC0415 (a stage, loaded for its command only)

        print(yaml.safe_dump_all(serving_manifests(cfg), sort_keys=False), end="")
        hint = admin_secret_hint(cfg)
        if hint:
            dlog.log.warning(hint)
        return 0
    from dstool.serve.runtime.server import serve  # noqa: PLC0415 (a stage, loaded for its command only)

    return serve(cfg)


def _gateway(cfg) -> int:
    from dstool.serve.gateway import run_gateway  # noqa: PLC0415 (a stage, loaded for its command only)

    return run_gateway(cfg)


def _keys(cfg) -> int:
    from dstool.serve import keys  # noqa: PLC0415 (a stage, loaded for its command only)

    url, _ = cfg.redis.chosen()
    if not url.is_redis:
        raise UsageError(f"--redis {url}: API keys live in Redis, give a redis:// URL")
    client = keys.connect(url)
    if cfg.action == "create":
        ident, key = keys.create(client, cfg.tenant, cfg.model_list(), cfg.rpm, cfg.tpm, cfg.budget_tokens,
                                 cfg.per or "", seconds(cfg.expires) if cfg.expires else 0, cfg.cache_scope, cfg.admin)
        print(key)  # alone on stdout, for KEY=$(dstool keys create ...); the note on stderr
        print(f"dstool keys: key {ident} of tenant {cfg.tenant} created; it is shown only now (Redis keeps its hash)",
              file=sys.stderr)
    elif cfg.action == "rotate":
        print(keys.rotate(client, cfg.key_id, seconds(cfg.grace)))
        print(f"dstool keys: key {cfg.key_id} has a new secret, shown only now; the old one works {cfg.grace} more",
              file=sys.stderr)
    elif cfg.action == "revoke":
        tenant = keys.revoke(client, cfg.key_id)
        dlog.log.info(f"dstool keys: key {cfg.key_id} of tenant {tenant} revoked")
    elif cfg.action == "limits":
        keys.set_limits(client, cfg.tenant, cfg.rpm, cfg.tpm, cfg.budget_tokens, cfg.per or "", cfg.concurrency)
        dlog.log.info(f"dstool keys: tenant {cfg.tenant}: rpm {cfg.rpm or '-'}, tpm {cfg.tpm or '-'}, budget "
                      f"{f'{cfg.budget_tokens} tokens a {cfg.per}' if cfg.budget_tokens else '-'}, concurrency "
                      f"{cfg.concurrency or 'the gateway default'}")
    else:
        rows = keys.as_dicts(keys.list_keys(client, cfg.tenant)) if cfg.action == "list" else \
            keys.usage(client, cfg.tenant)
        print(json.dumps(rows, indent=2) if cfg.format == "json" else keys.table(rows))
    return 0


def _infer(cfg) -> int:
    if cfg.edge is not None:
        return _infer_edge(cfg)
    from dstool.serve.runtime import client  # noqa: PLC0415 (a stage, loaded for its command only)

    structured = cfg.structured()
    if cfg.prompt is not None and (cfg.stream or cfg.openai or structured):  # a grammar is MODEL_llm's to enforce
        if cfg.openai:
            pieces = client.openai_text(cfg.address, cfg.model, cfg.prompt, cfg.max_new_tokens, {
                **cfg.sampling(), **({"structured_outputs": structured} if structured else {})}, cfg.stream,
                cfg.credentials())
        else:
            pieces = client.stream_text(cfg.address, cfg.protocol, cfg.model, cfg.prompt, cfg.max_new_tokens, {
                **cfg.sampling(), **({"structured_outputs": json.dumps(structured)} if structured else {})},
                cfg.credentials())
        if structured and not cfg.stream:  # the answer alone, whole: a program reads it as JSON
            print("".join(pieces))
            return 0
        print(cfg.prompt, end="", flush=True)
        for piece in pieces:
            print(piece, end="", flush=True)
        print()
        return 0
    if cfg.prompt is not None:
        text, _ = client.generate_text(cfg.address, cfg.protocol, cfg.model, cfg.prompt, cfg.max_new_tokens,
                                       cfg.kv_cache, cfg.sampling(), cfg.credentials())
        print(cfg.prompt + text)
        return 0
    logits = client.infer_ids(cfg.address, cfg.protocol, cfg.model, cfg.token_ids(), cfg.credentials())
    print(f"logits {list(logits.shape)}; greedy next token per position: {logits.argmax(-1).tolist()}")
    return 0


def _infer_edge(cfg) -> int:
    from dstool.decoding.grammar import Grammars  # noqa: PLC0415 (a stage, loaded for its command only)
    from dstool.decoding.sampling import SamplingError, request_choices  # noqa: PLC0415 (a stage, loaded for its command only)
    from dstool.serve import edge  # noqa: PLC0415 (a stage, loaded for its command only)

    model = edge.EdgeModel(cfg.edge, cfg.memory_cap_mb)
    prompt_ids = model.tokenizer.encode(cfg.prompt).ids
    structured = cfg.structured()
    params = {**cfg.sampling(), **({"structured_outputs": json.dumps(structured)} if structured else {})}
    eos = set(model.manifest.eos_token_ids)
    try:
        new_tokens, sampler, stops = request_choices(json.dumps(params), len(prompt_ids), cfg.max_new_tokens, 32,
                                                     model.manifest.max_positions, None, eos,
                                                     Grammars(model.tokenizer, eos))
    except SamplingError as e:
        raise UsageError(str(e)) from None
    result = model.generate(cfg.prompt, new_tokens, sampler.next, stops)
    print(result.text if structured else cfg.prompt + result.text)
    dlog.log.info(f"dstool infer: {edge.stats_line(result.stats)}")
    return 0


def _batch(cfg) -> int:
    from dstool.serve.batch import run_batch  # noqa: PLC0415 (a stage, loaded for its command only)

    m = run_batch(cfg)
    f = m.figures
    assert f is not None
    made = f"{f.generated_tokens} tokens generated, {f.generated_tokens_per_s:g} tokens/s, " if m.task == "generate" \
        else f"{f.prompt_tokens} tokens scored, "
    failed = f"; {f.failed} rows failed: {Path(cfg.output) / m.failures}" if m.failures else ""
    again = f" ({f.partitions_skipped} partitions done by an earlier run)" if f.partitions_skipped else ""
    if f.partitions_skipped == m.planned_partitions:
        dlog.log.info(f"dstool batch: nothing left to do: all {f.rows} rows were done by an earlier run of this job; "
                      f"output: {Path(cfg.output) / 'rows'}")
        return 0
    dlog.log.info(f"dstool batch: {f.rows} rows in {f.seconds:.1f} s{again}, {f.rows_per_s:g} rows/s, {made}model "
                  f"{m.deployment.name} version {m.deployment.version}{failed}; output: {Path(cfg.output) / 'rows'}")
    return 0


def _eval(cfg) -> int:
    from dstool.evaluation.api import run_eval, table  # noqa: PLC0415 (a stage, loaded for its command only)

    report = run_eval(cfg)
    print(table(report))
    dlog.log.info(f"dstool eval: {report.path} path, lm-evaluation-harness {report.lm_eval}, {report.seconds:.0f} s; "
                  f"results: {Path(cfg.output) / 'results.json'}")
    return 0


def _pipeline(cfg) -> int:
    run_pipeline(cfg)
    return 0


def _train_config():
    return TrainCommand


def _doctor_config():
    return DoctorConfig


def _plan_config():
    return PlanConfig


def _compress_config():
    return CompressConfig


def _serve_config(config: type[BaseModel]) -> Callable[[], type[BaseModel]]:
    return lambda: config


def _eval_config():
    return EvalConfig


def _pipeline_config():
    return PipelineConfig


COMMANDS: dict[str, Command] = {
    "train": Command(_train_config, _train, "DeepSpeed training (ZeRO 0-3, offload, bf16/fp16, one process to many "
                     "nodes)", "Train a Hugging Face causal LM with DeepSpeed. Flags override --config; the options "
                     "that differ from the defaults are printed, the whole config is saved under --output."),
    "doctor": Command(_doctor_config, _doctor, "preflight checks before a launch: versions, ssh, port, interfaces, "
                      "GPUs, parallel layout and GPU interconnect, output folder, all-reduce", "One line per check: "
                      "pass, warn, FAIL with the fix, or skip with the reason (a check it could not make). Exit code 0 "
                      "when none fails, 1 when one fails, 2 for bad usage."),
    "plan": Command(_plan_config, _plan, "capacity and cost plan of a training run: memory per device for each ZeRO "
                    "stage, step time, total time, GPU-hours and cost for several cluster sizes", "Plan a training "
                    "run before renting it: memory per device for each ZeRO stage under a pipeline x tensor x "
                    "data-parallel and expert-parallel layout (DeepSpeed's estimators plus an activation estimate), "
                    "communication per step, tokens/s, step time, total time, GPU-hours and cost from an achievable "
                    "MFU (published figures, or --from-run a dstool train run) and an assumed scaling efficiency, one "
                    "row per cluster size. Exits 2 when the model fits no device planned, naming what would fit."),
    "compress": Command(_compress_config, _compress, "int8/4-bit quantization, structured pruning, N:M sparsity, "
                        "measured report", "Compress a Hugging Face causal LM; writes model/, both ONNX graphs (logits "
                        "and key/value-cache decoder) in onnx/, a manifest (dstool.json) and a measured report "
                        "(report.md, report.png) under --output."),
    "eval": Command(_eval_config, _eval, "score a model with lm-evaluation-harness on tasks from real data: "
                    "perplexity, cloze, multiple choice, chat", "Score a Hugging Face folder (lm-eval's hf model), a "
                    "compress output's ONNX logits graph (lm-eval's onnxruntime model) or, with --url, a served model "
                    "(local-completions on /v1/completions) on rolling perplexity of a State of the Union address, a "
                    "LAMBADA-style cloze and two multiple-choice tasks from real conversations (plain and in the "
                    "model's chat template). lm-eval runs in its own virtual environment (scripts/lm-eval-venv.sh); "
                    "the data is fetched once from the package registries and cached. Prints a table, writes "
                    "results.json under --output."),
    "export": Command(_serve_config(ExportConfig), _export, "Triton model repository (or, --target edge, an "
                      "ORT-format edge package) from a Hugging Face folder or a compress output", "Write a Triton "
                      "model repository: NAME (token ids -> logits), NAME_decoder "
                      "(key/value cache), NAME_tokenizer, NAME_detokenizer and the text-generation entry point "
                      "NAME_generate. A compress output's graphs are deployed as its manifest names them; a Hugging "
                      "Face folder is exported to ONNX here (parity-checked against PyTorch). Every config.pbtxt is "
                      "built as Triton's ModelConfig protobuf and checked against the ONNX graphs. With --target edge: "
                      "the decoder graph cut into an ORT-format embedding and head (resident) and blocks of "
                      "--layers-per-block decoder layers (loaded on demand by `dstool infer --edge`), with the "
                      "operator config of a minimal ONNX Runtime build; checked against the unsplit graph."),
    "serve": Command(_serve_config(ServeConfig), _serve, "start a real Triton server on a model repository",
                     "Find a tritonserver (--tritonserver, $DSTOOL_TRITONSERVER, PATH, or the nvidia-pytriton wheel), "
                     "start it on 127.0.0.1, wait until ready, stop on Ctrl-C. Exits 1 if Triton dies."),
    "gateway": Command(_serve_config(GatewayConfig), _gateway, "KServe v2 HTTP/gRPC gateway with a Redis result "
                       "cache in front of Triton", "Serve the KServe v2 protocol (HTTP JSON/binary and gRPC) on its "
                       "own ports, answering repeated inference requests from a Redis cache and sending the rest to "
                       "the --upstream Triton servers."),
    "batch": Command(_serve_config(BatchConfig), _batch, "offline generation or scoring of a data set on Apache "
                     "Spark (ONNX Runtime in the executors, or a running Triton/gateway)", "Read INPUT (jsonl, "
                     "parquet or csv; default: 1,000 held-out prompts of the embedded corpus) with Spark, run every "
                     "row through the repository's model and write OUTPUT/rows/ (the input columns, the generated "
                     "text or scores, token counts, latency, the model version), one file per partition, written "
                     "atomically; a re-run of the same job resumes where it stopped."),
    "pipeline": Command(_pipeline_config, _pipeline, "the whole job on the embedded default: train -> compress -> "
                        "export -> serve (Triton + cache gateway) -> infer", "Train the tiny model, compress it (int8 "
                        "and a pruned variant), export the int8 model to a Triton repository, serve it behind the "
                        "cache gateway, send prompts over HTTP and gRPC, print the answers, the compression table and "
                        "the cache hit rate, and shut down."),
    "keys": Command(_serve_config(KeysConfig), _keys, "tenants' API keys for `dstool serve --auth keys`: create, "
                    "list, revoke, rotate, usage, limits", "Keys are kept in the gateways' Redis as SHA-256 hashes; "
                    "create and rotate print the key once. Each key has a tenant, the models it may use, requests "
                    "and tokens per minute, a token budget per day or month, an expiry and a cache scope; `limits` "
                    "sets a tenant's own limits over all its keys; `usage` prints requests, tokens, cache hits, "
                    "errors and 429s per tenant and key."),
    "infer": Command(_serve_config(InferConfig), _infer, "generate text (or send token ids) through a served model "
                     "with tritonclient, or here from an edge package", "Send PROMPT to the text-generation entry "
                     "point (MODEL_generate) and print the generated text; or send token ids (--ids) to the tensor "
                     "model MODEL and print the greedy next token for each position. With --edge PACKAGE: generate "
                     "here with onnxruntime from the package, its blocks loaded as --memory-cap-mb allows, and print "
                     "the peak memory and tokens/s."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dstool",
                     description="DeepSpeed training -> compression -> Triton serving with a Redis cache.")
    parser.add_argument("--version", action="version", version=f"dstool {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="also show other libraries' logs, warnings and "
                        "progress bars, and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description, parents=[common])
        add_options(p, command.config())
    return parser


def main(argv: list[str] | None = None) -> int:
    command, verbose = "dstool", False
    trace = logging.getLogger("traceback")  # not dstool's: to the log file, and to the console only with -v
    try:
        ns = build_parser().parse_args(argv)
        command, verbose = ns.command, ns.verbose
        dlog.setup(verbose)
        spec = COMMANDS[command]
        cfg = load_config(spec.config(), ns.config, overrides(ns, spec.config()))
        dlog.log.debug(f"dstool {command}: options that differ from the defaults: {changed(cfg)}")
        return spec.run(cfg) or 0
    except UsageError as e:
        print(f"dstool: error: {e}", file=sys.stderr)
        return 2
    except Failed as e:
        trace.debug(f"{command} failed", exc_info=True)
        print(f"dstool: {command}: {e}{_log_hint(e.log)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("dstool: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a defect: one line here, the traceback in the log file (and on the console with -v)
        trace.error(f"{command} failed", exc_info=True)
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"dstool: {command} failed: {type(e).__name__}: {first}{_log_hint(None)}"
              + ("" if verbose else " (-v shows the traceback)"), file=sys.stderr)
        return 1
    finally:
        dlog.shutdown()


def run() -> NoReturn:
    """The `dstool` command: `main`, then what the interpreter does at exit (non-daemon threads joined, exit handlers
    run, output flushed), then the process ends without the interpreter's teardown of its modules, which takes
    1.2 s after a command that loaded torch and transformers (docs/setup.md)."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader that went away: nothing left to say
            stream.flush()
    os._exit(code)


def _log_hint(log: Path | None) -> str:
    where = log or dlog.log_file()
    return f" (log: {where})" if where else ""


if __name__ == "__main__":
    run()
