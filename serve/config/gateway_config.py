"""The options of the cache gateway: `dstool gateway`, and `dstool serve --cache` (GatewayOptions)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig, cli_extra
from dstool.serve.cache_url import AUTO, CacheURL


def host_port(address: str) -> str:
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
    max_connections: int = Field(1024, ge=1, description="HTTP connections at once (503 beyond); also each Redis "
                                 "client's pool (a cluster's: each node's; beyond it a plain client's call waits)")
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
        return [host_port(a) for a in v]

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
