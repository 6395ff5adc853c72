"""The one ONNX exporter of dstool (used by `compress` and `export`): transformers' own exporter,
dynamic shapes, weights in a `model.onnx.data` sidecar (no 2 GB protobuf limit), and a parity gate
against PyTorch on shapes other than the ones traced.

Two graphs:
  logits model    input_ids, attention_mask [batch, seq] -> logits [batch, seq, vocab]
  decoder model   the same plus position_ids and the key/value cache of the tokens before
                  (`past_key_values.layers.I.{keys,values}` [batch, kv_heads, past, head_dim]) -> logits
                  and the grown cache (`cache.layers.I.{keys,values}`). With an empty cache (past = 0)
                  it is the prefill, with one new token a decoding step: no prefix is recomputed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import torch

from dstool import log as dlog
from dstool.errors import StageFailed
from dstool.files import replace_folder


class ParityError(StageFailed):
    """ONNX Runtime's logits disagree with PyTorch's beyond the tolerance."""


RELATIVE = 1e-4  # of the largest |logit|: fp32 kernels' rounding grows with the logits' scale (docs/export-serve.md)


class Parity(NamedTuple):
    """max |logit diff| between ONNX Runtime and PyTorch, and the largest |logit| PyTorch gave."""

    diff: float
    scale: float

    def check(self, tolerance: float, what: str) -> None:
        """Pass when diff <= tolerance + RELATIVE x scale (numpy's allclose rule on the worst logit)."""
        allowed = tolerance + RELATIVE * self.scale
        if not self.diff <= allowed:
            raise ParityError(f"{what} disagrees with PyTorch: max |logit diff| {self.diff:.3g} > {allowed:.3g} "
                              f"({tolerance:g} + {RELATIVE:g} x the largest |logit| {self.scale:.3g})")


@dataclass
class OnnxExport:
    path: Path
    max_abs_diff: float
    inputs: list[str]
    outputs: list[str]


def _export(model, sample: dict, dynamic_shapes: dict | None, out_dir: Path, check, tolerance: float) -> OnnxExport:
    """Run transformers' OnnxExporter into OUT.tmp, gate with `check(path) -> max diff`, rename to `out_dir`."""
    from transformers.exporters.configs import OnnxConfig  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)
    from transformers.exporters.exporter_onnx import OnnxExporter  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dlog.adopt_libraries()  # torch.onnx's registration warnings and the exporter's notes: to the log file
    config = OnnxConfig(dynamic=True, dynamic_shapes=dynamic_shapes, optimize=False)
    with dlog.captured_stdout("torch.onnx"):  # "[torch.onnx] Run decompositions..." progress lines
        exported = OnnxExporter().export(model, sample, config=config)
    _optimize(exported.program)
    exported.save_pretrained(str(tmp))
    return place_checked(tmp, out_dir, check(tmp / "model.onnx"), tolerance, "ONNX export")


def _optimize(graph) -> None:
    """What torch.onnx's `optimize=True` runs (onnxscript's optimizer, then its fusions), once the constants are
    folded, the nodes left unused removed and repeated subexpressions merged: its rewriter matches some patterns
    against every node for every node, so it ran 3x longer on the traced graph for the same result (a decoder's 7,525
    nodes, 2,402 after; docs/export-serve.md)."""
    import onnx_ir.passes.common  # noqa: PLC0415 (onnxscript's IR: only when exporting)
    import onnxscript.optimizer  # noqa: PLC0415 (onnxscript: only when exporting)
    import onnxscript.rewriter.onnx_fusions  # noqa: PLC0415 (onnxscript: only when exporting)

    onnxscript.optimizer.fold_constants(graph)
    onnxscript.optimizer.remove_unused_nodes(graph)
    onnx_ir.passes.common.CommonSubexpressionEliminationPass()(graph)
    onnxscript.optimizer.optimize_ir(graph)
    onnxscript.rewriter.onnx_fusions.fuse(graph)


