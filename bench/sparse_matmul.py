"""Is there a kernel here that runs unstructured-sparse weights faster than dense? PyTorch's CSR matmul
(torch.sparse, CPU) against the dense matmul, on every masked weight of a model.

    .venv/bin/python bench/sparse_matmul.py --model OUT/model [--sparsity 0.65] [--repeats 30]

OUT/model is a `dstool compress --sparsity F` output's model/ (read with dstool.compress.load), or any Hugging Face
folder, masked here with `--sparsity`. For 1 token (a decoding step) and 8 x 128 tokens (a prefill batch), each
weight's y = x W^T is timed dense and as CSR in alternating blocks of calls (see median_us), medians summed over
the weights; the outputs are checked equal first. The ONNX graphs run the dense weights ONNX Runtime rebuilds at
session load (its contrib op SparseToDenseMatMul takes a sparse tensor fed at run time; not tried).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def median_us(fns: dict, repeats: int, block: int = 5) -> dict[str, float]:
    """Median per-call time of each function: rounds of `block` calls of one, then of the other (the order swapped
    every round). Blocks, not single calls in alternation: a dense and a sparse call in turn measured each one
    waiting for the other's spinning thread pool (the 1-token CSR call 100x slower than on its own)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 1):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for _ in range(block):
                fns[name]()
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - t0) / block)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--sparsity", type=float, default=0.65, help="for a dense folder: the fraction masked here")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    from dstool.compress import load, sparse

    model = load(a.model)
    if not sparse.is_sparse_folder(a.model):
        sparse.apply_unstructured(model, a.sparsity)
    weights = {n: w.detach() for n, w in model.named_parameters() if w.dim() == 2 and ".layers." in n}
    zeros = sum(int((w == 0).sum()) for w in weights.values()) / sum(w.numel() for w in weights.values())
    print(f"{len(weights)} decoder weights, {zeros:.1%} zeros; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
    for tokens in (1, 8 * 128):
        total = {"dense": 0.0, "csr": 0.0}
        with torch.no_grad():
            for w in weights.values():
                x, csr = torch.randn(tokens, w.shape[1]), w.to_sparse_csr()
                xt = x.T.contiguous()
                # one token: CSR matrix x vector (torch.mv, the fastest of mv / sparse.mm / @ measured here)
                sparse_fn = ((lambda csr=csr, v=x[0]: torch.mv(csr, v)[None]) if tokens == 1 else
                             (lambda csr=csr, xt=xt: torch.sparse.mm(csr, xt).T))
                fns = {"dense": lambda x=x, w=w: x @ w.T, "csr": sparse_fn}
                assert torch.allclose(fns["dense"](), fns["csr"](), atol=1e-4)
                for k, v in median_us(fns, a.repeats).items():
                    total[k] += v
        print(f"{tokens:5d} tokens: dense {total['dense'] / 1e3:.2f} ms, CSR {total['csr'] / 1e3:.2f} ms over all "
              f"weights: CSR is {total['dense'] / total['csr']:.2f}x as fast as dense")


if __name__ == "__main__":
    main()
