"""`dstool` command line: a thin layer over the Python API (dstool.train.train, ...)."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Literal, Union

from pydantic import BaseModel

from dstool import __version__
from dstool.compress.config import CompressConfig
from dstool.config import TrainConfig, load_config
from dstool.errors import TrainingFailed, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage block too)
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _base_type(annotation):
    """`int | None` -> int; other annotations unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _add_model_options(parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str] = frozenset()) -> None:
    """One flag per config field (dashes for underscores); validation stays in the typed config."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        base = _base_type(field.annotation)
        required = field.is_required()
        default = None if required else field.default if field.default_factory is None else field.default_factory()
        help_ = (field.description or "").replace("%", "%%") + (" (required)" if required else f" [default: {default}]")
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(base) is Literal:
            choices = typing.get_args(base)
            parser.add_argument(flag, type=type(choices[0]), default=None, metavar="{" + ",".join(map(str, choices)) + "}",
                                help=help_)
        elif typing.get_origin(base) is dict:
            parser.add_argument(flag, action="append", default=None, metavar="KEY=VALUE", help=help_)
        else:
            parser.add_argument(flag, type=base, default=None, metavar=name.upper(), help=help_, required=required)


def _overrides(ns: argparse.Namespace, model: type[BaseModel]) -> dict:
    values = {k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None}
    for name, field in model.model_fields.items():
        if name in values and typing.get_origin(_base_type(field.annotation)) is dict:
            pairs = {}
            for item in values[name]:
                if "=" not in item:
                    raise UsageError(f"--{name.replace('_', '-')} takes KEY=VALUE, got '{item}'")
                k, v = item.split("=", 1)
                pairs[k] = v
            values[name] = pairs
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dstool", description="DeepSpeed training -> compression -> Triton serving with a Redis cache.")
    parser.add_argument("--version", action="version", version=f"dstool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="DeepSpeed training (ZeRO 0-3, offload, bf16/fp16, one process to many nodes)",
                           description="Train a Hugging Face causal LM with DeepSpeed. Flags override --config; "
                                       "the effective config is printed and saved under --output.")
    train.add_argument("--config", help="YAML file of options (keys as below, with underscores)")
    _add_model_options(train, TrainConfig)
    train.add_argument("--emit", choices=["k8s"], help="print a Kubeflow PyTorchJob manifest (YAML) for this run "
                       "instead of running it")
    train.add_argument("--image", default="dstool:latest", help="container image for --emit k8s [default: dstool:latest]")
    train.add_argument("--pvc", default="dstool-checkpoints", help="PersistentVolumeClaim shared by the pods, mounted "
                       "at /checkpoints (--emit k8s) [default: dstool-checkpoints]")
    train.set_defaults(func=_cmd_train)

    doc = sub.add_parser("doctor", help="preflight checks before a launch: versions, ssh, port, interfaces, GPUs, "
                         "output folder, all-reduce",
                         description="One line per check with pass/FAIL and the fix. Exit code 0 when all pass, 1 "
                                     "when one fails, 2 for bad usage.")
    doc.add_argument("--hostfile", help="DeepSpeed hostfile to check every node of (default: this machine)")
    doc.add_argument("--master-addr", default="127.0.0.1")
    doc.add_argument("--master-port", type=int, default=29500, help="[default: 29500]")
    doc.add_argument("--output", default="runs/train", help="the run folder to check [default: runs/train]")
    doc.add_argument("--nproc", type=int, default=2, help="local processes for the all-reduce test [default: 2]")
    doc.add_argument("--env", action="append", metavar="KEY=VALUE", help="as for train, e.g. NCCL_SOCKET_IFNAME=eth0")
    doc.set_defaults(func=_cmd_doctor)

    comp = sub.add_parser("compress", help="int8/4-bit quantization, structured pruning, N:M sparsity, measured report",
                          description="Compress a Hugging Face causal LM; writes model/, onnx/ and a measured "
                                      "report (report.json, report.md, report.png) under --output.")
    comp.add_argument("model", metavar="MODEL_DIR", help="Hugging Face causal-LM folder (e.g. RUN/model)")
    _add_model_options(comp, CompressConfig, skip={"model"})
    comp.set_defaults(func=_cmd_compress)

    exp = sub.add_parser("export", help="Triton model repository from a Hugging Face folder or a compress output",
                         description="Export to ONNX (a logits model and a key/value-cache decoder, both parity-checked "
                                     "against PyTorch) and write a Triton model repository: NAME (token ids -> logits), "
                                     "NAME_decoder, NAME_tokenizer, NAME_detokenizer and the text-generation entry point "
                                     "NAME_generate. Every config.pbtxt is validated with Triton's protobuf schema and "
                                     "the ONNX graphs.")
    exp.add_argument("model", metavar="MODEL_DIR", help="Hugging Face causal-LM folder or a dstool compress output")
    exp.add_argument("--repository", default="model_repository", help="repository folder [default: model_repository]")
    exp.add_argument("--name", default="dstool_lm", help="model name in the repository [default: dstool_lm]")
    exp.add_argument("--version", type=int, help="version folder (default: the next one)")
    exp.add_argument("--max-batch-size", type=int, default=8, help="[default: 8]; 0 = no batching")
    exp.add_argument("--instances", type=int, default=1, help="model instances (instance_group count) [default: 1]")
    exp.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="gpu: KIND_GPU for the onnxruntime_onnx models (python-backend models run on "
                                                          "the CPU) [default: cpu]")
    exp.add_argument("--backend", choices=["python", "onnxruntime"], default="python",
                     help="python: python backend running onnxruntime (any Triton); onnxruntime: platform "
                          "onnxruntime_onnx (Triton with the ONNX Runtime backend) [default: python]")
    exp.add_argument("--dynamic-batching", action=argparse.BooleanOptionalAction, default=True,
                     help="dynamic_batching block [default: on]")
    exp.add_argument("--response-cache", action="store_true", help="enable Triton's response cache for NAME and NAME_generate")
    exp.set_defaults(func=_cmd_export)

    srv = sub.add_parser("serve", help="start a real Triton server on a model repository",
                         description="Find a tritonserver (--tritonserver, $DSTOOL_TRITONSERVER, PATH, or the "
                                     "nvidia-pytriton wheel), start it on 127.0.0.1, wait until ready, stop on Ctrl-C.")
    srv.add_argument("--repository", default="model_repository", help="[default: model_repository]")
    srv.add_argument("--http-port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=8001)
    srv.add_argument("--metrics-port", type=int, default=8002)
    srv.add_argument("--tritonserver", help="path of the tritonserver binary")
    srv.add_argument("--log-file", default="tritonserver.log", help="[default: tritonserver.log]")
    srv.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness [default: 120]")
    srv.add_argument("--cache-config", metavar="SPEC", help="Triton's own response cache, passed to tritonserver "
                     "--cache-config, e.g. local,size=268435456 (for models exported with --response-cache)")
    srv.add_argument("--cache", nargs="?", const="auto", default=None, metavar="URL",
                     help="put the caching gateway on --http-port/--grpc-port and Triton on internal ports: "
                          "redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., unix://PATH, memory, or no value: "
                          "local Redis if it answers, else an in-process LRU")
    _add_gateway_options(srv)
    srv.set_defaults(func=_cmd_serve)

    gw = sub.add_parser("gateway", help="KServe v2 HTTP/gRPC gateway with a Redis result cache in front of Triton",
                        description="Serve the KServe v2 protocol (HTTP JSON/binary and gRPC) on its own ports, "
                                    "answering repeated inference requests from a Redis cache and sending the rest "
                                    "to the --upstream Triton servers.")
    gw.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT",
                    help="a Triton HTTP endpoint (repeat for several servers, used in turn)")
    gw.add_argument("--upstream-grpc", action="append", default=[], metavar="HOST:PORT",
                    help="the matching Triton gRPC endpoint [default: the HTTP port + 1]")
    gw.add_argument("--cache", default=None, metavar="URL",
                    help="redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., unix://PATH or memory [default: "
                         "$DSTOOL_REDIS_URL or redis://127.0.0.1:6379/0 if it answers, else an in-process LRU]")
    gw.add_argument("--http-port", type=int, default=8000)
    gw.add_argument("--grpc-port", type=int, default=8001)
    gw.add_argument("--repository", default=None, help="the upstream's model repository, if readable here: "
                                                       "version fingerprints then include its files")
    _add_gateway_options(gw)
    gw.set_defaults(func=_cmd_gateway)

    pipe = sub.add_parser("pipeline", help="the whole job on the embedded default: train -> compress -> export -> "
                                           "serve (Triton + cache gateway) -> infer",
                          description="Train the tiny model, compress it (int8 and a pruned variant), export the int8 "
                                      "model to a Triton repository, serve it behind the cache gateway, send prompts "
                                      "over HTTP and gRPC, print the answers, the compression table and the cache hit "
                                      "rate, and shut down.")
    pipe.add_argument("--output", default="runs/pipeline", help="[default: runs/pipeline]")
    pipe.add_argument("--repository", default="model_repository", help="[default: model_repository]")
    pipe.add_argument("--nproc", type=int, default=2, help="training ranks [default: 2]")
    pipe.add_argument("--train-steps", type=int, default=300, help="[default: 300]")
    pipe.add_argument("--prune", type=float, default=0.3, help="pruned variant's ratio [default: 0.3]")
    pipe.add_argument("--recover-steps", type=int, default=30, help="[default: 30]")
    pipe.add_argument("--recover-lr", type=float, default=2e-4, help="recovery peak learning rate [default: 2e-4]")
    pipe.add_argument("--cache", default=None, metavar="URL",
                      help="gateway cache [default: local Redis if it answers, else an in-process LRU]")
    pipe.add_argument("--http-port", type=int, default=8000)
    pipe.add_argument("--grpc-port", type=int, default=8001)
    pipe.add_argument("--metrics-port", type=int, default=8002)
    pipe.add_argument("--max-new-tokens", type=int, default=24, help="[default: 24]")
    pipe.add_argument("--prompt", action="append", default=None, help="a prompt (repeat; default: three built in)")
    pipe.add_argument("--latency-repeats", type=int, default=20, help="timed runs per latency figure in the "
                                                                     "compression reports [default: 20]")
    pipe.set_defaults(func=_cmd_pipeline)

    inf = sub.add_parser("infer", help="generate text (or send token ids) through a served model with tritonclient",
                         description="Send PROMPT to the text-generation entry point (MODEL_generate) and print the "
                                     "generated text; or send token ids (--ids) to the tensor model MODEL and print "
                                     "the greedy next token for each position.")
    inf.add_argument("prompt", nargs="?", help="text to continue")
    inf.add_argument("--ids", help="comma-separated token ids for the tensor model (instead of PROMPT)")
    inf.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate [default: the model's, 32]")
    inf.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="decode with the key/value cache [default: on]")
    inf.add_argument("--url", default=None, help="HOST:PORT [default: 127.0.0.1:8000 http, :8001 grpc]")
    inf.add_argument("--protocol", choices=["http", "grpc"], default="http")
    inf.add_argument("--model", default="dstool_lm")
    inf.set_defaults(func=_cmd_infer)
    return parser


def _cmd_pipeline(ns: argparse.Namespace) -> int:
    from dstool.pipeline import PipelineConfig, PipelineFailed, run_pipeline

    for name in ("nproc", "train_steps", "max_new_tokens", "latency_repeats"):
        if getattr(ns, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    cfg = PipelineConfig(output=ns.output, repository=ns.repository, nproc=ns.nproc, train_steps=ns.train_steps,
                         prune=ns.prune, recover_steps=ns.recover_steps, recover_lr=ns.recover_lr, cache=ns.cache,
                         http_port=ns.http_port, grpc_port=ns.grpc_port, metrics_port=ns.metrics_port,
                         max_new_tokens=ns.max_new_tokens, latency_repeats=ns.latency_repeats)
    if ns.prompt:
        cfg.prompts = ns.prompt
    try:
        run_pipeline(cfg)
    except PipelineFailed as e:
        print(f"dstool pipeline: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    from dstool.serve.api import export
    from dstool.serve.repository import ModelSettings

    export(ns.model, ns.repository, ModelSettings(
        name=ns.name, version=ns.version, max_batch_size=ns.max_batch_size, instances=ns.instances, device=ns.device,
        backend=ns.backend, dynamic_batching=ns.dynamic_batching, response_cache=ns.response_cache))
    return 0


def _add_gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway binds [default: 127.0.0.1]")
    parser.add_argument("--cache-ttl", type=float, default=3600.0, help="seconds an entry lives [default: 3600]")
    parser.add_argument("--max-entry-bytes", type=int, default=16 << 20, help="larger results are not cached "
                                                                              "[default: 16 MiB]")
    parser.add_argument("--memory-cache-bytes", type=int, default=256 << 20,
                        help="in-process LRU in front of Redis [default: 256 MiB]")
    parser.add_argument("--redis-timeout", type=float, default=0.1,
                        help="seconds before a Redis call counts as failed and Triton answers [default: 0.1]")
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20, help="[default: 64 MiB]")
    parser.add_argument("--token-file", default=None,
                        help="file holding a bearer token every request must carry ($DSTOOL_GATEWAY_TOKEN also works)")
    parser.add_argument("--version-check-interval", type=float, default=1.0,
                        help="seconds between checks of which model version Triton serves [default: 1]")


def _gateway_config(ns: argparse.Namespace, upstreams: list[str], upstreams_grpc: list[str], cache: str | None):
    import os

    from dstool.serve.gateway import GatewayConfig

    token = os.environ.get("DSTOOL_GATEWAY_TOKEN") or None
    if ns.token_file:
        try:
            token = Path(ns.token_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--token-file {ns.token_file}: {e.strerror}") from None
        if not token:
            raise UsageError(f"--token-file {ns.token_file} is empty")
    return GatewayConfig(upstreams=upstreams, upstreams_grpc=upstreams_grpc, cache=cache, host=ns.host,
                         http_port=ns.http_port, grpc_port=ns.grpc_port, ttl=ns.cache_ttl,
                         max_entry_bytes=ns.max_entry_bytes, memory_cache_bytes=ns.memory_cache_bytes,
                         redis_timeout=ns.redis_timeout, max_request_bytes=ns.max_request_bytes, token=token,
                         version_check_interval=ns.version_check_interval)


def _cmd_gateway(ns: argparse.Namespace) -> int:
    import dataclasses

    from dstool.serve.gateway import run_gateway

    config = _gateway_config(ns, ns.upstream, ns.upstream_grpc, ns.cache)
    return run_gateway(dataclasses.replace(config, repository=ns.repository))


def _cmd_serve(ns: argparse.Namespace) -> int:
    from dstool.serve.api import serve

    if ns.cache is not None:
        from dstool.serve.gateway.launch import serve_cached

        return serve_cached(ns.repository, ns.metrics_port, ns.tritonserver, ns.log_file, ns.timeout,
                            _gateway_config(ns, [], [], None if ns.cache == "auto" else ns.cache), ns.cache_config)
    return serve(ns.repository, ns.http_port, ns.grpc_port, ns.metrics_port, ns.tritonserver, ns.log_file, ns.timeout,
                 cache_config=ns.cache_config)


def _cmd_infer(ns: argparse.Namespace) -> int:
    from dstool.serve.api import generate_text, infer_ids

    if (ns.prompt is None) == (ns.ids is None):
        raise UsageError("give a PROMPT to generate from, or --ids for the tensor model (one of the two)")
    url = ns.url or ("127.0.0.1:8001" if ns.protocol == "grpc" else "127.0.0.1:8000")
    if ns.prompt is not None:
        if ns.max_new_tokens is not None and ns.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        text, ids = generate_text(url, ns.protocol, ns.model, ns.prompt, ns.max_new_tokens, ns.kv_cache)
        print(ns.prompt + text)
        return 0
    try:
        ids = [int(x) for x in ns.ids.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ids takes comma-separated integers, got '{ns.ids}'") from None
    logits = infer_ids(url, ns.protocol, ns.model, ids)
    print(f"logits {list(logits.shape)}; greedy next token per position: {logits.argmax(-1).tolist()}")
    return 0


def _cmd_compress(ns: argparse.Namespace) -> int:
    from dstool.compress import compress

    cfg = load_config(CompressConfig, None, _overrides(ns, CompressConfig))
    rep = compress(cfg)
    b, a = rep["before"], rep["after"]
    print(f"dstool compress: {rep['artefact']}: size {rep['compression_ratio']:.3f}x, perplexity "
          f"{b['perplexity']:.3f} -> {a['perplexity']:.3f} ({rep['perplexity_change_pct']:+.2f} %), speed-up "
          f"{rep['speedup']['1']:.2f}x (batch 1), {rep['speedup']['8']:.2f}x (batch 8); report: "
          f"{Path(cfg.output) / 'report.md'}")
    return 0


def _emit_k8s(cfg: TrainConfig, image: str, pvc: str) -> int:
    import yaml

    from dstool.train import deepspeed_config, k8s, launch

    topo = launch.plan(cfg.model_copy(update={"hostfile": None, "node_rank": 0 if cfg.num_nodes > 1 else None}))
    if cfg.hostfile:
        hosts = launch.parse_hostfile(cfg.hostfile)
        topo.nodes, topo.procs_per_node = len(hosts), next(iter(hosts.values()))
    deepspeed_config.batch_plan(cfg, topo.nodes * topo.procs_per_node)  # the batch must divide on that world
    print(yaml.safe_dump(k8s.pytorchjob(cfg, topo.nodes, topo.procs_per_node, image, pvc), sort_keys=False), end="")
    return 0


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from dstool.train import doctor

    return doctor.run(ns.hostfile, ns.master_addr, ns.master_port, ns.output, ns.nproc, doctor.parse_env(ns.env))


def _cmd_train(ns: argparse.Namespace) -> int:
    cfg = load_config(TrainConfig, ns.config, _overrides(ns, TrainConfig))  # before torch loads: errors come fast
    if ns.emit == "k8s":
        return _emit_k8s(cfg, ns.image, ns.pvc)
    from dstool.train import train

    result = train(cfg)
    val = f", held-out loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    print(f"dstool train: done at step {result.step}, train loss {result.train_loss:.4f}{val}; model: {result.model_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        return ns.func(ns)
    except UsageError as e:
        print(f"dstool: error: {e}", file=sys.stderr)
        return 2
    except TrainingFailed as e:
        print(f"dstool: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("dstool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
