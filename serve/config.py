"""The options of `dstool export`, `serve`, `gateway` and `infer` (importing this loads no torch, no grpc)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool import __version__
from dstool.config import CommandConfig, cli_extra, positional
from dstool.serve.cache_url import AUTO, CacheURL

STREAM_INTERVAL = 1  # tokens per streamed response: docs/export-serve.md has the measurement
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
QUANTITY_RE = re.compile(r"^\d+(\.\d+)?([mkMGTPE]|[KMGTPE]i)?$")
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a Redis name part and a metrics label


def model_names(name: str) -> dict[str, str]:
    """The repository's models: NAME (token ids -> logits) and the text-generation models around it."""
    return {"logits": name, "decoder": f"{name}_decoder", "tokenizer": f"{name}_tokenizer",
            "detokenizer": f"{name}_detokenizer", "generate": f"{name}_generate", "llm": f"{name}_llm"}


class RepositorySettings(CommandConfig):
    """How a model family is laid out in a Triton repository (the export options but the paths)."""

    name: str = Field("dstool_lm", description="model name in the repository")
    version: int | None = Field(None, ge=1, description="version folder (default: the next one)")
    max_batch_size: int = Field(8, ge=0, description="0 = no batching")
    instances: int = Field(1, ge=1, description="model instances (instance_group count)")
    device: Literal["cpu", "gpu"] = Field("cpu", description="gpu: KIND_GPU for the onnxruntime_onnx models "
                                          "(python-backend models run on the CPU)")
    backend: Literal["python", "onnxruntime"] = Field(
        "python", description="python: python backend running onnxruntime (any Triton); onnxruntime: platform "
        "onnxruntime_onnx (Triton with the ONNX Runtime backend)")
    dynamic_batching: bool = Field(True, description="dynamic_batching block")
    queue_delay_us: int = Field(2000, ge=0, description="dynamic batching: longest wait for more requests (µs)")
    response_cache: bool = Field(False, description="enable Triton's response cache for NAME and NAME_generate")
    prefix_cache: bool = Field(True, description="NAME_llm keeps computed prompt prefixes and reuses them (blocks of "
                               "16 tokens, least recently used out, within the engine's cache budget)")
    fused_attention: bool = Field(True, description="NAME_llm runs a decoder with fused attention over a cache "
                                  "updated in place (Llama-layout models; others keep the exported decoder)")
    stream_interval: int = Field(STREAM_INTERVAL, ge=1, le=64, description="NAME_llm streams a request's tokens in "
                                 "responses of this many (the first token and the last response always at once), "
                                 "as vLLM's --stream-interval")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v) or v in (".", ".."):
            raise ValueError(f"'{v}' is not a name Triton accepts: use letters, digits, '_', '-' and '.'")
        return v

    @model_validator(mode="after")
    def _batching(self) -> RepositorySettings:
        if self.max_batch_size == 0 and self.dynamic_batching:
            raise ValueError("--max-batch-size 0 disables batching, so dynamic batching cannot be on: give a max "
                             "batch size >= 1 or --no-dynamic-batching")
        return self


class ExportConfig(RepositorySettings):
    """`dstool export`: a Triton model repository, or an edge package, from a Hugging Face folder or a `dstool
    compress` output."""

    model: str = positional("Hugging Face causal-LM folder, a dstool compress output, a .gguf file or smollm2",
                            metavar="MODEL_DIR")
    target: Literal["triton", "edge"] = Field("triton", description="triton: a Triton model repository "
                                              "(--repository); edge: an ONNX Runtime-format package for a device "
                                              "(--output): embedding and head resident, the decoder layers in "
                                              "blocks loaded on demand")
    repository: str = Field("model_repository", description="repository folder")
    output: str = Field("edge_package", description="--target edge: the package folder")
    layers_per_block: int = Field(1, ge=1, description="--target edge: decoder layers per block file")

    @model_validator(mode="after")
    def _target(self) -> ExportConfig:
        given = self.model_fields_set
        wrong = given & {"output", "layers_per_block"} if self.target == "triton" else \
            given & (set(RepositorySettings.model_fields) | {"repository"})
        if wrong:
            other = "edge" if self.target == "triton" else "triton"
            raise ValueError(f"--{sorted(wrong)[0].replace('_', '-')} applies to --target {other} only")
        return self

    def settings(self) -> RepositorySettings:
        return RepositorySettings(**{k: getattr(self, k) for k in RepositorySettings.model_fields})


