"""The fused decoder graph: ONNX Runtime's GroupQueryAttention contrib op (rotary embedding inside, packed QKV) over
a key/value cache that the op updates in place, written from a transformers Llama-layout module (Llama, Llama-3 rope
scalings, Qwen2, Mistral without a sliding window) and gated by parity with transformers, as the exported graphs are.

    input_ids [batch, new], seqlens_k [batch] (int32: positions held after this call - 1),
    total_sequence_length (int32 scalar: the longest row's positions after this call),
    past_key_values.layers.I.{keys,values} [batch, kv_heads, capacity, head_dim]
      -> logits [batch, new, vocab], cache.layers.I.{keys,values} (the same buffers, bound to the same memory)

Bound with IO binding to one buffer per cache tensor, a decoding step writes one position per row and copies no
cache (the exported decoder concatenates the whole cache into a new tensor every step). Rows may hold different
lengths: each attends to its own `seqlens_k + 1` positions. The op's limit: a prompt chunk after cached positions
(a prefix-cache hit, a long prompt's next chunk) runs one row at a time; first chunks and decoding steps batch.
docs/export-serve.md has the measurement that chose it; DeepSeek-V2/V3 (multi-head latent attention, whose keys
and values are not GQA-shaped) keep the exported decoder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from dstool import architectures
from dstool.decoding.adapters import RowWeights, graph_layout
from dstool.decoding.engine import FusedRunner
from dstool.files import replace_folder
from dstool.onnx_export import OnnxExport, Parity, ort_session


def unsupported(config) -> str | None:
    """Why `config`'s model has no fused graph (None: it has one)."""
    known = architectures.architecture(config.model_type)
    if known is None or not known.fused_decoder:
        return f"{config.model_type} is not a Llama-layout model"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "attention_bias", False):
        return "output-projection bias"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embedding"
    return None


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def export_fused_decoder(model, out_dir: Path, tolerance: float = 1e-3, lora: bool = False) -> OnnxExport:
    """`model` (fp32, eval, `unsupported(model.config)` None) as `out_dir/model.onnx`, verified against PyTorch.
    Its weight MatMuls are named by what they hold (`layers.I.qkv`, `.o`, `.gate`, `.up`, `.down`; `lm_head`).
    With `lora`, every linear layer of the decoder layers also takes per-row LoRA adapters (`dstool.decoding.adapters`:
    inputs lora.layers.I.M.{A,B}; verified with none in use)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write(model, tmp / "model.onnx", lora)  # (parity below: with no adapter in use)
    measured = parity(model, tmp / "model.onnx")
    measured.check(tolerance, "the fused decoder")
    replace_folder(tmp, out_dir)
    import onnx

    graph = onnx.load(str(out_dir / "model.onnx"), load_external_data=False).graph
    return OnnxExport(out_dir / "model.onnx", measured.diff, [i.name for i in graph.input],
                      [o.name for o in graph.output])


def _write(model, path: Path, lora: bool = False) -> None:
    import onnx
    import torch
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper

    cfg = model.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    initializers, nodes = [], []

    def const(name: str, array: np.ndarray) -> str:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name))
        return name

    def node(op: str, inputs: list[str], output: str, name: str | None = None, **attrs) -> str:
        nodes.append(h.make_node(op, inputs, [output], name=name, **attrs))
        return output

    def norm(x: str, weight: str, out: str) -> str:
        return node("SimplifiedLayerNormalization", [x, const(weight, weights[weight])], out, axis=-1,
                    epsilon=cfg.rms_norm_eps)

    def linear(x: str, weight: str, out: str) -> str:
        base = node("MatMul", [x, const(weight, weights[weight].T)], out + ("_w" if lora else ""), name=f"layers.{out}")
        return node("Add", [base, adapted(x, weight, out)], out) if lora else base

    def adapted(x: str, weight: str, out: str) -> str:
        """x @ A @ B of each row's own adapter for the linear layer `weight`."""
        layer, module = out.split(".")[0], weight.split(".")[-2].removesuffix("_proj")
        fan_out, fan_in = weights[weight].shape
        a, b = f"lora.layers.{layer}.{module}.A", f"lora.layers.{layer}.{module}.B"
        inputs.extend([h.make_tensor_value_info(a, T.FLOAT, ["batch", fan_in, "lora_rank"]),
                       h.make_tensor_value_info(b, T.FLOAT, ["batch", "lora_rank", fan_out])])
        return node("MatMul", [node("MatMul", [x, a], f"{out}.lora_down"), b], f"{out}.lora")

    with torch.no_grad():  # the module's own rotary tables: every rope scaling as transformers computes it
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(cfg.max_position_embeddings)[None])
    const("cos_cache", cos[0, :, :dim // 2].numpy())
    const("sin_cache", sin[0, :, :dim // 2].numpy())
    inputs = [h.make_tensor_value_info("input_ids", T.INT64, ["batch", "sequence"]),
              h.make_tensor_value_info("seqlens_k", T.INT32, ["batch"]),
              h.make_tensor_value_info("total_sequence_length", T.INT32, [])]
    outputs = [h.make_tensor_value_info("logits", T.FLOAT, ["batch", "sequence", cfg.vocab_size])]
    x = node("Gather", [const("model.embed_tokens.weight", weights["model.embed_tokens.weight"]), "input_ids"],
             "embedded")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        normed = norm(x, p + "input_layernorm.weight", f"{i}.ln1")
        proj = [p + f"self_attn.{n}_proj." for n in "qkv"]
        qkv = node("MatMul", [normed, const(p + "qkv", np.concatenate([weights[n + "weight"] for n in proj]).T)],
                   f"{i}.qkv", name=f"layers.{i}.qkv")
        if lora:  # each of q, k and v its own adapters, their outputs side by side as the packed projection's
            qkv = node("Add", [qkv, node("Concat", [adapted(normed, n + "weight", f"{i}.{n[-7]}") for n in proj],
                                         f"{i}.qkv_lora", axis=-1)], f"{i}.qkv_adapted")
        if proj[0] + "bias" in weights:  # Qwen2's
            qkv = node("Add", [qkv, const(p + "qkv.bias", np.concatenate([weights[n + "bias"] for n in proj]))],
                       f"{i}.qkv_b")
        past = [f"past_key_values.layers.{i}.{kv}" for kv in ("keys", "values")]
        present = [f"cache.layers.{i}.{kv}" for kv in ("keys", "values")]
        inputs += [h.make_tensor_value_info(n, T.FLOAT, ["batch", kv_heads, "capacity", dim]) for n in past]
        outputs += [h.make_tensor_value_info(n, T.FLOAT, ["batch", kv_heads, "capacity", dim]) for n in present]
        nodes.append(h.make_node(
            "GroupQueryAttention", [qkv, "", "", *past, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
            [f"{i}.attn", *present], domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, do_rotary=1))
        attended = node("Add", [x, linear(f"{i}.attn", p + "self_attn.o_proj.weight", f"{i}.o")], f"{i}.res1")
        normed = norm(attended, p + "post_attention_layernorm.weight", f"{i}.ln2")
        gate = linear(normed, p + "mlp.gate_proj.weight", f"{i}.gate")
        act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], f"{i}.sig")], f"{i}.silu"),
                           linear(normed, p + "mlp.up_proj.weight", f"{i}.up")], f"{i}.act")
        x = node("Add", [attended, linear(act, p + "mlp.down_proj.weight", f"{i}.down")], f"{i}.out")
    normed = norm(x, "model.norm.weight", "normed")
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    node("MatMul", [normed, const("lm_head.weight.T", head.T)], "logits", name="lm_head")
    graph = h.make_model(h.make_graph(nodes, "dstool_fused_decoder", inputs, outputs, initializers),
                         opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
    onnx.save(graph, str(path), save_as_external_data=True, location=path.name + ".data")


def cache_buffers(session, rows: int, capacity: int) -> dict[str, np.ndarray]:
    """Zeroed cache buffers for the fused graph of `session`."""
    return {i.name: np.zeros((rows, i.shape[1], capacity, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}


def parity(model, onnx_path: Path) -> Parity:
    """max |logit diff| to PyTorch: a 3-row prefill of 11 tokens, 3 single-token steps (rows in a batch), then one
    row's last 3 tokens as a prompt chunk after its first 11 (a prefix-cache hit). (A graph with LoRA inputs: with
    no adapter in use; `model` may be a PEFT-merged model and `adapter` then the adapter every row runs.)"""
    return adapter_parity(model, onnx_path, None)


def adapter_parity(model, onnx_path: Path, adapter) -> Parity:
    """`parity`, every row running `adapter` (a `dstool.decoding.adapters.Adapter`, or None) against `model`."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    session = ort_session(onnx_path)
    runner, buffers = FusedRunner(session), cache_buffers(session, 3, 32)
    lora = _lora_inputs(session, adapter)

    def run(ids, held, buffers):
        return runner.run(ids, held, buffers, None if lora is None else lora(len(ids)))

    held = np.zeros(3, np.int64)
    diffs = [np.abs(run(ids[:, :11].numpy(), held, buffers) - ref[:, :11]).max()]
    for t in range(11, 14):
        diffs.append(np.abs(run(ids[:, t:t + 1].numpy(), held + t, buffers)[:, 0] - ref[:, t]).max())
    row = {n: b[1:2] for n, b in buffers.items()}
    diffs.append(np.abs(run(ids[1:2, 11:].numpy(), np.array([11]), row)[0] - ref[1, 11:]).max())
    return Parity(float(max(diffs)), float(np.abs(ref).max()))


def _lora_inputs(session, adapter):
    """rows -> the LoRA inputs of a run of that many rows, every row running `adapter`; None for a graph without."""
    layout = graph_layout(session.get_inputs())
    if not layout:
        return None
    weights = RowWeights(layout)
    return lambda rows: weights.rows([adapter] * rows)


def prefill(session, ids: np.ndarray, adapter=None) -> np.ndarray:
    """The logits of `ids` [batch, sequence] prefilled on an empty cache (every row with `adapter`, on a graph with
    LoRA inputs)."""
    lora = _lora_inputs(session, adapter)
    return FusedRunner(session).run(ids, np.zeros(len(ids), np.int64), cache_buffers(session, len(ids), ids.shape[1]),
                                    None if lora is None else lora(len(ids)))
