"""dstool: DeepSpeed training -> compression -> Triton serving behind a Redis cache.

The core (this package) holds what the stages share: typed artefacts (`artifacts`), one config style (`config`),
one logging setup (`log`), steps as objects (`steps`), process helpers (`proc`), the ONNX exporter. The stages
`dstool.train`, `dstool.compress` and `dstool.serve` are siblings over it; the roof, `dstool.cli` (the command line and
`dstool pipeline`), stands on them all.
"""

__version__ = "0.1.0"