def place_checked(tmp: Path, out_dir: Path, measured: Parity, tolerance: float, what: str) -> OnnxExport:
    """The graph written in `tmp` (model.onnx and its weights) put in `out_dir`'s place once `measured` is within
    the tolerance (ParityError naming `what` otherwise)."""
    measured.check(tolerance, what)
    session = ort_session(tmp / "model.onnx")
    replace_folder(tmp, out_dir)
    return OnnxExport(out_dir / "model.onnx", measured.diff, [i.name for i in session.get_inputs()],
                      [o.name for o in session.get_outputs()])


def export_logits_model(model, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export `model` (a transformers causal LM, fp32, eval) as `out_dir/model.onnx`: input_ids and
    attention_mask [batch, seq] -> logits [batch, seq, vocab]; verified against PyTorch."""
    model = model.eval()
    model.config.use_cache = False
    sample = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    axes = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}  # batch, sequence; nothing else varies
    return _export(model, {"input_ids": sample, "attention_mask": torch.ones_like(sample)},
                   {"input_ids": axes, "attention_mask": axes}, out_dir, lambda p: parity(model, p), tolerance)


def export_decoder_model(model, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export `model` with key/value-cache inputs and outputs (the `-with-past` decoder) as
    `out_dir/model.onnx`; verified against PyTorch on a prefill and on single-token decoding steps."""
    model = model.eval()
    sample = decoder_sample(model)
    return _export(model, sample, _decoder_dynamic_shapes(sample), out_dir,
                   lambda p: decoder_parity(model, _pin_numeric_dims(p)), tolerance)


def decoder_sample(model) -> dict:
    """The inputs the decoder is traced on: 3 new tokens after a 5-token cache, 3 rows."""
    ids = torch.randint(0, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
    return {"input_ids": ids[:, 5:], "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(5, 8).expand(3, 3), "past_key_values": cache, "use_cache": True}


def _decoder_dynamic_shapes(sample: dict) -> dict:
    """Only the axes that vary: batch and new tokens of the ids, batch and length of the mask, batch and past
    length of every cache tensor (heads and head size are fixed, so the graph says so; docs/export-serve.md has
    its export time against torch.export inferring every axis)."""
    from transformers.exporters.exporter_dynamo import get_auto_dynamic_shapes  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)

    dynamic = torch.export.Dim.DYNAMIC

    def cache_axes(spec):  # the cache's structure as the exporter flattens it, every tensor [batch, heads, past, dim]
        if isinstance(spec, dict):
            return {0: dynamic, 2: dynamic}
        return type(spec)(cache_axes(s) for s in spec) if isinstance(spec, (list, tuple)) else spec

    two = {0: dynamic, 1: dynamic}
    return {"input_ids": two, "attention_mask": two, "position_ids": two,
            "past_key_values": cache_axes(get_auto_dynamic_shapes(sample["past_key_values"]))}


def _pin_numeric_dims(onnx_path: Path) -> Path:
    """torch.export names fixed axes of a cache input after their size ("2"): make them real static dims,
    so that the graph says how many key/value heads and which head size the cache has."""
    graph_model = onnx.load(str(onnx_path), load_external_data=False)
    for value in graph_model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param.isdigit():
                dim.dim_value = int(dim.dim_param)
    onnx.save(graph_model, str(onnx_path))  # the weights stay in the .data file the graph refers to
    return onnx_path


def ort_session(path: Path, threads: int | None = None):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_logits(session, input_ids: np.ndarray) -> np.ndarray:
    feeds = {"input_ids": input_ids.astype(np.int64)}
    if any(i.name == "attention_mask" for i in session.get_inputs()):
        feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
    return session.run(["logits"], feeds)[0]


def empty_cache(session, batch: int) -> dict[str, np.ndarray]:
    """The decoder model's cache inputs for a prefill: [batch, kv_heads, 0, head_dim] zeros."""
    return {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}


def run_decoder(session, input_ids: np.ndarray, past: dict[str, np.ndarray], past_len: int):
    """One decoder-model call on `input_ids` after `past_len` cached tokens: (logits, the grown cache)."""
    batch, seq = input_ids.shape
    positions = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq)).astype(np.int64)
    feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": np.ones((batch, past_len + seq), np.int64),
             "position_ids": positions, **past}
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, feeds)
    cache = {n.replace("cache.", "past_key_values.", 1): v for n, v in zip(names, values) if n.startswith("cache.")}
    return values[names.index("logits")], cache


