"""LoRA adapters served on one base: each row of a batch decodes with its own adapter (or none) in the same graph run.

The fused decoder graph exported with LoRA inputs (`dstool.fused_decoder`, `lora=True`) adds, at each of the seven
linear layers of every decoder layer (q, k, v, o, gate, up, down), each row's own x @ A @ B, two batched matmuls:

    lora.layers.I.M.A [batch, in, rank], lora.layers.I.M.B [batch, rank, out]

so each row computes its own adapter only (Punica/S-LoRA's batched LoRA). `RowWeights` lays out each row's A and B
(its scaling folded into B; zeros for a row of the base; smaller ranks padded with zeros, which add nothing), kept
for the running batch between decoding steps. docs/export-serve.md has the measurements that chose this over masked
dense matmuls across every adapter in use, and over gathering each row's weights from stacked slots inside the graph.

`Adapter.load` reads a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) and refuses, naming the
reason, what the graph cannot apply exactly: other modules than those seven, shapes of another base, DoRA, biases,
modules saved whole, per-module rank or alpha patterns, a rank above the server's limit.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import AdapterError

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight")
_FILES = ("adapter_config.json", "adapter_model.safetensors")


def graph_layout(inputs) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (in, out) features, read from a LoRA graph's inputs (onnxruntime's `get_inputs()`);
    empty for a graph without LoRA inputs."""
    dims: dict[tuple[int, str], list[int]] = {}
    for i in inputs:
        m = re.fullmatch(r"lora\.layers\.(\d+)\.(\w+)\.([AB])", i.name)
        if m:
            at = dims.setdefault((int(m[1]), m[2]), [0, 0])
            at[0 if m[3] == "A" else 1] = i.shape[1 if m[3] == "A" else 2]
    return {k: (v[0], v[1]) for k, v in dims.items()}


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter: per (layer, module) its A [in, rank] and its B [rank, out] scaled by alpha / rank."""

    name: str
    sha256: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    path: str
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "rank": self.rank, "alpha": self.alpha,
                "targets": list(self.targets), "path": self.path}

    @classmethod
    def load(cls, name: str, folder: Path, layout: dict[tuple[int, str], tuple[int, int]],
             max_rank: int) -> Adapter:
        """The PEFT LoRA adapter in `folder`, checked against the graph's `layout` (`graph_layout`)."""
        rank, alpha, scale = read_config(name, folder, max_rank)
        digest = hashlib.sha256()
        for f in _FILES:
            digest.update((folder / f).read_bytes())
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(folder / _FILES[1]))
        except (SafetensorError, OSError, ValueError) as e:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors cannot be read ({e})") from None
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for key, value in tensors.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise AdapterError(f"adapter {name!r} holds {key!r}: the served graph applies LoRA to the decoder "
                                   "layers' q, k, v, o, gate, up and down projections only")
            halves.setdefault((int(m[1]), m[2]), {})[m[3]] = value
        if not halves:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
        weights = {}
        for (layer, module), pair in sorted(halves.items()):
            where = f"adapter {name!r}: layers.{layer}.{module}_proj"
            if (layer, module) not in layout:
                raise AdapterError(f"{where} is not in the served model (another base?): "
                                   f"it has {1 + max(k[0] for k in layout)} layers")
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"{where} has lora_{'AB'.replace(''.join(pair), '')} missing")
            a, b = pair["A"], pair["B"]
            fan_in, fan_out = layout[(layer, module)]
            if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
                raise AdapterError(f"{where} is lora_A {list(a.shape)}, lora_B {list(b.shape)}; the served model "
                                   f"takes [{rank}, {fan_in}] and [{fan_out}, {rank}] at rank {rank} (an adapter of "
                                   "another base model?)")
            weights[(layer, module)] = (np.ascontiguousarray(a.T, np.float32),
                                        np.ascontiguousarray(b.T * scale, np.float32))
        targets = tuple(m for m in MODULES if any(k[1] == m for k in weights))
        return cls(name, digest.hexdigest(), rank, alpha, targets, str(folder), weights)


