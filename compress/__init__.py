"""dstool.compress: quantization, structured pruning, N:M and unstructured sparsity, each with a measured report.

    from dstool.compress import CompressConfig, compress, load
    manifest = compress(CompressConfig(model="runs/train/model", output="runs/int8", bits=8))
    model = load("runs/sparse/model")  # a Hugging Face folder, also one stored sparse (--sparsity 0.65)
"""

from dstool.compress.config import CompressConfig


def compress(cfg: CompressConfig):
    """Run the compression steps (dstool.compress.steps); returns the output's manifest (CompressedModel)."""
    from dstool.compress.api import compress as run  # noqa: PLC0415 (torch, onnx: loaded when compressing, not for the CLI's checks)

    return run(cfg)


def quantize_model(model_dir: str, output: str, bits: int = 8, **options):
    """Quantize a Hugging Face causal LM for ONNX Runtime (8: int8, weight-only unless int8="dynamic"; 4: weight-only
    4-bit); returns the manifest."""
    return compress(CompressConfig(model=model_dir, output=output, bits=bits, **options))


def load(folder, **options):
    """The transformers causal LM of a Hugging Face folder, dense; a `--sparsity F` output's model/ (bitmask +
    nonzero values) is decoded (see dstool.compress.sparse)."""
    from dstool.compress.sparse import load as load_sparse  # noqa: PLC0415 (torch: loaded with a model, not for the CLI's checks)

    return load_sparse(folder, **options)


__all__ = ["CompressConfig", "compress", "load", "quantize_model"]