def parity(model, onnx_path: Path) -> Parity:
    """max |logits(ONNX Runtime) - logits(PyTorch)| on a batch/sequence shape unlike the traced one."""
    ids = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    return Parity(float(np.abs(run_logits(ort_session(onnx_path), ids.numpy()) - ref).max()), float(np.abs(ref).max()))


def decoder_parity(model, onnx_path: Path) -> Parity:
    """Prefill 11 tokens on an empty cache, then 3 single-token steps: max |logit diff| to PyTorch's
    logits for the whole 14-token sequence."""
    ids = torch.randint(0, model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    session = ort_session(onnx_path)
    logits, cache = run_decoder(session, ids[:, :11].numpy(), empty_cache(session, 3), 0)
    diffs = [np.abs(logits - ref[:, :11]).max()]
    for t in range(11, 14):
        logits, cache = run_decoder(session, ids[:, t:t + 1].numpy(), cache, t)
        diffs.append(np.abs(logits[:, 0] - ref[:, t]).max())
    return Parity(float(max(diffs)), float(np.abs(ref).max()))


def expose_hidden_states(model, onnx_path: Path, tolerance: float = 1e-3) -> Path:
    """Add the decoder graph's last hidden state (after the final norm: what the lm head reads, and DeepSeek's MTP
    module with it) as the output `hidden_states` [batch, new, hidden], parity-checked against PyTorch's on the
    decoder's prefill and decoding steps."""
    graph_model = onnx.load(str(onnx_path), load_external_data=False)
    graph = graph_model.graph
    weights = {i.name for i in graph.initializer}
    head = next(n for n in graph.node if "logits" in n.output)
    hidden = next(i for i in head.input if i not in weights)
    graph.node.append(onnx.helper.make_node("Identity", [hidden], ["hidden_states"], name="hidden_states_output"))
    graph.output.append(onnx.helper.make_tensor_value_info(
        "hidden_states", onnx.TensorProto.FLOAT, ["batch", "sequence", model.config.hidden_size]))
    onnx.save(graph_model, str(onnx_path))
    ids = torch.randint(0, model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.model(input_ids=ids).last_hidden_state.numpy()
    session = ort_session(onnx_path)
    past, diffs = empty_cache(session, 3), []
    for start, end in ((0, 11), (11, 12), (12, 13), (13, 14)):
        feeds = {"input_ids": ids[:, start:end].numpy(), "attention_mask": np.ones((3, end), np.int64),
                 "position_ids": np.broadcast_to(np.arange(start, end), (3, end - start)).astype(np.int64), **past}
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(names, feeds)))
        past = {n.replace("cache.", "past_key_values.", 1): v for n, v in values.items() if n.startswith("cache.")}
        diffs.append(float(np.abs(values["hidden_states"] - ref[:, start:end]).max()))
    Parity(max(diffs), float(np.abs(ref).max())).check(tolerance, "the decoder's hidden_states output")
    return onnx_path