def _host_port(address: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"'{address}' is not HOST:PORT")
    return address


class GatewayOptions(CommandConfig):
    """How the cache gateway behaves (shared by `dstool gateway` and `dstool serve --cache`)."""

    host: str = Field("127.0.0.1", description="address the gateway binds")
    cache_ttl: float = Field(3600.0, gt=0, description="seconds an entry lives")
    max_entry_bytes: int = Field(16 << 20, ge=1, description="larger results are not cached")
    memory_cache_bytes: int = Field(256 << 20, ge=1, description="in-process LRU in front of Redis")
    redis_timeout: float = Field(0.1, gt=0, description="seconds before a Redis call counts as failed and Triton "
                                 "answers")
    max_request_bytes: int = Field(64 << 20, ge=1, description="largest request body accepted (413 beyond)")
    max_generate_bytes: int = Field(4 << 20, ge=1, description="largest body of a text-generation request "
                                    "(/v1/..., generate, generate_stream; 413 beyond): a prompt is text, not tensors")
    write_timeout: float = Field(30.0, gt=0, description="seconds a streamed answer may wait for a client that "
                                 "reads nothing (its buffer full) before the stream is ended and its work cancelled")
    max_url_bytes: int = Field(8192, ge=64, description="longest request target, path and query (414 beyond)")
    max_header_bytes: int = Field(8192, ge=64, description="longest single header line (431 beyond)")
    max_headers_bytes: int = Field(65536, ge=256, description="request line and headers together (431 beyond)")
    max_headers: int = Field(100, ge=4, description="headers per request (431 beyond)")
    header_timeout: float = Field(15.0, gt=0, description="seconds a client may take to send a request's headers "
                                  "(408, connection closed)")
    body_timeout: float = Field(30.0, gt=0, description="seconds a client may pause while sending a body (408)")
    keepalive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    max_connections: int = Field(1024, ge=1, description="HTTP connections at once (503 beyond)")
    max_buffered_bytes: int = Field(256 << 20, ge=1, description="request bodies held at once, all HTTP "
                                    "connections together (503 beyond)")
    upstream_timeout: float = Field(60.0, gt=0, description="seconds an inference may take on Triton (504 beyond; "
                                    "a gRPC client's own deadline applies when it is shorter)")
    health_timeout: float = Field(2.0, gt=0, description="seconds Triton has to answer a health or readiness check "
                                  "(not ready beyond)")
    shutdown_grace: float = Field(30.0, ge=0, description="on SIGTERM: seconds in-flight requests have to finish")
    workers: int = Field(1, ge=1, le=64, description="gateway processes sharing the ports (SO_REUSEPORT), each with "
                         "its own event loop and in-process LRU; Redis and /metrics are shared")
    token_file: str | None = Field(None, description="file holding a bearer token every request must carry "
                                   "($DSTOOL_GATEWAY_TOKEN also works)")
    token: str | None = Field(None, description="the bearer token (from --token-file or $DSTOOL_GATEWAY_TOKEN; not "
                              "a flag, so it never shows in a process list)", json_schema_extra={"cli": False,
                                                                                  "secret": True})
    version_check_interval: float = Field(1.0, gt=0, description="seconds between checks of which model version "
                                          "Triton serves")
    auth: Literal["token", "keys"] = Field("token", description="token: the one bearer token of --token-file, if "
                                           "any; keys: tenants' API keys from `dstool keys`, checked in Redis, with "
                                           "their models, limits and usage (--token-file then is the admin key)")
    auth_fallback: Literal["cached", "refuse"] = Field("cached", description="--auth keys with Redis unreachable: "
                                                       "admit keys validated in the last --auth-stale seconds, or "
                                                       "refuse every key (503)")
    auth_stale: float = Field(60.0, gt=0, description="seconds a validated key is admitted while Redis cannot be "
                              "asked (--auth-fallback cached)")
    limits_fail: Literal["open", "closed"] = Field("open", description="--auth keys with Redis unreachable: "
                                                   "requests pass unlimited (open) or are refused with 503 (closed)")
    auth_redis_timeout: float = Field(0.5, gt=0, description="--auth keys: seconds a key check or limit takes in "
                                      "Redis before it is tried once more; two timeouts in a row (or a refused "
                                      "connection) count as Redis unreachable")
    tenant_concurrency: int = Field(8, ge=1, le=10**6, description="--auth keys: sequences (an OpenAI request's "
                                    "choices, generate requests, requests on a gRPC stream) one tenant may have "
                                    "generating at once on this gateway process; more wait their turn (`dstool keys "
                                    "limits --concurrency` sets a tenant's own)")
    shared_cache_models: list[str] = Field(default_factory=list, description="a model (or family) whose cached "
                                           "answers every tenant shares (--auth keys; the default keeps each "
                                           "tenant's answers to itself): only for models whose answers hold nothing "
                                           "tenant-specific", json_schema_extra={"cli": {"flag": "--shared-cache-model",
                                                                                         "metavar": "MODEL"}})
    max_tokens_limit: int | None = Field(None, ge=1, description="the most tokens one OpenAI choice may have: a "
                                         "chat answer without max_tokens runs to the model's end or the context's, "
                                         "at most this; a larger max_tokens is a 400 naming the limit")
    responses_ttl: float = Field(30 * 86400.0, gt=0, description="seconds a stored response of the Responses API "
                                 "(store: true, OpenAI's default) is kept, in the --cache Redis (docs/responses.md)")
    max_response_bytes: int = Field(4 << 20, ge=1024, description="the most a stored response may hold, its "
                                    "conversation included: a larger one is not stored (store: false in it), a "
                                    "conversation already larger is refused (400) unless sent with store: false")
    responses_redis_timeout: float = Field(2.0, gt=0, description="seconds a call to the response store may take "
                                           "in Redis before a request that needs it is refused (503)")
    reasoning_parser: Literal["deepseek_r1", "deepseek_v3"] | None = Field(
        None, description="read a chat answer's thinking (<think>...</think>) into reasoning_content, as vLLM's parser "
        "of the name; a grammar (response_format, tools) applies after </think>; deepseek_v3: only for requests with "
        "chat_template_kwargs thinking (V3.1's toggle)")
    tool_call_parser: Literal["hermes", "deepseek_v3", "deepseek_v31"] = Field(
        "hermes", description="how tool_choice auto reads calls: hermes <tool_call>{...}</tool_call>, or DeepSeek "
        "V3's / V3.1's <｜tool▁calls▁begin｜> tokens")
    forward_headers: str | None = Field(None, description="regular expression of the request headers (gRPC "
                                        "metadata) Triton forwards to models — the same as its "
                                        "--http/grpc-header-forward-pattern: they reach Triton on a miss and are "
                                        "part of the cache key", json_schema_extra={"cli": {"metavar": "REGEX"}})

    @field_validator("forward_headers")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"'{v}' is not a regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _keys_only(self) -> GatewayOptions:
        if self.auth != "keys":
            fields = type(self).model_fields
            given = sorted(name for name in ("auth_fallback", "auth_stale", "limits_fail", "shared_cache_models",
                                             "auth_redis_timeout", "tenant_concurrency")
                           if getattr(self, name) != fields[name].get_default(call_default_factory=True))
            if given:
                flag = cli_extra(fields[given[0]]).get("flag") or "--" + given[0].replace("_", "-")
                raise ValueError(f"{flag} applies to --auth keys only")
        return self

    @model_validator(mode="after")
    def _token(self) -> GatewayOptions:
        if self.token is None and self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"--token-file {self.token_file}: {e.strerror}") from None
            if not token:
                raise ValueError(f"--token-file {self.token_file} is empty")
            object.__setattr__(self, "token", token)
        elif self.token is None and os.environ.get("DSTOOL_GATEWAY_TOKEN"):
            object.__setattr__(self, "token", os.environ["DSTOOL_GATEWAY_TOKEN"])
        return self


