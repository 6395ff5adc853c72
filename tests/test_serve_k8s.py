"""`dstool serve --emit k8s`: every object is checked against the Kubernetes API's own JSON schemas (strict: no
unknown fields), offline with kubernetes-validate; nothing is started."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from dstool.cli import main
from dstool.serve.config.serve_config import ServeConfig
from dstool.serve.runtime.k8s import REQUESTS_METRIC, serving_manifests

K8S_VERSION = "1.32.0"


def _validate(objects: list[dict]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


def _emit(capsys, *flags: str) -> list[dict]:
    assert main(["serve", "--emit", "k8s", *flags]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_default_emit_validates_with_its_own_redis_and_the_pvc():
    objects = serving_manifests(ServeConfig(emit="k8s"))
    _validate(objects)
    kinds = _by_kind(objects)
    assert [o["kind"] for o in objects] == ["Service", "StatefulSet", "Deployment", "Service",
                                            "HorizontalPodAutoscaler"]
    redis_service, serve_service = kinds["Service"]
    redis = kinds["StatefulSet"][0]
    assert redis_service["spec"]["clusterIP"] == "None" and redis["spec"]["serviceName"] == redis_service["metadata"][
        "name"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--maxmemory") + 1] == "1024mb"
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][:2] == ["--cache", "$(DSTOOL_CACHE_URL)"]
    port = redis_service["spec"]["ports"][0]["port"]
    assert c["env"] == [{"name": "DSTOOL_CACHE_URL", "value": f"redis://{redis_service['metadata']['name']}:{port}/0"}]
    claim = {"claimName": "dstool-models", "readOnly": True}
    assert {"name": "models", "persistentVolumeClaim": claim} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "initContainers" not in pod
    assert pod["terminationGracePeriodSeconds"] >= ServeConfig().shutdown_grace
    assert {p["name"]: (p["port"], p.get("appProtocol")) for p in serve_service["spec"]["ports"]} == {
        "http": (8000, "http"), "grpc": (8001, "kubernetes.io/h2c")}
    hpa = kinds["HorizontalPodAutoscaler"][0]["spec"]
    assert hpa["scaleTargetRef"]["name"] == kinds["Deployment"][0]["metadata"]["name"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    assert [m["type"] for m in hpa["metrics"]] == ["Pods", "Resource"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == REQUESTS_METRIC
    assert hpa["metrics"][1]["resource"]["name"] == "cpu"


def test_external_cache_image_repository_and_gpu_validate():
    cfg = ServeConfig(emit="k8s", cache="redis://my-redis:6379/0", repository_image="registry.example/models:3",
                      gpus=1, replicas=2, max_replicas=8, target_requests_per_second=12.5, shutdown_grace=90,
                      cache_ttl=600, k8s_name="lm")
    objects = serving_manifests(cfg)
    _validate(objects)
    kinds = _by_kind(objects)
    assert "StatefulSet" not in kinds and len(kinds["Service"]) == 1  # the given Redis: none emitted
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["env"] == [{"name": "DSTOOL_CACHE_URL", "value": "redis://my-redis:6379/0"}]
    assert c["args"][2:] == ["--cache-ttl", "600.0", "--shutdown-grace", "90.0"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    init = pod["initContainers"][0]
    assert init["image"] == "registry.example/models:3"
    assert {"name": "models", "emptyDir": {}} in pod["volumes"]
    assert init["volumeMounts"][0]["name"] == "models" and init["command"][-1] == init["volumeMounts"][0][
        "mountPath"] + "/"
    assert pod["terminationGracePeriodSeconds"] >= 90
    hpa = kinds["HorizontalPodAutoscaler"][0]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert hpa["metrics"][0]["pods"]["target"] == {"type": "AverageValue", "averageValue": "12500m"}
    assert "replicas" not in kinds["Deployment"][0]["spec"]  # the autoscaler owns the count


def test_fixed_replicas_have_no_autoscaler():
    objects = serving_manifests(ServeConfig(emit="k8s", cache="memory", replicas=3, max_replicas=3))
    _validate(objects)
    assert [o["kind"] for o in objects] == ["Deployment", "Service"]
    assert objects[0]["spec"]["replicas"] == 3


def test_selectors_match_the_pod_labels():
    for cfg in (ServeConfig(emit="k8s"), ServeConfig(emit="k8s", cache="redis://r:6379/0", k8s_name="other")):
        kinds = _by_kind(serving_manifests(cfg))
        for workload in kinds["Deployment"] + kinds.get("StatefulSet", []):
            selector = workload["spec"]["selector"]["matchLabels"]
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), workload["kind"]
            services = [s for s in kinds["Service"] if s["spec"]["selector"].items() <= labels.items()]
            assert len(services) == 1, workload["kind"]  # one Service each, selecting only its own pods
            assert services[0]["spec"]["selector"] == selector
            container = workload["spec"]["template"]["spec"]["containers"][0]
            names = {p["name"] for p in container["ports"]}
            assert {p["targetPort"] for p in services[0]["spec"]["ports"]} <= names
        assert all(o["metadata"]["labels"]["app.kubernetes.io/instance"] == cfg.k8s_name
                   for o in serving_manifests(cfg))


def test_probes_ask_the_gateway_health_routes_on_its_http_port():
    deployment = _by_kind(serving_manifests(ServeConfig(emit="k8s")))["Deployment"][0]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001}
    paths = {kind: (c[kind]["httpGet"]["path"], ports[c[kind]["httpGet"]["port"]])
             for kind in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert paths == {"readinessProbe": ("/v2/health/ready", 8000), "livenessProbe": ("/v2/health/live", 8000),
                     "startupProbe": ("/v2/health/ready", 8000)}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > ServeConfig().timeout  # model loading
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics"}


def test_a_broken_object_fails_validation():
    objects = serving_manifests(ServeConfig(emit="k8s"))
    broken = copy.deepcopy(objects[2])
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(objects[2])
    unknown["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # strict: no unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)


def test_cli_prints_the_same_objects_as_yaml(capsys):
    printed = _emit(capsys, "--cache", "redis://r1:6379/0", "--repository-pvc", "lm-repo", "--max-replicas", "6",
                    "--memory", "16Gi")
    cfg = ServeConfig(emit="k8s", cache="redis://r1:6379/0", repository_pvc="lm-repo", max_replicas=6, memory="16Gi")
    assert printed == serving_manifests(cfg)
    _validate(printed)
    assert _emit(capsys) == serving_manifests(ServeConfig(emit="k8s"))


@pytest.mark.parametrize(("flags", "needle"), [
    (["--emit", "k8s", "--repository-pvc", "a", "--repository-image", "b"], "not both"),
    (["--emit", "k8s", "--replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --replicas 3"),
    (["--emit", "k8s", "--memory", "lots"], "--memory 'lots' is not a Kubernetes quantity"),
    (["--emit", "k8s", "--k8s-name", "Serve_LM"], "--k8s-name 'Serve_LM' is not a Kubernetes name"),
    (["--emit", "k8s", "--cache", "unix:///run/redis.sock"], "a pod cannot reach"),
    (["--replicas", "2"], "--replicas applies to --emit k8s only"),
])
def test_a_bad_combination_exits_2_with_one_line(capsys, flags, needle):
    assert main(["serve", *flags]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("dstool: error:") and needle in lines[0], \
        captured.err


def test_auth_keys_emit_an_admin_key_secret_and_a_durable_shared_redis(capsys, tmp_path):
    (tmp_path / "admin.token").write_text("the-admin-t0ken\n")
    objects = _emit(capsys, "--auth", "keys", "--token-file", str(tmp_path / "admin.token"), "--shared-cache-model",
                    "dstool_lm", "--shared-cache-model", "other")
    _validate(objects)
    kinds = _by_kind(objects)
    secret = kinds["Secret"][0]
    assert secret["stringData"]["token"] == "the-admin-t0ken"  # the operator's own: re-applying changes nothing
    c = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "DSTOOL_GATEWAY_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "token"}}} in c["env"]
    assert " ".join(c["args"]).endswith("--auth keys --shared-cache-model dstool_lm --shared-cache-model other")
    assert "the-admin-t0ken" not in yaml.safe_dump(kinds["Deployment"])  # the pods read it from the Secret only
    redis = kinds["StatefulSet"][0]["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"  # the keys survive a restart
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"  # only entries with a TTL are evicted
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    policy = kinds["NetworkPolicy"][0]["spec"]  # only the serving pods reach the Redis that holds the keys
    assert policy["podSelector"]["matchLabels"] == redis["selector"]["matchLabels"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == kinds["Deployment"][0]["spec"][
        "selector"]["matchLabels"]
    # without --token-file: no secret value in the objects, the Secret named and how to make it said on stderr
    assert main(["serve", "--emit", "k8s", "--auth", "keys"]) == 0
    out, err = capsys.readouterr()
    assert "kind: Secret" not in out and "kubectl create secret generic dstool-serve-admin-key" in err
