"""`dstool train --emit k8s`: the same run as a Kubeflow PyTorchJob (training-operator, kubeflow.org/v1).

One pod per node (Master + Workers); the operator sets MASTER_ADDR, MASTER_PORT and RANK (the node
rank) in every pod, and each pod runs `dstool train` on its GPUs with the run's config. Checkpoints
and outputs go to a shared PersistentVolumeClaim mounted at /checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

from dstool.train.config import TrainConfig

MOUNT = "/checkpoints"
NCCL_DEFAULTS = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def job_name(output: str) -> str:
    """A DNS-1123 name from the run folder's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", Path(output).name.lower()).strip("-")
    return ("dstool-" + name)[:63].rstrip("-")


def pytorchjob(cfg: TrainConfig, nodes: int, gpus_per_node: int, image: str, pvc: str) -> dict:
    """The PyTorchJob manifest (a dict ready for YAML) that runs `cfg` on `nodes` pods."""
    name = job_name(cfg.output)
    run_cfg = cfg.model_copy(update={"output": f"{MOUNT}/{Path(cfg.output).name}", "hostfile": None,
                                     "num_nodes": nodes, "nproc": gpus_per_node, "node_rank": None,
                                     "launcher": "torchrun", "master_port": None, "env": {}})
    env = {**NCCL_DEFAULTS, **cfg.env}
    script = ('printf "%s" "$DSTOOL_CONFIG" > /tmp/dstool.yaml && exec dstool train --config /tmp/dstool.yaml '
              '--node-rank "$RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"')
    container = {
        "name": "pytorch",  # the training-operator looks for this container name
        "image": image,
        "command": ["bash", "-c", script],
        "env": [{"name": "DSTOOL_CONFIG", "value": json.dumps(run_cfg.model_dump())}]  # JSON is YAML
               + [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
        "volumeMounts": [{"name": "checkpoints", "mountPath": MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    # the grace period dstool gives the ranks to checkpoint on SIGTERM, and time for the launcher to exit after it
    pod = {"spec": {"terminationGracePeriodSeconds": math.ceil(cfg.preempt_grace_s) + 30,
                    "containers": [container], "volumes": [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL needs more shared memory than the default
    ]}}
    # ExitCode: 128-255 (a preempted run's 143, a kill) restart the pod, 1-127 (a bug, a diverged loss) do not
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": pod}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "ExitCode", "template": copy.deepcopy(pod)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/created-by": "dstool"}},
        # A preempted or killed pod is restarted (ExitCode) and `dstool train --resume auto` continues from the last
        # valid checkpoint on the shared volume; backoffLimit bounds the restarts.
        "spec": {"runPolicy": {"backoffLimit": max(cfg.max_restarts, 3), "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    }