class GatewayConfig(GatewayOptions):
    """`dstool gateway`: KServe v2 HTTP/gRPC with a Redis result cache in front of Triton servers."""

    upstreams: list[str] = Field(description="a Triton HTTP endpoint HOST:PORT (repeat for several, used in turn)",
                                 json_schema_extra={"cli": {"flag": "--upstream", "metavar": "HOST:PORT"}})
    upstreams_grpc: list[str] = Field(default_factory=list, description="the matching Triton gRPC endpoints "
                                      "(default: each HTTP port + 1)",
                                      json_schema_extra={"cli": {"flag": "--upstream-grpc", "metavar": "HOST:PORT"}})
    cache: CacheURL = Field(AUTO, description="redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., a Redis Cluster "
                            "redis+cluster://[:PASSWORD@]HOST:PORT,HOST:PORT (a redis:// URL of a cluster node works "
                            "too), unix://PATH, memory, or auto: $DSTOOL_REDIS_URL or redis://127.0.0.1:6379/0 if it "
                            "answers, else an in-process LRU", json_schema_extra={"cli": {"metavar": "URL"}})
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(8001, ge=0, le=65535)
    repository: str | None = Field(None, description="the upstream's model repository, if readable here: version "
                                   "fingerprints then include its files")

    @field_validator("upstreams", "upstreams_grpc")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        return [_host_port(a) for a in v]

    @model_validator(mode="after")
    def _pairs(self) -> GatewayConfig:
        if not self.upstreams:
            raise ValueError("give at least one --upstream HOST:PORT (a Triton HTTP endpoint)")
        if self.upstreams_grpc and len(self.upstreams_grpc) != len(self.upstreams):
            raise ValueError("give one --upstream-grpc per --upstream (or none: HTTP port + 1)")
        return self

    def grpc_targets(self) -> list[str]:
        if self.upstreams_grpc:
            return list(self.upstreams_grpc)
        return [f"{a.rpartition(':')[0]}:{int(a.rpartition(':')[2]) + 1}" for a in self.upstreams]