class MTPDraft(torch.nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction as a draft model with its own key/value cache (the math of
    dstool.train.mtp): at position i, x = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) through the depth's decoder
    layer gives h'_i (the next depth's, or this one's own next step's, `hidden_states`) and
    logits = lm_head(shared_head.norm(h'_i)) for t_{i+2}. The embedding, head and rotary embedding are the main
    model's."""

    def __init__(self, model, layer, weights: dict[str, torch.Tensor]):
        """`layer`: the depth's decoder layer (model.layers.{L+k-1}, loaded by transformers); `weights`: its
        enorm/hnorm/eh_proj/shared_head.norm tensors under DeepSeek's names (without the layer prefix)."""
        super().__init__()
        config, norm = model.config, type(model.model.norm)
        self.embed, self.head, self.rotary, self.layer = model.model.embed_tokens, model.lm_head, \
            model.model.rotary_emb, layer
        self.enorm, self.hnorm, self.norm = (norm(config.hidden_size, eps=config.rms_norm_eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        for module, name in ((self.enorm, "enorm"), (self.hnorm, "hnorm"), (self.norm, "shared_head.norm"),
                             (self.eh_proj, "eh_proj")):
            module.weight.data.copy_(weights[f"{name}.weight"])
        self.eval()

    def forward(self, input_ids, hidden_states, position_ids, attention_mask, past_key_values):
        """input_ids, position_ids [batch, new]; hidden_states [batch, new, hidden]; attention_mask [batch, past +
        new]; past_key_values {"layers": [{"keys", "values"}]}: the layer's cache (DeepSeek's latent keys and
        rotary keys) -> logits, next_hidden_states and the grown cache."""
        past = past_key_values["layers"][0]
        cache = _LayerCache(past["keys"], past["values"])
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden_states)], dim=-1))
        new, total = input_ids.shape[1], attention_mask.shape[1]
        causal = torch.arange(total)[None, :] <= (torch.arange(new) + (total - new))[:, None]
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, cache=cache,
                         position_embeddings=self.rotary(x, position_ids))
        return {"logits": self.head(self.norm(out)), "next_hidden_states": out,
                "cache": {"layers": [{"keys": cache.keys, "values": cache.values}]}}


class _LayerCache:
    """The one layer's cache of an MTPDraft run: the past, then the past and the new positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, keys, values, layer_idx, kwargs=None):
        self.keys, self.values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        return self.keys, self.values


# an MTP depth's own weights (the rest is a decoder layer, the embedding and head the main model's)
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _mtp_located(folder: Path) -> list[dict[str, tuple[Path, str]]]:
    """Each MTP depth's own weights (enorm, hnorm, eh_proj, shared_head.norm; DeepSeek's names under
    model.layers.{L + k}) as (file, key), for the depths `num_nextn_predict_layers` declares and the folder holds
    whole, in order (a DeepSeek-V3 config says 1 by default, also for a model saved without them)."""
    from safetensors import safe_open  # noqa: PLC0415 (the export extra)

    config = json.loads((Path(folder) / "config.json").read_text())
    declared, first = int(config.get("num_nextn_predict_layers") or 0), int(config["num_hidden_layers"])
    found: dict[int, dict[str, tuple[Path, str]]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")) if declared else []:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".", 3)
                if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
                        0 <= int(parts[2]) - first < declared and parts[3] in MTP_OWN:
                    found.setdefault(int(parts[2]) - first, {})[parts[3]] = (file, key)
    depths: list[dict[str, tuple[Path, str]]] = []
    while len(depths) < declared and set(found.get(len(depths), {})) == set(MTP_OWN):
        depths.append(found[len(depths)])
    return depths


def mtp_depths(folder: Path) -> int:
    """How many MTP depths the Hugging Face folder holds (`num_nextn_predict_layers`, those whose weights it has)."""
    return len(_mtp_located(folder))


def mtp_drafts(model, folder: Path) -> list[MTPDraft]:
    """The MTP depths of the Hugging Face folder (`mtp_depths`, at model.layers.{L..L+D-1}) on `model` (its main
    model): each depth's decoder layer as transformers loads it, with its own norms and projection."""
    from safetensors import safe_open  # noqa: PLC0415 (the export extra)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (the export extra)

    located = _mtp_located(folder)
    if not located:
        return []

    def tensor(file: Path, key: str) -> torch.Tensor:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key)

    config = AutoConfig.from_pretrained(folder)
    first = config.num_hidden_layers
    config.num_hidden_layers = first + len(located)  # transformers loads the depths' decoder layers as its own
    with_depths = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    return [MTPDraft(model, with_depths.model.layers[first + k], {n: tensor(*at) for n, at in own.items()})
            for k, own in enumerate(located)]


