"""dstool: DeepSpeed training -> compression -> Triton serving behind a Redis cache."""

import logging as _logging

__version__ = "0.1.0"

# transformers/accelerate import torchao when it is installed; its optional CUDA kernels fail to load on
# CPU-only machines and torch logs a deprecation per torchao enum. Neither concerns dstool's users.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