K8S_OPTIONS = {"image", "k8s_name", "replicas", "max_replicas", "target_requests_per_second", "repository_pvc",
               "repository_image", "cpu", "memory", "gpus", "redis_maxmemory_mb"}


class ServeConfig(GatewayOptions):
    """`dstool serve`: a real Triton on a repository; with `cache`, behind the cache gateway."""

    repository: str = Field("model_repository", description="the model repository (from dstool export)")
    http_port: int = Field(8000, ge=0, le=65535, description="KServe v2 HTTP port clients use")
    grpc_port: int = Field(8001, ge=0, le=65535, description="KServe v2 gRPC port clients use")
    metrics_port: int = Field(8002, ge=0, le=65535, description="Triton's Prometheus metrics port")
    tritonserver: str | None = Field(None, description="path of the tritonserver binary (default: "
                                     "$DSTOOL_TRITONSERVER, PATH, or the nvidia-pytriton wheel's)")
    log_file: str = Field("tritonserver.log", description="Triton's log (dstool's own goes beside it, "
                          "dstool-serve.log)")
    timeout: float = Field(120.0, gt=0, description="seconds to wait for readiness")
    cache_config: str | None = Field(None, description="Triton's own response cache, passed to tritonserver "
                                     "--cache-config, e.g. local,size=268435456 (for models exported with "
                                     "--response-cache)", json_schema_extra={"cli": {"metavar": "SPEC"}})
    cache: CacheURL | None = Field(None, description="put the caching gateway on --http-port/--grpc-port and Triton "
                                   "on internal ports: redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., "
                                   "redis+cluster://HOST:PORT,HOST:PORT, unix://PATH, memory, or no value (auto): "
                                   "$DSTOOL_REDIS_URL or the local Redis if it answers, else an in-process LRU",
                                   json_schema_extra={"cli": {"const": "auto", "metavar": "URL"}})
    emit: Literal["k8s"] | None = Field(None, description="print the Kubernetes objects (YAML) of this serving tier "
                                        "instead of starting it: Deployment, Service, HorizontalPodAutoscaler and, "
                                        "without --cache URL, a Redis StatefulSet")
    image: str = Field(f"dstool-serve:{__version__}", description="the serve image (Dockerfile target serve) for "
                       "--emit k8s")
    k8s_name: str = Field("dstool-serve", description="name of the Kubernetes objects, Redis's NAME-redis "
                          "(--emit k8s)", json_schema_extra={"cli": {"metavar": "NAME"}})
    replicas: int = Field(1, ge=1, description="serving pods, the autoscaler's minimum (--emit k8s)")
    max_replicas: int = Field(4, ge=1, description="the autoscaler's maximum; equal to --replicas: no autoscaler "
                              "(--emit k8s)")
    target_requests_per_second: float = Field(50.0, gt=0, description="inference requests per second per pod the "
                                              "autoscaler aims at (--emit k8s)",
                                              json_schema_extra={"cli": {"metavar": "RATE"}})
    repository_pvc: str | None = Field(None, description="PersistentVolumeClaim holding the model repository, "
                                       "mounted read-only at /models (--emit k8s; default: dstool-models unless "
                                       "--repository-image)", json_schema_extra={"cli": {"metavar": "CLAIM"}})
    repository_image: str | None = Field(None, description="image with the model repository at /models and a cp, "
                                         "which an init container copies into the pod (--emit k8s)",
                                         json_schema_extra={"cli": {"metavar": "IMAGE"}})
    cpu: str = Field("2", description="CPU each serving pod requests and is limited to (--emit k8s)")
    memory: str = Field("8Gi", description="memory each serving pod requests and is limited to (--emit k8s)")
    gpus: int = Field(0, ge=0, description="nvidia.com/gpu per serving pod, for a repository exported with --device "
                      "gpu (--emit k8s)")
    redis_maxmemory_mb: int = Field(1024, ge=16, description="maxmemory (allkeys-lru) of the emitted Redis "
                                    "(--emit k8s)", json_schema_extra={"cli": {"metavar": "MB"}})

    @model_validator(mode="after")
    def _k8s(self) -> ServeConfig:
        if self.emit is None:
            given = sorted(K8S_OPTIONS & self.model_fields_set)
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} applies to --emit k8s only")
            return self
        if self.repository_pvc and self.repository_image:
            raise ValueError("give --repository-pvc or --repository-image, not both")
        if self.max_replicas < self.replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}")
        if not DNS_LABEL_RE.match(self.k8s_name) or len(self.k8s_name) > 46:
            raise ValueError(f"--k8s-name '{self.k8s_name}' is not a Kubernetes name: lowercase letters, digits and "
                             "'-', starting with a letter, at most 46 characters")
        if self.repository_pvc and (not DNS_SUBDOMAIN_RE.match(self.repository_pvc) or len(self.repository_pvc) > 253):
            raise ValueError(f"--repository-pvc '{self.repository_pvc}' is not a Kubernetes name")
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory)):
            if not QUANTITY_RE.match(value):
                raise ValueError(f"{flag} '{value}' is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
        if self.cache is not None and self.cache.kind == "unix":
            raise ValueError("--cache unix://... is a socket on this machine, which a pod cannot reach: give a "
                             "redis:// URL or leave --cache out for an emitted Redis")
        return self

    @model_validator(mode="after")
    def _keys(self) -> ServeConfig:
        if self.auth == "keys" and self.cache is None and self.emit is None:
            raise ValueError("--auth keys is the cache gateway's, with its Redis: add --cache (a redis:// URL, or "
                             "no value for the local Redis)")
        return self

    def gateway(self, upstream_http: str, upstream_grpc: str) -> GatewayConfig:
        """The gateway in front of a Triton listening on these internal addresses."""
        shared = {k: getattr(self, k) for k in GatewayOptions.model_fields}
        return GatewayConfig(**shared, upstreams=[upstream_http], upstreams_grpc=[upstream_grpc],
                             cache=self.cache or AUTO, http_port=self.http_port,
                             grpc_port=self.grpc_port, repository=str(Path(self.repository).resolve()))


class SamplingOptions(CommandConfig):
    """How generated tokens are chosen (greedy unless one of these asks to sample), as the models' request
    parameters."""

    temperature: float | None = Field(None, ge=0, le=100, description="sample at this temperature (0: greedy)")
    top_k: int | None = Field(None, ge=0, description="sample from the k most likely tokens")
    top_p: float | None = Field(None, gt=0, le=1, description="sample from the smallest set this likely")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below this share of the most likely")
    repetition_penalty: float | None = Field(None, gt=0, description="penalize tokens already in prompt or output")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's presence penalty")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's frequency penalty")
    seed: int | None = Field(None, ge=0, description="the same seed, the same sampled text")
    json_schema: str | None = Field(None, description="a JSON schema file the answer must follow (structured "
                                    "outputs: enforced by the grammar engine while sampling)",
                                    json_schema_extra={"cli": {"metavar": "FILE"}})

    def structured(self) -> dict | None:
        """--json-schema as the models' structured_outputs parameter (checked when the config was read)."""
        return None if self.json_schema is None else {"json": json.loads(Path(self.json_schema).read_text())}

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from dstool.serve.triton_models.grammar import GrammarError, grammar_of  # noqa: PLC0415 (numpy: the CLI's parser imports this module)

        try:
            schema = json.loads(Path(v).read_text())
        except OSError as e:
            raise ValueError(f"--json-schema {v}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise ValueError(f"--json-schema {v}: not JSON ({e})") from None
        try:
            grammar_of({"json": schema})
        except GrammarError as e:
            raise ValueError(f"--json-schema {v}: {str(e).split(': ', 1)[-1]}") from None
        return v

    def sampling(self) -> dict:
        """The options given, as the models' request parameters."""
        names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @model_validator(mode="after")
    def _engines_rule(self) -> SamplingOptions:
        """What the models would refuse is refused here, by their own rule (one message, before any work)."""
        from dstool.serve.triton_models.sampling import SamplingError, SamplingParams  # noqa: PLC0415 (numpy: the CLI's parser imports this module)

        try:
            SamplingParams.from_parameters(self.sampling())
        except SamplingError as e:
            name, _, rest = str(e).partition(" ")
            raise ValueError(f"--{name.replace('_', '-')} {rest}") from None
        return self


class ClientOptions(SamplingOptions):
    """What a client of a served model sends besides its request: the gateway's credentials."""

    api_key: str | None = Field(None, description="the gateway's API key (from `dstool keys create`, or its "
                                "--token-file token); default $DSTOOL_API_KEY, else $DSTOOL_GATEWAY_TOKEN (a flag "
                                "shows in process lists: prefer the variable)", json_schema_extra={
                                    "cli": {"metavar": "KEY"}, "secret": True})

    def credentials(self) -> dict[str, str]:
        """The Authorization header to send, if a key is given."""
        key = self.api_key or os.environ.get("DSTOOL_API_KEY") or os.environ.get("DSTOOL_GATEWAY_TOKEN")
        return {"authorization": f"Bearer {key}"} if key else {}


class InferConfig(ClientOptions):
    """`dstool infer`: text through MODEL_generate, or token ids through the tensor model, with tritonclient."""

    prompt: str | None = positional("text to continue", default=None)
    ids: str | None = Field(None, description="comma-separated token ids for the tensor model (instead of PROMPT)")
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="tokens to generate (default: the "
                                       "model's, 32; "
                                       "with --openai, OpenAI's 16)")
    kv_cache: bool = Field(True, description="decode with the key/value cache")
    url: str | None = Field(None, description="HOST:PORT (default: 127.0.0.1:8000 for http, :8001 for grpc)")
    protocol: Literal["http", "grpc"] = "http"
    model: str = Field("dstool_lm", description="the model family's name in the repository")
    stream: bool = Field(False, description="print the text token by token as MODEL_llm generates it")
    openai: bool = Field(False, description="ask the gateway's OpenAI route (/v1/completions; HTTP port)")
    edge: str | None = Field(None, description="generate here, with onnxruntime, from this edge package (dstool "
                             "export --target edge) instead of a server; prints the peak memory and tokens/s",
                             json_schema_extra={"cli": {"metavar": "PACKAGE"}})
    memory_cap_mb: float | None = Field(None, gt=0, description="--edge: the most resident memory the package may "
                                        "add to the process; blocks that do not fit stay closed until needed "
                                        "(default: no cap, every block stays open)",
                                        json_schema_extra={"cli": {"metavar": "MB"}})

    @field_validator("ids")
    @classmethod
    def _ids(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", v):
            raise ValueError(f"--ids takes comma-separated token ids, got '{v}'")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> InferConfig:
        if (self.prompt is None) == (self.ids is None):
            raise ValueError("give a PROMPT to generate from, or --ids for the tensor model (one of the two)")
        if self.ids is not None and (self.stream or self.openai or self.sampling() or self.json_schema):
            raise ValueError("--stream, --openai, --json-schema and sampling options generate text: give a PROMPT, "
                             "not --ids")
        if self.json_schema and not self.kv_cache:
            raise ValueError("--json-schema is enforced by MODEL_llm, which always decodes with the key/value cache: "
                             "drop --no-kv-cache")
        if self.openai and self.protocol != "http":
            raise ValueError("--openai speaks HTTP to the gateway: drop --protocol grpc")
        if self.edge is None and self.memory_cap_mb is not None:
            raise ValueError("--memory-cap-mb applies to --edge only")
        server = sorted(self.model_fields_set & {"ids", "url", "protocol", "model", "stream", "openai", "kv_cache",
                                                 "api_key"})
        if self.edge is not None and server:
            raise ValueError(f"--{server[0].replace('_', '-')} is for a served model: --edge generates from the "
                             "package here (drop it)")
        return self

    def token_ids(self) -> list[int]:
        return [int(x) for x in (self.ids or "").split(",") if x.strip()]

    @property
    def address(self) -> str:
        return self.url or ("127.0.0.1:8001" if self.protocol == "grpc" else "127.0.0.1:8000")


class BatchConfig(ClientOptions):
    """`dstool batch`: offline generation or scoring over a data set on Apache Spark."""

    input: str = positional("jsonl, parquet or csv file (or a folder of them) of prompts; default: 1,000 prompts "
                            "from the embedded corpus's held-out tail", default="embedded:heldout-prompts",
                            metavar="INPUT")
    output: str = Field("runs/batch", description="output folder: rows/ (one file per partition), failures.jsonl, "
                        "dstool.json")
    repository: str = Field("model_repository", description="the model repository (from dstool export): its "
                            "manifest says which version made the results")
    model: str = Field("dstool_lm", description="the model family's name in the repository")
    version: int | None = Field(None, ge=1, description="the deployed version to use (default: the newest)")
    task: Literal["generate", "score"] = Field("generate", description="generate: new text after each prompt; "
                                               "score: each text's log-likelihood and perplexity")
    engine: Literal["onnx", "triton"] = Field("onnx", description="onnx: ONNX Runtime inside each executor on the "
                                              "repository's graphs; triton: a running Triton or dstool gateway "
                                              "(--url), so online and offline traffic share its cache")
    url: str = Field("127.0.0.1:8001", description="--engine triton: the gRPC HOST:PORT of Triton or the gateway")
    column: str = Field("prompt", description="the input column of text")
    ids_column: str | None = Field(None, description="an input column of token-id lists to use instead of text "
                                   "(--engine onnx)")
    schema_column: str | None = Field(None, description="an input column of JSON schemas (JSON text), one per row, "
                                      "each row's answer following its own (an empty cell: --json-schema's, or "
                                      "none); --engine onnx")
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="tokens to generate per row (default: "
                                       "the model's)")
    master: str | None = Field(None, description="Spark master: local[N], spark://HOST:7077, k8s://..., yarn "
                               "(default: local[2], or spark-submit's)")
    partitions: int | None = Field(None, ge=1, description="output partitions, each resumable on its own "
                                   "(default: one per 128 rows, at least 2)")
    max_batch: int = Field(16, ge=1, description="--engine onnx: rows decoded together per step in a task")
    concurrency: int = Field(16, ge=1, description="--engine triton: requests in flight per task")
    max_rows: int | None = Field(None, ge=1, description="use the first N rows of the input only")
    format: Literal["parquet", "jsonl"] = Field("parquet", description="output file format")
    on_error: Literal["fail", "record"] = Field("fail", description="a row that cannot run (a prompt too long for "
                                                "the model, an empty one): fail the job with one line, or record "
                                                "it in failures.jsonl and go on")
    overwrite: bool = Field(False, description="discard an output folder that holds another job's results")
    spark_conf: dict[str, str] = Field(default_factory=dict, description="extra Spark settings KEY=VALUE (repeat)",
                                       json_schema_extra={"cli": {"flag": "--conf", "metavar": "KEY=VALUE"}})

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _host_port(v)

    @model_validator(mode="after")
    def _choices(self) -> BatchConfig:
        if self.ids_column is not None and self.engine == "triton":
            raise ValueError("--ids-column needs --engine onnx (the served generation model takes text): give a text "
                             "--column or --engine onnx")
        if self.task == "score" and (self.sampling() or self.max_new_tokens is not None or self.json_schema or
                                     self.schema_column):
            raise ValueError("--task score reads the texts as they are: drop the sampling, --json-schema, "
                             "--schema-column and --max-new-tokens options")
        if self.api_key is not None and self.engine != "triton":
            raise ValueError("--api-key is for a served model (--engine triton): ONNX Runtime runs in the executors")
        if (self.json_schema or self.schema_column) and self.engine == "triton":
            raise ValueError("--json-schema and --schema-column need --engine onnx (the grammar runs in each "
                             "executor's sampler; the served generate model enforces none)")
        return self


DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
KEY_ACTIONS = {"create": {"tenant", "models", "rpm", "tpm", "budget_tokens", "per", "expires", "cache_scope", "admin"},
               "list": {"tenant", "format"}, "revoke": {"key_id"}, "rotate": {"key_id", "grace"},
               "usage": {"tenant", "format"}, "limits": {"tenant", "rpm", "tpm", "budget_tokens", "per", "concurrency"}}


def seconds(text: str) -> float:
    """A duration: 90s, 15m, 12h, 30d."""
    m = DURATION_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"'{text}' is not a duration: a number with s, m, h or d (e.g. 30d, 12h)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


class KeysConfig(CommandConfig):
    """`dstool keys`: tenants' API keys for `dstool serve --auth keys`, kept (hashed) in the gateways' Redis."""

    action: Literal["create", "list", "revoke", "rotate", "usage", "limits"] = positional(
        "create (prints the new key once), list, revoke ID, rotate ID (prints the new secret once), usage, or limits "
        "(a tenant's own limits over all its keys)", metavar="ACTION")
    key_id: str | None = positional("the key's id (revoke, rotate; `dstool keys list` shows them)", None, "ID")
    redis: CacheURL = Field(AUTO, description="the gateways' Redis: redis://..., rediss://..., redis+cluster://... "
                            "(default: $DSTOOL_REDIS_URL or redis://127.0.0.1:6379/0, the serving cache's)",
                            json_schema_extra={"cli": {"metavar": "URL"}})
    tenant: str | None = Field(None, description="the tenant (create, limits; list and usage: only its rows)")
    models: str | None = Field(None, description="comma-separated models (or families, NAME for NAME_llm, ...) "
                               "the key may use (default: all)", json_schema_extra={"cli": {"metavar": "M,..."}})
    rpm: int = Field(0, ge=0, le=10**12, description="requests per minute (0: no limit)")
    tpm: int = Field(0, ge=0, le=10**12, description="tokens per minute, prompt and generated (0: no limit)")
    budget_tokens: int = Field(0, ge=0, le=10**15, description="tokens per --per day or month (0: no budget)",
                               json_schema_extra={"cli": {"metavar": "N"}})
    per: Literal["day", "month"] | None = Field(None, description="the budget's period (UTC)")
    concurrency: int = Field(0, ge=0, le=10**6, description="limits: sequences the tenant may have generating at once "
                             "on each gateway process, and its weight in the fair share (0: the gateway's "
                             "--tenant-concurrency)")
    expires: str | None = Field(None, description="the key expires after this long: 90s, 15m, 12h, 30d",
                                json_schema_extra={"cli": {"metavar": "DURATION"}})
    cache_scope: Literal["tenant", "shared"] = Field("tenant", description="tenant: cached answers are this tenant's "
                                                     "alone; shared: the key reads and writes the scope every shared "
                                                     "key uses (see docs/tenants.md for the risk)")
    admin: bool = Field(False, description="the key may also load and unload models, use shared memory, read "
                        "/metrics and every model's statistics")
    grace: str = Field("0s", description="rotate: how long the old secret still works", json_schema_extra={
        "cli": {"metavar": "DURATION"}})
    format: Literal["table", "json"] = Field("table", description="how list and usage print")

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str | None) -> str | None:
        if v is not None and not TENANT_RE.fullmatch(v):
            raise ValueError(f"'{v}' is not a tenant name: 1-64 letters, digits, '.', '_' or '-', starting with a "
                             "letter or digit")
        return v

    @field_validator("expires", "grace")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None:
            seconds(v)
        return v

    @model_validator(mode="after")
    def _applies(self) -> KeysConfig:
        allowed = KEY_ACTIONS[self.action] | {"action", "redis"}
        given = sorted(self.model_fields_set - allowed)
        if given:
            name = given[0]
            shown = "ID" if name == "key_id" else "--" + name.replace("_", "-")
            raise ValueError(f"{shown} does not apply to `dstool keys {self.action}`")
        if self.action in ("create", "limits") and self.tenant is None:
            raise ValueError(f"`dstool keys {self.action}` needs --tenant NAME")
        if self.action in ("revoke", "rotate") and not self.key_id:
            raise ValueError(f"`dstool keys {self.action}` needs the key's ID (`dstool keys list` shows them)")
        if (self.budget_tokens > 0) != (self.per is not None):
            raise ValueError("--budget-tokens N goes with --per day or --per month")
        return self

    @field_validator("models")
    @classmethod
    def _models(cls, v: str | None) -> str | None:
        if v is not None and not [m for m in v.split(",") if m.strip()]:
            raise ValueError("names no model: give comma-separated model names, or leave --models out for all")
        return v

    def model_list(self) -> list[str]:
        return [m.strip() for m in (self.models or "").split(",") if m.strip()]
