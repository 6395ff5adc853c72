"""Sparsity, N:M and unstructured, and storage that holds only the nonzero weights. Both cover the same weights
(`covered_weights`: the nn.Linear weights inside the decoder layers and the routed experts' stacked matrices);
embeddings, lm_head, norms and the MoE router stay dense.

`apply_n_m_sparsity(model, n, m)` zeroes the m - n smallest-magnitude weights in every group of m along the input
dimension (2:4 by default) and returns the masks (recovery keeps the zeros: dstool train --keep-zero-weights);
`check_n_m_fits` refuses a pattern whose M does not divide every covered layer's input width.
`apply_unstructured(model, fraction)` zeroes the `fraction` smallest-magnitude entries of each covered matrix on its
own, and returns the masks.
Stored, a tensor that is at least 1/16 zeros becomes a bitmask of its nonzeros (one bit per entry, row-major, least
significant bit first) and its nonzero values (fp32, in the same order):

  Hugging Face folder  `save_folder` turns each *.safetensors file into *.sparse.safetensors (keys NAME.bitmask and
                       NAME.values, the shapes in the file's metadata); `load(folder)` gives the dense transformers
                       model back (`AutoModelForCausalLM.from_pretrained` alone refuses the folder: it finds no
                       model.safetensors, rather than loading something else).
  ONNX                 `encode_onnx` replaces each such initializer by the bitmask and the values plus a few
                       standard ops (BitShift, CumSum, Gather, Where) that rebuild it. Every input of those ops is a
                       constant, so ONNX Runtime's constant folding rebuilds the dense initializer when the session
                       is created: the session then runs the dense graph's MatMuls, no faster and no slower.

Own formats, because the libraries measured here do not do it: compressed-tensors' `sparse-bitmask` compressor
(what transformers once decompressed on load) is gone from compressed-tensors >= 0.15, the version transformers 5
requires; ONNX's sparse_initializer (COO, which ONNX Runtime densifies at load) needs an index per nonzero: 8 bytes
as int64, 4 as int32 linear indices (int16 cannot address a matrix of over 32,767 entries), against one bit per
entry here. At 65 % zeros a weight takes 0.38x its dense bytes this way, 0.70x as COO with int32 linear indices
and 1.05x with int64 ones (measured: docs/compress.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, GenerationConfig

FORMAT = "bitmask-values"
SUFFIX = ".sparse.safetensors"
MIN_ZERO_SHARE = 1 / 16  # the least share of zeros stored as bitmask + values (docs/compress.md: why)


def apply_n_m_sparsity(model, n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Zero the m - n smallest-magnitude weights in every group of m along the input dimension.

    Covers the weights `covered_weights` names (decoder Linear layers and routed experts; not embeddings, lm_head or
    the MoE router) and returns {parameter name: bool mask}. Raises ValueError, before changing anything, if a
    covered weight's input width is not a multiple of m.
    """
    if not 0 < n < m:
        raise ValueError(f"N:M sparsity needs 0 < n < m, got n={n}, m={m}")
    check_n_m_fits(model, n, m)
    masks = {}
    with torch.no_grad():
        for name, weight in covered_weights(model).items():
            groups = weight.abs().unflatten(-1, (-1, m))
            keep = groups.topk(n, dim=-1).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).view_as(weight)
            weight.mul_(mask)
            masks[name] = mask
    return masks


