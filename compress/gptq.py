"""GPTQ (Frantar et al. 2022) for 4-bit weight-only quantization, its result in ONNX Runtime's MatMulNBits layout.

Round-to-nearest (ORT's own quantizer) rounds every weight on its own. GPTQ quantizes a Linear weight W [out, in]
one input column at a time and spreads each column's rounding error over the columns not yet quantized, weighted by
the inverse of the layer's input Hessian H = 2 X Xᵀ (X: the layer's inputs on calibration tokens), so that the
layer's output W X, not W itself, stays close. Here:

- the decoder layers are processed in order on calibration windows (never the held-out text), each layer's inputs
  computed by the layers before it already quantized; within a layer its Linear weights in the order they compute
  (q/k/v, o, gate/up, down), each group's inputs through the quantized groups before it;
- columns in order (or, `act_order`, by decreasing Hessian diagonal with the groups' grids fixed up front), errors
  propagated lazily in batches of 128 columns, H dampened by 1 % of its mean diagonal;
- the grid is MatMulNBits' asymmetric one, computed as ORT's MLAS computes it (`BlockwiseQuantizer`): per block of
  `block` input columns of one output row, the range [min(w, 0), max(w, 0)], scale = range / 15, zero point
  round(-min / scale), code = clamp(round(w / scale + zero point), 0, 15); GPTQ computes a block's grid when the
  block's first column is reached, from its weights as earlier errors left them. With no error propagation this is
  ORT's round-to-nearest, byte for byte (tests/test_gptq.py).

`quantize_model` returns {sha256 of the ONNX MatMul weight: its codes}: the exported graphs hold each Linear weight
transposed ([in, out]), so a graph's MatMul is matched by its weight's bytes (and the fused decoder's packed Q/K/V
weight by the three concatenated); compress/quantize.py feeds them to ORT's quantizer.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch  # noqa: TID253 (compress's engine: GPTQ runs on the PyTorch model)

from dstool import log as dlog

MAXQ = 15  # 4-bit codes 0..15
DAMP = 0.01  # of the Hessian's mean diagonal, added to its diagonal
LAZY_COLUMNS = 128  # columns quantized before their errors reach the rest of the weight (one matrix product)
# Calibration: windows x tokens of the compress run's calibration split. 64 x 256 = 16,384 tokens: SmolLM2-135M in
# about 4 minutes on 2 cores (docs/real-model.md)
WINDOWS, SEQ_LEN, BATCH = 64, 256, 8
# The Linear weights of a Llama-style decoder layer, in the order they compute: each group's inputs are computed
# through the groups before it, already quantized. Any other Linear of a layer goes in a last group.
SEQUENTIAL = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
FUSED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # packed into one MatMul by the fused decoder

log = dlog.log


@dataclass
class BlockCodes:
    """A weight [N out, K in] quantized to 4 bits per block of `block` input channels of one output row: codes
    [N, K padded to whole blocks with 0, as ORT leaves them], scales and zero points [N, blocks]."""

    codes: np.ndarray  # uint8
    scales: np.ndarray  # float32
    zero_points: np.ndarray  # uint8
    block: int
    k: int  # input channels before padding

    def matmulnbits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MatMulNBits' inputs B [N, blocks, block / 2] (two codes a byte, the first in the low nibble), scales
        [N, blocks], zero points [N, ceil(blocks / 2)] (two a byte, likewise; an odd count's last high nibble 8,
        as ORT writes it)."""
        n, blocks = self.scales.shape
        pairs = self.codes.reshape(n, blocks, self.block // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
        zp = self.zero_points
        if blocks % 2:
            zp = np.concatenate([zp, np.full((n, 1), 8, np.uint8)], axis=1)
        zp = zp.reshape(n, -1, 2)
        return packed, self.scales.astype(np.float32), (zp[..., 0] | (zp[..., 1] << 4)).astype(np.uint8)

    def dequantized(self) -> np.ndarray:
        """The weight the codes stand for, [N, K] float32: (code - zero point) x scale."""
        n, blocks = self.scales.shape
        codes = self.codes.reshape(n, blocks, self.block).astype(np.float32)
        w = (codes - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        return w.reshape(n, -1)[:, :self.k]

    @staticmethod
    def stacked(parts: list[BlockCodes]) -> BlockCodes:
        """Weights stacked along the output rows (the fused decoder's Q, K and V in one MatMul): their codes."""
        return BlockCodes(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                          np.concatenate([p.zero_points for p in parts]), parts[0].block, parts[0].k)


def onnx_digest(weight: np.ndarray) -> str:
    """sha256 of a weight [N out, K in] as an exported graph's MatMul holds it: transposed, float32."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(weight, dtype=np.float32).T).tobytes()).hexdigest()


def grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLAS's asymmetric 4-bit grid of each row of `w` [N, columns of one block]: (scale, zero point) float32."""
    lo = torch.clamp(w.min(dim=1).values, max=0.0)
    hi = torch.clamp(w.max(dim=1).values, min=0.0)
    scale = (hi - lo) / MAXQ
    zp_fp = torch.where(scale != 0, -lo / torch.where(scale != 0, scale, 1.0), lo)
    zero = torch.clamp(torch.floor(zp_fp.double() + 0.5), 0, MAXQ).float()  # roundf: half away from zero, zp_fp >= 0
    return scale, zero


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """MLAS's code of each entry of `w` [N] (or [N, columns]) on its row's grid [N] (or [N, 1]): clamp(roundf(w x
    (1 / scale) + zero), 0, 15), in float32 as MLAS computes it; returned as float32 codes."""
    reciprocal = torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, 1.0), 0.0)
    x = w * reciprocal + zero  # two float32 roundings (mul, add), as MLAS
    # roundf is half away from zero; below zero everything clamps to 0, so floor(x + 0.5) in float64 matches it
    return torch.clamp(torch.floor(x.double() + 0.5), 0, MAXQ).float()


