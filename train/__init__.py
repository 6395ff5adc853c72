"""dstool.train: DeepSpeed training from one process to many nodes.

    from dstool.train import TrainConfig, train
    result = train(TrainConfig(nproc=2, max_steps=100))

`TrainConfig` loads no torch; `train` and the rest load it when first used.
"""

from dstool.train.config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "read_metrics", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        from dstool.train import api

        return getattr(api, name)
    if name == "read_metrics":
        from dstool.train.metrics import read_metrics

        return read_metrics
    raise AttributeError(f"module 'dstool.train' has no attribute '{name}'")