def covered_weights(model) -> dict[str, nn.Parameter]:
    """{parameter name: weight} of what N:M sparsity covers, the input dimension last: every nn.Linear weight inside
    the decoder layers (model.model.layers) and the routed experts' stacked [experts, out, in] weights."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} is not a Llama-style or DeepSeek-V2/V3 causal LM (no "
                         "model.model.layers), so N:M sparsity does not apply to it: --bits 8 or 4 does")
    inside = set()
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            inside.add(id(module.weight))
        elif not getattr(module, "is_transposed", False):  # transformers' experts: [experts, out, in]
            inside |= {id(p) for p in module.parameters(recurse=False) if p.dim() == 3}
    return {name: p for name, p in model.named_parameters() if id(p) in inside}


def check_n_m_fits(model, n: int, m: int) -> None:
    """Raise ValueError (one line: the first layer whose input width M does not divide, and a pattern that fits
    every layer) unless every weight `covered_weights` covers has an input width that is a multiple of m."""
    widths = {name: w.shape[-1] for name, w in covered_weights(model).items()}
    for name, width in widths.items():
        if width % m:
            common = math.gcd(*widths.values())
            fits = [f"{k // 2}:{k}" for k in (4, 8, 2) if common % k == 0][:1] or ["none (widths share no factor)"]
            raise ValueError(f"N:M sparsity {n}:{m}: {name} has input width {width}, not a multiple of M={m} "
                             f"(input widths here: {', '.join(map(str, sorted(set(widths.values()))))}); a pattern "
                             f"whose M divides them all works, e.g. {fits[0]}")


def check_n_m(model, masks: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> None:
    """Raise AssertionError naming the first masked layer with a group of m holding fewer than m - n zeros."""
    params = dict(model.named_parameters())
    for name in masks:
        weight = params[name]
        zeros = (weight == 0).unflatten(-1, (-1, m)).sum(dim=-1)
        bad = int((zeros < m - n).sum())
        if bad:
            raise AssertionError(f"{name}: {bad} of {zeros.numel()} groups of {m} have fewer than {m - n} zeros")


@torch.no_grad()
def apply_unstructured(model, fraction: float) -> dict[str, torch.Tensor]:
    """Zero the round(fraction x size) smallest-magnitude entries of each covered matrix (of every expert's, in a
    stacked [experts, out, in] weight), in place; returns {weight name: bool mask of the kept entries}."""
    masks = {}
    for name, w in covered_weights(model).items():
        rows = w.abs().reshape(-1, w.shape[-2] * w.shape[-1])  # one row per matrix
        drop = rows.topk(round(fraction * rows.shape[1]), dim=1, largest=False).indices
        mask = torch.ones_like(rows, dtype=torch.bool).scatter_(1, drop, False).view_as(w)
        w.mul_(mask)
        masks[name] = mask
    return masks


def drop_count(fraction: float, weight: torch.Tensor) -> int:
    """How many zeros `apply_unstructured` leaves in `weight`."""
    matrices = weight.numel() // (weight.shape[-2] * weight.shape[-1])
    return matrices * round(fraction * weight.shape[-2] * weight.shape[-1])


def zero_shares(model, masks: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(share of zeros in the masked weights, share of zeros in all parameters)."""
    params = dict(model.named_parameters())  # tied weights once
    masked = sum(int((params[n] == 0).sum()) for n in masks) / sum(params[n].numel() for n in masks)
    every = sum(int((p == 0).sum()) for p in params.values()) / sum(p.numel() for p in params.values())
    return masked, every


def masks_held(model, masks: dict[str, torch.Tensor]) -> str | None:
    """None when every masked-out entry is still exactly zero, else which weight is not."""
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        moved = int((params[name].detach()[~mask.to(params[name].device)] != 0).sum())
        if moved:
            return f"{name}: {moved} masked entries are no longer zero"
    return None


def _encodable(a: np.ndarray) -> bool:
    return (a.dtype == np.float32 and a.ndim >= 2 and a.size >= 1024 and (a == 0).mean() >= MIN_ZERO_SHARE
            and bool(a.any()))


def _pack(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    flat = a.reshape(-1)
    keep = flat != 0
    return np.packbits(keep, bitorder="little"), flat[keep]


def _unpack(bits: np.ndarray, values: np.ndarray, shape: list[int]) -> np.ndarray:
    keep = np.unpackbits(bits, count=int(np.prod(shape)), bitorder="little").astype(bool)
    dense = np.zeros(keep.size, np.float32)
    dense[keep] = values
    return dense.reshape(shape)


# ---- Hugging Face folder --------------------------------------------------------------------------------

def save_folder(folder: Path) -> dict[str, int]:
    """Rewrite a saved Hugging Face folder's weight files as *.sparse.safetensors; returns {encoded name: size}."""
    folder = Path(folder)
    encoded: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        if path.name.endswith(SUFFIX):
            continue
        tensors, shapes = {}, {}
        for name, t in load_file(path).items():
            a = t.numpy() if t.dtype == torch.float32 else None
            if a is not None and _encodable(a):
                bits, values = _pack(a)
                tensors[f"{name}.bitmask"], tensors[f"{name}.values"] = torch.from_numpy(bits), torch.from_numpy(values)
                shapes[name] = list(a.shape)
            else:
                tensors[name] = t
        target = folder / (path.name[:-len(".safetensors")] + SUFFIX)
        save_file(tensors, target, metadata={"format": "pt", "dstool_sparse": FORMAT, "shapes": json.dumps(shapes)})
        target.chmod(path.stat().st_mode)
        path.unlink()
        encoded.update({name: int(np.prod(shape)) for name, shape in shapes.items()})
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)  # names dense shards that are gone
    return encoded


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The dense state dict of a folder written by `save_folder`."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*" + SUFFIX)):
        with safe_open(str(path), "pt") as f:
            shapes = json.loads((f.metadata() or {}).get("shapes", "{}"))
        tensors = load_file(path)
        for name, shape in shapes.items():
            bits, values = tensors.pop(f"{name}.bitmask"), tensors.pop(f"{name}.values")
            state[name] = torch.from_numpy(_unpack(bits.numpy(), values.numpy(), shape))
        state.update(tensors)
    return state


