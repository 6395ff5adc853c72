"""dstool.compress: quantization, structured pruning and N:M sparsity, each with a measured report."""

from dstool.compress.api import CompressConfig, compress


def quantize_dynamic(model_dir: str, output: str, bits: int = 8, **options) -> dict:
    """Quantize a Hugging Face causal LM for ONNX Runtime (8: dynamic int8, 4: weight-only); returns the report."""
    return compress(CompressConfig(model=model_dir, output=output, bits=bits, **options))


__all__ = ["CompressConfig", "compress", "quantize_dynamic"]