def _codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block: int, k: int) -> BlockCodes:
    n, blocks = scales.shape
    padded = torch.empty(n, blocks * block)
    padded[:, :k] = q
    padded[:, k:] = 0  # ORT leaves the codes past K at 0 (MatMulNBits never reads them)
    return BlockCodes(padded.to(torch.uint8).numpy(), scales.float().numpy(), zeros.to(torch.uint8).numpy(), block, k)


def rtn(weight: torch.Tensor, block: int) -> BlockCodes:
    """Round-to-nearest on MLAS's grid: ORT's MatMulNBits quantizer's codes of `weight` [N, K]."""
    w = weight.detach().float()
    n, k = w.shape
    blocks = math.ceil(k / block)
    scales, zeros, q = torch.zeros(n, blocks), torch.zeros(n, blocks), torch.zeros(n, k)
    for b in range(blocks):
        part = w[:, b * block:(b + 1) * block]
        scales[:, b], zeros[:, b] = grid(part)
        q[:, b * block:(b + 1) * block] = quantize_column(part, scales[:, b, None], zeros[:, b, None])
    return _codes(q, scales, zeros, block, k)


def gptq(weight: torch.Tensor, hessian: torch.Tensor, block: int, act_order: bool = False,
         damp: float = DAMP) -> BlockCodes:
    """GPTQ of `weight` [N, K] given its inputs' Hessian [K, K] (any positive multiple of X Xᵀ): codes on MLAS's
    grid, a grid per `block` input columns of each row."""
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    n, k = w.shape
    blocks = math.ceil(k / block)
    dead = torch.diag(h) == 0  # inputs never active on the calibration tokens: H invertible all the same
    h[dead, dead] = 1.0
    scales, zeros = torch.zeros(n, blocks), torch.zeros(n, blocks)
    if act_order:  # columns in any order: each block's grid fixed up front, from its weights as given
        for b in range(blocks):
            scales[:, b], zeros[:, b] = grid(w[:, b * block:(b + 1) * block])
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    # the upper Cholesky factor of H^-1: row i holds how column i's error moves the columns after it
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(n, k)
    lazy = max(LAZY_COLUMNS // block, 1) * block  # whole blocks: a block's columns are all in one lazy batch
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        errors = torch.zeros(n, i2 - i1)
        for i in range(i2 - i1):
            column = int(perm[i1 + i])
            b = column // block
            if not act_order and column % block == 0:  # a block starts: its grid from its weights as they are now
                scales[:, b], zeros[:, b] = grid(w1[:, i:i + block])
            codes = quantize_column(w1[:, i], scales[:, b], zeros[:, b])
            q[:, column] = codes
            err = (w1[:, i] - (codes - zeros[:, b]) * scales[:, b]) / u1[i, i]
            w1[:, i:] -= err[:, None] * u1[i, i:][None, :]
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    return _codes(q, scales, zeros, block, k)


def _linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def _order(names: list[str]) -> list[list[str]]:
    """The layer's Linear weights in groups, in the order they compute (SEQUENTIAL), the rest last."""
    groups = [[n for n in group if n in names] for group in SEQUENTIAL]
    rest = [n for n in names if not any(n in g for g in SEQUENTIAL)]
    return [g for g in groups + [rest] if g]


class _Stop(Exception):
    pass


@torch.no_grad()
def _first_layer_inputs(model, windows: torch.Tensor) -> list[tuple[tuple, dict]]:
    """The first decoder layer's (args, kwargs) on each batch of calibration windows (embeddings, rotary, mask)."""
    captured = []

    def stop(_module, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        for i in range(0, len(windows), BATCH):
            try:
                model(input_ids=windows[i:i + BATCH], use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


def _run(layer, inputs: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    outputs = []
    for args, kwargs in inputs:
        out = layer(*args, **kwargs)
        outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


@torch.no_grad()
def _hessians(layer, modules: dict[str, torch.nn.Linear], inputs: list[tuple[tuple, dict]],
              sink_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Σ x xᵀ over every calibration token's input of each of `modules` (float64 sums of float32 batch products), the
    first position of each window (the attention sink every later token attends to) weighted `sink_weight`."""
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in modules.items()}

    def hook(name):
        def add(_module, args, _output):
            x = args[0].float()
            if sink_weight != 1.0 and x.dim() == 3:
                x = x.clone()
                x[:, 0] *= math.sqrt(sink_weight)
            x = x.reshape(-1, x.shape[-1])
            sums[name] += (x.T @ x).double()
        return add

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        _run(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return sums


@torch.no_grad()
def quantize_model(model, calibration: np.ndarray, block: int, act_order: bool = False, windows: int = WINDOWS,
                   seq_len: int = SEQ_LEN, sink_weight: float = 1.0, sequential: bool = True
                   ) -> dict[str, BlockCodes]:
    """GPTQ of every Linear weight of `model`'s decoder layers on `windows` x `seq_len` tokens of `calibration`
    (the calibration split, never the held-out one). Returns {onnx_digest of the weight: its codes}, with the fused
    decoder's packed Q/K/V weights too. `model` is left as it was (each layer's quantized weights are swapped in
    only to compute the next layer's inputs)."""
    n = min(len(calibration) // seq_len, windows)
    if n == 0:
        raise ValueError(f"GPTQ needs at least {seq_len} calibration tokens, got {len(calibration)}")
    rows = torch.from_numpy(np.asarray(calibration[:n * seq_len], dtype=np.int64).reshape(n, seq_len))
    started = time.perf_counter()
    inputs = _first_layer_inputs(model, rows)
    table: dict[str, BlockCodes] = {}
    for index, layer in enumerate(model.model.layers):
        linears = _linears(layer)
        original = {name: m.weight.data for name, m in linears.items()}
        codes: dict[str, BlockCodes] = {}
        try:
            for group in _order(list(linears)) if sequential else [list(linears)]:
                modules = {name: linears[name] for name in group}
                for name, h in _hessians(layer, modules, inputs, sink_weight).items():
                    codes[name] = gptq(original[name], h, block, act_order)
                    linears[name].weight.data = torch.from_numpy(codes[name].dequantized()).to(original[name].dtype)
            outputs = _run(layer, inputs)
        finally:
            for name, m in linears.items():
                m.weight.data = original[name]
        inputs = [((out, *args[1:]), kwargs) for out, (args, kwargs) in zip(outputs, inputs)]
        for name, c in codes.items():
            table[onnx_digest(original[name].numpy())] = c
        if all(name in codes for name in FUSED):
            packed = torch.cat([original[name] for name in FUSED]).numpy()
            table[onnx_digest(packed)] = BlockCodes.stacked([codes[name] for name in FUSED])
        log.debug(f"GPTQ layer {index}: {len(codes)} weights")
    log.info(f"GPTQ: {len(table)} weights of {len(model.model.layers)} decoder layers on {n} x {seq_len} calibration "
             f"tokens, {time.perf_counter() - started:.0f} s")
    return table