def is_sparse_folder(folder: Path) -> bool:
    return any(Path(folder).glob("*" + SUFFIX))


def load(folder: str | Path, dtype: torch.dtype = torch.float32):
    """The causal LM of a Hugging Face folder, dense: a folder of *.sparse.safetensors (a `dstool compress
    --sparsity F` model/) is decoded and loaded by transformers; any other folder as `from_pretrained` loads it."""
    folder = Path(folder)
    if not is_sparse_folder(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(folder)
    model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=read_folder(folder), dtype=dtype, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise ValueError(f"{folder}: the sparse weights do not fit the config (missing {sorted(info['missing_keys'])},"
                         f" unexpected {sorted(info['unexpected_keys'])})")
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


# ---- ONNX -----------------------------------------------------------------------------------------------

def encode_onnx(path: Path) -> dict[str, int]:
    """Rewrite the graph at `path` (weights in its .data sidecar) with every fp32 initializer of at least 2
    dimensions that is at least MIN_ZERO_SHARE zeros stored as bitmask + values and rebuilt by constant ops; returns
    {encoded initializer: size}."""
    model = onnx.load(str(path))
    graph = model.graph
    inputs = {i.name for i in graph.input}
    kept, added, nodes, encoded = [], [], [], {}
    for init in graph.initializer:
        a = numpy_helper.to_array(init)
        if init.name in inputs or not _encodable(a):
            kept.append(init)
            continue
        bits, values = _pack(a)
        n = init.name
        added += [numpy_helper.from_array(bits, f"{n}.bitmask"), numpy_helper.from_array(values, f"{n}.values"),
                  numpy_helper.from_array(np.array([a.size], np.int64), f"{n}.numel"),
                  numpy_helper.from_array(np.array(a.shape, np.int64), f"{n}.shape")]
        nodes += _decode_nodes(n)
        encoded[n] = a.size
    if nodes:
        added += [numpy_helper.from_array(v, f"dstool_sparse.{k}") for k, v in _CONSTANTS.items()]
        del graph.initializer[:]
        graph.initializer.extend(kept + added)
        original = list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes + original)
        data = Path(str(path) + ".data")
        mode = (data if data.exists() else path).stat().st_mode
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                  size_threshold=1024)
        data.chmod(mode)  # onnx writes it owner-only; a server in another account must read it as before
    return encoded


_CONSTANTS = {"shifts": np.arange(8, dtype=np.uint8), "one_u8": np.array(1, np.uint8),
              "one_i32": np.array(1, np.int32), "axis0": np.array(0, np.int32), "zero_f32": np.array(0, np.float32),
              "start": np.array([0], np.int64), "flat": np.array([-1], np.int64), "axis1": np.array([1], np.int64)}


def _decode_nodes(n: str) -> list:
    """bits [B] -> mask [numel] (bit i of byte j is entry 8j + i); entry k = values[cumsum(mask)[k] - 1] where
    the mask is set, else 0; reshaped, under the initializer's own name."""
    c, p = "dstool_sparse.", f"{n}/dstool_sparse/"
    return [helper.make_node("Unsqueeze", [f"{n}.bitmask", c + "axis1"], [p + "bytes"]),
            helper.make_node("BitShift", [p + "bytes", c + "shifts"], [p + "shifted"], direction="RIGHT"),
            helper.make_node("BitwiseAnd", [p + "shifted", c + "one_u8"], [p + "bits"]),
            helper.make_node("Reshape", [p + "bits", c + "flat"], [p + "padded"]),
            helper.make_node("Slice", [p + "padded", c + "start", f"{n}.numel"], [p + "mask_u8"]),
            helper.make_node("Cast", [p + "mask_u8"], [p + "mask"], to=TensorProto.BOOL),
            helper.make_node("Cast", [p + "mask_u8"], [p + "mask_i32"], to=TensorProto.INT32),
            helper.make_node("CumSum", [p + "mask_i32", c + "axis0"], [p + "count"]),
            helper.make_node("Sub", [p + "count", c + "one_i32"], [p + "index"]),
            helper.make_node("Gather", [f"{n}.values", p + "index"], [p + "gathered"], axis=0),
            helper.make_node("Where", [p + "mask", p + "gathered", c + "zero_f32"], [p + "dense"]),
            helper.make_node("Reshape", [p + "dense", f"{n}.shape"], [n])]
