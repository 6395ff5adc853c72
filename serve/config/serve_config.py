"""The options of `dstool serve`: Triton on a repository, the gateway in front, its Kubernetes form."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from dstool import __version__
from dstool.serve.cache_url import AUTO, CacheURL
from dstool.serve.config.gateway_config import GatewayConfig, GatewayOptions

DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
QUANTITY_RE = re.compile(r"^\d+(\.\d+)?([mkMGTPE]|[KMGTPE]i)?$")
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
