"""dstool.compress: quantization, structured pruning and N:M sparsity, each with a measured report."""

from dstool.compress.config import CompressConfig


def compress(cfg: CompressConfig, echo=print) -> dict:
    """Run the compression pipeline (see dstool.compress.api); returns the report."""
    from dstool.compress.api import compress as run  # torch, onnx: loaded when compressing, not for the CLI's checks

    return run(cfg, echo)


def quantize_dynamic(model_dir: str, output: str, bits: int = 8, **options) -> dict:
    """Quantize a Hugging Face causal LM for ONNX Runtime (8: dynamic int8, 4: weight-only); returns the report."""
    return compress(CompressConfig(model=model_dir, output=output, bits=bits, **options))


__all__ = ["CompressConfig", "compress", "quantize_dynamic"]
