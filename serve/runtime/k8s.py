"""`dstool serve --emit k8s`: the serving tier as Kubernetes objects (apps/v1, v1, autoscaling/v2).

A serving pod runs the serve image's `dstool serve --cache URL`: the cache gateway on the HTTP and gRPC ports
(Prometheus /metrics on the HTTP port), Triton on internal ports in the same container. The model repository is
a PersistentVolumeClaim mounted read-only at /models, or is copied there from an image by an init container.
Without a `--cache URL` a one-pod Redis StatefulSet (no persistence, allkeys-lru) and its headless Service come
first; with one (a Redis of the cluster's own, e.g. redis+cluster://HOST:PORT,HOST:PORT), no Redis objects.

The HorizontalPodAutoscaler scales on CPU and on the Pods metric `dstool_gateway_requests_per_second`: each
pod's rate of inference requests (all outcomes: hits, misses, bypassed, errors). The cluster needs a Prometheus
scraping the pods (they carry prometheus.io/* annotations) and a custom-metrics adapter serving that name, e.g.
this prometheus-adapter rule:

    - seriesQuery: 'dstool_gateway_request_seconds_count{namespace!="",pod!=""}'
      resources: {overrides: {namespace: {resource: namespace}, pod: {resource: pod}}}
      name: {as: dstool_gateway_requests_per_second}
      metricsQuery: 'sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)'

Without it the autoscaler still scales up on CPU, but not down (a metric it cannot read blocks scaling down).
"""

from __future__ import annotations

import math

from dstool import __version__
from dstool.config import changed, cli_extra
from dstool.serve.config.gateway_config import GatewayOptions
from dstool.serve.config.serve_config import ServeConfig

MODELS = "/models"
DEFAULT_PVC = "dstool-models"
REDIS_IMAGE = "redis:7.4.1-alpine"  # as docker-compose.yml
REDIS_PORT = 6379
REDIS_VOLUME = "1Gi"  # --auth keys: the append-only file of keys, limits and usage
REQUESTS_METRIC = "dstool_gateway_requests_per_second"
CPU_UTILIZATION = 70
PRESTOP_SECONDS = 5  # the endpoints controller takes the pod out of the Service before SIGTERM
TRITON_STOP_SECONDS = 15  # Triton.stop's grace after the gateway drained
# The options the pod's `dstool serve` gets when they differ from the defaults (the image's entrypoint sets
# the repository, tritonserver, host and log file; a token would belong in a Secret, not in the manifest).
PASSED_ON = (set(GatewayOptions.model_fields) - {"host", "token", "token_file"}
             | {"http_port", "grpc_port", "metrics_port", "timeout", "cache_config"})


def _labels(selector: dict, component: str, version: str) -> dict:
    """A new dict each time: YAML would write a shared one as an anchor and aliases."""
    return {**selector, "app.kubernetes.io/component": component, "app.kubernetes.io/part-of": "dstool",
            "app.kubernetes.io/version": version}


