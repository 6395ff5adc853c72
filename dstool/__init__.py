"""dstool: DeepSpeed training -> compression -> Triton serving behind a Redis cache."""

__version__ = "0.1.0"
