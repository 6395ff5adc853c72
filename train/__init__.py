"""dstool.train: DeepSpeed training from one process to many nodes.

    from dstool.train import TrainConfig, train
    result = train(TrainConfig(nproc=2, max_steps=100))

`TrainConfig` loads no torch; `train` and the rest load it when first used.
"""

from dstool.train.config import TrainConfig
from dstool.train.metrics import read_metrics

__all__ = ["TrainConfig", "TrainResult", "read_metrics", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        from dstool.train import api  # noqa: PLC0415 (torch: loaded on first use, `TrainConfig` alone loads none)

        return getattr(api, name)
    raise AttributeError(f"module 'dstool.train' has no attribute '{name}'")