def _quantity(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{round(x * 1000)}m"


def _probe(path: str, cfg: ServeConfig, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": math.ceil(cfg.health_timeout) + 1, "failureThreshold": failures}


def _redis(name: str, mb: int, durable: bool) -> list[dict]:
    """Redis for the cache; `durable` (--auth keys: it holds the keys, limits and usage too): an append-only file on
    a volume of its own, and only entries with a TTL (cached results, buckets) evicted when it is full."""
    selector = {"app.kubernetes.io/name": "redis", "app.kubernetes.io/instance": name}
    redis, version = f"{name}-redis", REDIS_IMAGE.split(":")[1]
    memory = f"{mb + mb // 2}Mi"  # room above maxmemory for Redis's own overhead and fragmentation
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["redis-server", "--save", "", "--appendonly", "yes" if durable else "no", "--maxmemory", f"{mb}mb",
                 "--maxmemory-policy", "volatile-lru" if durable else "allkeys-lru"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "500m", "memory": memory}, "limits": {"memory": memory}},
    }
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": redis, "labels": _labels(selector, "cache", version)},
               "spec": {"clusterIP": "None", "selector": dict(selector),
                        "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}}
    statefulset: dict = {"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": {"name": redis, "labels": _labels(selector, "cache", version)},
                   "spec": {"serviceName": redis, "replicas": 1, "selector": {"matchLabels": dict(selector)},
                            "template": {"metadata": {"labels": _labels(selector, "cache", version)},
                                         "spec": {"enableServiceLinks": False, "containers": [container]}}}}
    if durable:
        container["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
        statefulset["spec"]["volumeClaimTemplates"] = [{"metadata": {"name": "data"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": REDIS_VOLUME}}}}]
    return [service, statefulset]


def _admin_secret(name: str, selector: dict, token: str) -> dict:
    """The first admin key of --auth keys (the gateway's token, from --token-file), in a Secret the pods read."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{name}-admin-key", "labels": _labels(selector, "server", __version__)},
            "stringData": {"token": token}}


def _redis_policy(name: str, selector: dict) -> dict:
    """--auth keys: Redis holds the keys, so only the serving pods may reach it."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-redis", "labels": _labels(selector, "cache", __version__)},
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "redis",
                                                     "app.kubernetes.io/instance": name}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": dict(selector)}}],
                                  "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]}}


def admin_secret_hint(cfg: ServeConfig) -> str | None:
    """What to do before applying --auth keys objects that name an admin key Secret they do not hold."""
    if cfg.auth != "keys" or cfg.token:
        return None
    return (f"the pods read their admin key from the Secret {cfg.k8s_name}-admin-key, which these objects do not "
            f"hold: kubectl create secret generic {cfg.k8s_name}-admin-key --from-literal=token=$(openssl rand "
            "-base64 32) (or emit with --token-file FILE to include it)")


def _flag_args(cfg: ServeConfig) -> list[str]:
    """The options passed on, as flags (a list as the flag repeated)."""
    args = []
    for k, v in changed(cfg).items():
        if k in PASSED_ON:
            flag = cli_extra(ServeConfig.model_fields[k]).get("flag") or f"--{k.replace('_', '-')}"
            for item in v if isinstance(v, list) else [v]:
                args += [flag, str(item)]
    return args


def serving_manifests(cfg: ServeConfig) -> list[dict]:
    """The objects (dicts ready for YAML, in `kubectl apply` order) that run `cfg`'s serving tier."""
    name = cfg.k8s_name
    own_redis = cfg.cache is None or cfg.cache.kind == "auto"
    cache_url = f"redis://{name}-redis:{REDIS_PORT}/0" if own_redis else str(cfg.cache)
    selector = {"app.kubernetes.io/name": "dstool-serve", "app.kubernetes.io/instance": name}

    def meta() -> dict:
        return {"name": name, "labels": _labels(selector, "server", __version__)}

    args = _flag_args(cfg)
    keys = cfg.auth == "keys"
    limits: dict = {"cpu": cfg.cpu, "memory": cfg.memory}
    container = {
        "name": "serve",
        "image": cfg.image,
        "args": ["--cache", "$(DSTOOL_CACHE_URL)", *args],
        "env": [{"name": "DSTOOL_CACHE_URL", "value": cache_url},
                *([{"name": "DSTOOL_GATEWAY_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": f"{name}-admin-key", "key": "token"}}}] if keys else [])],
        "ports": [{"name": "http", "containerPort": cfg.http_port, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": cfg.grpc_port, "protocol": "TCP"}],
        # the gateway listens once Triton has loaded the models, which `timeout` bounds
        "startupProbe": _probe("/v2/health/ready", cfg, 10, math.ceil((cfg.timeout + 120) / 10)),
        "readinessProbe": _probe("/v2/health/ready", cfg, 5, 2),
        "livenessProbe": _probe("/v2/health/live", cfg, 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "resources": {"requests": {"cpu": cfg.cpu, "memory": cfg.memory},
                      "limits": {**limits, "nvidia.com/gpu": cfg.gpus} if cfg.gpus else limits},
        "volumeMounts": [{"name": "models", "mountPath": MODELS, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod: dict = {
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + math.ceil(cfg.shutdown_grace) + TRITON_STOP_SECONDS,
        "enableServiceLinks": False,
        "containers": [container],
        # Triton's python backend exchanges tensors through /dev/shm
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
    }
    if cfg.repository_image:
        pod["initContainers"] = [{"name": "repository", "image": cfg.repository_image,
                                  "command": ["cp", "-a", f"{MODELS}/.", "/repository/"],
                                  "volumeMounts": [{"name": "models", "mountPath": "/repository"}]}]
        pod["volumes"].insert(0, {"name": "models", "emptyDir": {}})
    else:
        pod["volumes"].insert(0, {"name": "models", "persistentVolumeClaim": {
            "claimName": cfg.repository_pvc or DEFAULT_PVC, "readOnly": True}})
    autoscaled = cfg.max_replicas > cfg.replicas
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(), "spec": {
        **({} if autoscaled else {"replicas": cfg.replicas}),  # the autoscaler owns the count when there is one
        "selector": {"matchLabels": dict(selector)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": meta()["labels"], "annotations": {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(cfg.http_port),
            "prometheus.io/path": "/metrics"}}, "spec": pod}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(), "spec": {
               "type": "ClusterIP", "selector": dict(selector),
               "ports": [{"name": "http", "port": cfg.http_port, "targetPort": "http", "protocol": "TCP",
                          "appProtocol": "http"},
                         {"name": "grpc", "port": cfg.grpc_port, "targetPort": "grpc", "protocol": "TCP",
                          "appProtocol": "kubernetes.io/h2c"}]}}
    objects = [*(_redis(name, cfg.redis_maxmemory_mb, keys) if own_redis else []),
               *([_redis_policy(name, selector)] if keys and own_redis else []),
               *([_admin_secret(name, selector, cfg.token)] if keys and cfg.token else []), deployment, service]
    if autoscaled:
        objects.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta(), "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": cfg.replicas, "maxReplicas": cfg.max_replicas,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": REQUESTS_METRIC}, "target": {
                             "type": "AverageValue", "averageValue": _quantity(cfg.target_requests_per_second)}}},
                        {"type": "Resource", "resource": {"name": "cpu", "target": {
                            "type": "Utilization", "averageUtilization": CPU_UTILIZATION}}}]}})
    return objects
