"""dstool.train: DeepSpeed training from one process to many nodes."""

from dstool.config import TrainConfig
from dstool.train.api import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