def read_config(name: str, folder: Path, max_rank: int) -> tuple[int, float, float]:
    """(rank, alpha, scale) of the PEFT LoRA adapter `name` in `folder`, its files there and its config one the
    graph applies exactly (AdapterError naming the reason otherwise); the weights are not read."""
    if not NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name[:80]!r}: use 1-64 letters, digits, '.', '_' or '-', beginning with a "
                           "letter or digit")
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder: give a PEFT LoRA adapter's folder "
                           "(adapter_config.json, adapter_model.safetensors)")
    missing = [f for f in _FILES if not (folder / f).is_file()]
    if missing:
        pickle = " (adapter_model.bin is a pickle: save it with safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"adapter {name!r}: {folder} has no {missing[0]}{pickle}: give a PEFT LoRA adapter's "
                           "folder")
    try:
        config = json.loads((folder / _FILES[0]).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not JSON ({e})") from None
    return _check_config(name, config, max_rank)


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float, float]:
    """(rank, alpha, scale) of a PEFT LoRA config the graph applies exactly; refused naming the field otherwise."""
    what = f"adapter {name!r}: adapter_config.json"
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{what} is not a LoRA adapter's (peft_type "
                           f"{config.get('peft_type') if isinstance(config, dict) else None!r}): give a LoRA adapter")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise AdapterError(f"{what}: r is {rank!r}; this server takes ranks 1..{max_rank} (export --max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise AdapterError(f"{what}: lora_alpha is {alpha!r}; a positive number")
    refused = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
               "modules_to_save": "modules saved whole"}
    for key, words in refused.items():
        if config.get(key):
            raise AdapterError(f"{what} uses {words} ({key}), which the served graph cannot apply: merge this "
                               "adapter into the model and export that instead")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{what}: bias {config['bias']!r} trains biases, which the served graph cannot apply: "
                           "merge this adapter into the model and export that instead")
    scale = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    return rank, float(alpha), float(scale)


class RowWeights:
    """The graph's LoRA inputs: for each row of a run, its own adapter's A and B (zeros for a row of the base), ranks
    padded with zeros to the highest among the rows (a run of base rows only: rank 0, so nothing is computed).

    The running batch's are kept between decoding steps (`batch`): a row is written again only when the adapter at
    that row changes (a sequence joining or leaving), so a decoding step copies no weights. A prefill run's are made
    for it (`rows`)."""

    def __init__(self, layout: dict[tuple[int, str], tuple[int, int]]):
        self.layout = layout
        self.kept: dict[str, np.ndarray] = self._empty(0, 0)
        self.at: list[Adapter | None] = []  # the adapter whose weights each kept row holds

    def _empty(self, rows: int, rank: int) -> dict[str, np.ndarray]:
        out = {}
        for (layer, m), (fan_in, fan_out) in self.layout.items():
            out[f"lora.layers.{layer}.{m}.A"] = np.zeros((rows, fan_in, rank), np.float32)
            out[f"lora.layers.{layer}.{m}.B"] = np.zeros((rows, rank, fan_out), np.float32)
        return out

    def _write(self, weights: dict[str, np.ndarray], row: int, adapter: Adapter | None) -> None:
        for (layer, m) in self.layout:
            a_rows, b_rows = weights[f"lora.layers.{layer}.{m}.A"], weights[f"lora.layers.{layer}.{m}.B"]
            a_rows[row], b_rows[row] = 0.0, 0.0
            pair = adapter.weights.get((layer, m)) if adapter is not None else None
            if adapter is not None and pair is not None:
                a_rows[row, :, :adapter.rank], b_rows[row, :adapter.rank] = pair

    @staticmethod
    def _rank(adapters: list[Adapter | None]) -> int:
        return max((a.rank for a in adapters if a is not None), default=0)

    def rows(self, adapters: list[Adapter | None]) -> dict[str, np.ndarray]:
        """The inputs for a run over rows of these adapters (made for it)."""
        weights = self._empty(len(adapters), self._rank(adapters))
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                self._write(weights, row, adapter)
        return weights

    def batch(self, adapters: list[Adapter | None], capacity: int) -> dict[str, np.ndarray]:
        """The inputs for the running batch, whose rows hold these adapters (views of buffers of `capacity` rows kept
        between calls; rows whose adapter did not change are not written)."""
        rank, held = self._rank(adapters), next(iter(self.kept.values()))
        if rank != held.shape[2] or held.shape[0] < capacity:
            self.kept, self.at = self._empty(capacity, rank), [None] * capacity
        for row, adapter in enumerate(adapters):
            if self.at[row] is not adapter:
                self._write(self.kept, row, adapter)
                self.at[row] = adapter
        return {name: v[:len(adapters)] for name, v in self.kept.items()}
