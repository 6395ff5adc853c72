"""Prometheus metrics of the gateway (served on the HTTP port at /metrics), in a registry of its own.

A `model` label is a model Triton has reported to exist: any other name a client sends is counted as
"(unknown)", so clients cannot grow the metrics by inventing names."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
UNKNOWN_MODEL = "(unknown)"


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.models: set[str] = set()  # names Triton reported (metadata answered 200)
        r = self.registry
        self.hits = Counter("dstool_gateway_cache_hits", "Inference requests answered from the cache",
                            ["model", "protocol"], registry=r)
        self.misses = Counter("dstool_gateway_cache_misses", "Cacheable inference requests computed by Triton",
                              ["model", "protocol"], registry=r)
        self.bypassed = Counter("dstool_gateway_cache_bypassed",
                                "Inference requests not cacheable (opt-out, sequence/decoupled model, shared memory)",
                                ["model", "protocol"], registry=r)
        self.errors = Counter("dstool_gateway_errors", "Errors by kind (redis, corrupt_entry, upstream, bad_request, "
                              "unauthorized, timeout, slow_client)", ["kind"], registry=r)
        self.bytes = Counter("dstool_gateway_cache_bytes", "Output bytes served from the cache (hit) or stored (store)",
                             ["model", "direction"], registry=r)
        self.latency = Histogram("dstool_gateway_request_seconds", "Inference latency inside the gateway",
                                 ["model", "protocol", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_requests = Counter("dstool_gateway_tenant_requests", "Requests of each tenant (--auth keys) by "
                                       "outcome: admitted, checked (not an inference), limited (429), revoked, "
                                       "expired, unavailable (Redis down, limits closed), admitted_unchecked (Redis "
                                       "down, limits open)", ["tenant", "outcome"], registry=r)
        self.tenant_tokens = Counter("dstool_gateway_tenant_tokens", "Tokens of each tenant (--auth keys): prompt, "
                                     "completion, cached (prompt tokens the engine's prefix cache held)",
                                     ["tenant", "kind"], registry=r)
        self.tenant_waiting = Gauge("dstool_gateway_tenant_waiting_sequences", "Sequences of each tenant (--auth keys) "
                                    "waiting for their turn (over the tenant's concurrency)", ["tenant"], registry=r,
                                    multiprocess_mode="livesum")
        self.memory_bytes = Gauge("dstool_gateway_memory_cache_bytes", "Bytes the in-process cache holds: results "
                                  "and their protocol renderings", registry=r, multiprocess_mode="livesum")
        self.memory_entries = Gauge("dstool_gateway_memory_cache_entries", "Entries in the in-process cache",
                                    registry=r, multiprocess_mode="livesum")

    def model(self, name: str) -> str:
        """The label for a model name: itself if Triton has it, else "(unknown)"."""
        return name if name in self.models else UNKNOWN_MODEL

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def tenant(self, tenant: str, outcome: str) -> None:
        """Count a request of `tenant`: a name from a key record, which only `dstool keys` makes (a bounded label)."""
        self.tenant_requests.labels(tenant, outcome).inc()

    def tokens(self, tenant: str, prompt: int, completion: int, cached: int) -> None:
        for kind, n in (("prompt", prompt), ("completion", completion), ("cached", cached)):
            if n:
                self.tenant_tokens.labels(tenant, kind).inc(n)

    def waiting(self, tenant: str, sequences: int) -> None:
        self.tenant_waiting.labels(tenant).set(sequences)

    def observe(self, model: str, protocol: str, outcome: str, seconds: float, nbytes: int = 0) -> None:
        """Count one inference request: outcome is hit, miss, bypass or error."""
        label = self.model(model)
        if outcome == "hit":
            self.hits.labels(label, protocol).inc()
            self.bytes.labels(label, "hit").inc(nbytes)
        elif outcome == "miss":
            self.misses.labels(label, protocol).inc()
        elif outcome == "bypass":
            self.bypassed.labels(label, protocol).inc()
        self.latency.labels(label, protocol, outcome).observe(seconds)

    def render(self) -> bytes:
        """This process's metrics; with several workers (PROMETHEUS_MULTIPROC_DIR set), all of theirs added up."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
