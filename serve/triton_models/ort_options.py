"""ONNX Runtime session options for the models dstool runs inside Triton, from the model process's environment:
DSTOOL_ORT_THREADS (intra-op threads; 0 = one per core) and DSTOOL_ORT_SPIN (1: idle threads spin between runs,
the default; 0: they sleep, leaving the cores to Triton and the gateway — the trade is measured in
docs/export-serve.md)."""

from __future__ import annotations

import os


def session_options(ort):
    threads, spin = os.environ.get("DSTOOL_ORT_THREADS", "0"), os.environ.get("DSTOOL_ORT_SPIN", "1")
    if not threads.isdigit():
        raise ValueError(f"DSTOOL_ORT_THREADS must be a whole number of threads (0: one per core), got {threads!r}")
    if spin not in ("0", "1"):
        raise ValueError(f"DSTOOL_ORT_SPIN must be 0 (idle threads sleep) or 1 (they spin), got {spin!r}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(threads)
    opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
    return opts