def mtp_sample(draft: MTPDraft, batch: int, new: int, past: int, seed: int = 0) -> dict:
    """Inputs of an MTPDraft run: random ids and hidden states, `new` positions after `past` cached ones."""
    g = torch.Generator().manual_seed(seed)
    config, attn = draft.embed.weight.shape, draft.layer.self_attn
    keys = torch.randn(batch, 1, past, attn.kv_lora_rank, generator=g)
    values = torch.randn(batch, 1, past, attn.qk_rope_head_dim, generator=g)
    return {"input_ids": torch.randint(0, config[0], (batch, new), generator=g),
            "hidden_states": torch.randn(batch, new, config[1], generator=g),
            "position_ids": torch.arange(past, past + new).expand(batch, new),
            "attention_mask": torch.ones(batch, past + new, dtype=torch.int64),
            "past_key_values": {"layers": [{"keys": keys, "values": values}]}}


def export_mtp_graph(draft: MTPDraft, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export one MTP depth as `out_dir/model.onnx` (inputs input_ids, hidden_states, position_ids, attention_mask,
    past_key_values.layers.0.{keys,values}; outputs logits, next_hidden_states, cache.layers.0.{keys,values}),
    verified against PyTorch on a prefill and on single-token steps."""
    dynamic = torch.export.Dim.DYNAMIC
    two, cache = {0: dynamic, 1: dynamic}, {0: dynamic, 2: dynamic}
    shapes = {"input_ids": two, "hidden_states": two, "position_ids": two, "attention_mask": two,
              "past_key_values": {"layers": [{"keys": cache, "values": cache}]}}
    return _export(draft, mtp_sample(draft, 2, 3, 5), shapes, out_dir,
                   lambda p: mtp_parity(draft, _pin_numeric_dims(p)), tolerance)


def run_mtp(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One MTP graph run: its outputs by name."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def mtp_parity(draft: MTPDraft, onnx_path: Path) -> Parity:
    """A prefill of 11 positions on an empty cache, then 3 single-position steps, against PyTorch's run of the 14
    at once: max |diff| of the logits (and of next_hidden_states, held to the same bound)."""
    full = mtp_sample(draft, 3, 14, 0, seed=1)
    with torch.no_grad():
        ref = draft(**full)
    session = ort_session(onnx_path)
    keys, values = (full["past_key_values"]["layers"][0][n].numpy() for n in ("keys", "values"))
    logit_diff = hidden_diff = 0.0
    for start, end in ((0, 11), (11, 12), (12, 13), (13, 14)):
        out = run_mtp(session, {
            "input_ids": full["input_ids"][:, start:end].numpy(),
            "hidden_states": full["hidden_states"][:, start:end].numpy(),
            "position_ids": full["position_ids"][:, start:end].numpy(),
            "attention_mask": np.ones((3, end), np.int64),
            "past_key_values.layers.0.keys": keys, "past_key_values.layers.0.values": values})
        keys, values = out["cache.layers.0.keys"], out["cache.layers.0.values"]
        logit_diff = max(logit_diff, float(np.abs(out["logits"] - ref["logits"][:, start:end].numpy()).max()))
        hidden_diff = max(hidden_diff, float(np.abs(out["next_hidden_states"] -
                                                    ref["next_hidden_states"][:, start:end].numpy()).max()))
    Parity(hidden_diff, float(ref["next_hidden_states"].abs().max())).check(1e-3, "the MTP graph's hidden states")
    return Parity(logit_diff, float(ref["logits"].abs().max()))
