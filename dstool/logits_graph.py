"""The logits graph cut from the decoder graph: no second trace of the model.

`export_decoder_model`'s graph with an empty cache is the logits graph: its cache inputs become
[batch, kv_heads, 0, head_dim] zeros, `position_ids` 0..seq-1 (what transformers uses when none are given),
and `logits` is the only output; nodes that no longer lead to it are dropped. What remains is the graph
`export_logits_model` traces (same nodes, same weights: logits equal to the bit on the real model, the same speed;
docs/export-serve.md), made in a second instead of a trace of a minute or more; it is parity-checked against
PyTorch as a traced one is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
from onnx import TensorProto
from onnx import helper as h

from dstool.onnx_export import OnnxExport, parity, place_checked

PREFIX = "logits_graph."  # the names of the nodes and values added here


def _int64s(name: str, values: list[int]) -> onnx.NodeProto:
    return h.make_node("Constant", [], [name], value=h.make_tensor(name, TensorProto.INT64, [len(values)], values))


def _inputs_made(cache: list[onnx.ValueInfoProto]) -> list[onnx.NodeProto]:
    """Nodes making `position_ids` [batch, seq] = 0..seq-1 and each cache input's empty tensor from `input_ids`."""
    p = PREFIX
    nodes = [_int64s(p + "zero", [0]), _int64s(p + "one", [1]), _int64s(p + "two", [2]),
             h.make_node("Shape", ["input_ids"], [p + "shape"]),
             h.make_node("Slice", [p + "shape", p + "zero", p + "one"], [p + "batch"]),
             h.make_node("Slice", [p + "shape", p + "one", p + "two"], [p + "seq"]),
             h.make_node("Squeeze", [p + "seq", p + "zero"], [p + "length"]),
             h.make_node("Constant", [], [p + "start"], value=h.make_tensor(p + "start", TensorProto.INT64, [], [0])),
             h.make_node("Constant", [], [p + "step"], value=h.make_tensor(p + "step", TensorProto.INT64, [], [1])),
             h.make_node("Range", [p + "start", p + "length", p + "step"], [p + "positions"]),
             h.make_node("Unsqueeze", [p + "positions", p + "zero"], [p + "row"]),
             h.make_node("Expand", [p + "row", p + "shape"], ["position_ids"])]
    shapes: dict[tuple[int, int], str] = {}
    for value in cache:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]  # [batch, kv_heads, past, head_dim]
        if (dims[1], dims[3]) not in shapes:
            name = f"{p}empty_{dims[1]}x{dims[3]}"
            nodes += [_int64s(name + ".dims", [dims[1], 0, dims[3]]),
                      h.make_node("Concat", [p + "batch", name + ".dims"], [name], axis=0)]
            shapes[dims[1], dims[3]] = name
        nodes.append(h.make_node("ConstantOfShape", [shapes[dims[1], dims[3]]], [value.name],
                                 value=h.make_tensor(p + "zero_f", value.type.tensor_type.elem_type, [1], [0])))
    return nodes


def cut(decoder: Path, out: Path) -> Path:
    """Write `out/model.onnx` (and the decoder's weights file beside it): the decoder graph at `decoder` as the
    logits graph (input_ids, attention_mask -> logits)."""
    model = onnx.load(str(decoder), load_external_data=False)
    graph = model.graph
    cache = [i for i in graph.input if i.name.startswith("past_key_values.")]
    if not cache or not all(d.HasField("dim_value") for i in cache for d in list(i.type.tensor_type.shape.dim)[1::2]):
        raise ValueError(f"{decoder} is not a key/value-cache decoder graph with fixed heads and head size")
    made = {"position_ids", *(i.name for i in cache)}
    kept = [i for i in graph.input if i.name not in made]
    del graph.input[:]
    graph.input.extend(kept)
    logits = [o for o in graph.output if o.name == "logits"]
    del graph.output[:]
    graph.output.extend(logits)
    nodes, needed, used = [*_inputs_made(cache), *graph.node], {"logits"}, []
    for node in reversed(nodes):  # what leads to the logits
        if any(o in needed for o in node.output):
            used.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(used))
    for field in (graph.initializer, graph.value_info):
        kept_values = [v for v in field if v.name in needed]
        del field[:]
        field.extend(kept_values)
    out.mkdir(parents=True, exist_ok=True)
    data = {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}
    for name in data:  # a copy: onnx's checker refuses a weights file with several hard links
        shutil.copyfile(decoder.parent / name, out / name)
    onnx.save(model, str(out / "model.onnx"))
    return out / "model.onnx"


def from_decoder(model, decoder: OnnxExport, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """The logits graph of `model` (as `export_logits_model` makes it) cut from its exported `decoder` into
    `out_dir`, verified against PyTorch's logits the same way."""
    model.eval().config.use_cache = False  # as export_logits_model leaves it
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return place_checked(tmp, out_dir, parity(model, cut(decoder.path, tmp)), tolerance,
                         "the logits graph cut from the decoder graph")
