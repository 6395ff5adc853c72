"""Cutting the key/value-cache decoder graph (`dstool.onnx_export`'s, or a `dstool compress` output's: int8,
pruned — any graph of that interface) into an edge package's parts, by graph surgery on the ONNX graph itself,
so that a quantized graph is split as compress made it, never re-quantized:

    embed      input_ids -> hidden.0
    block-K    hidden.I, attention_mask, position_ids, past_key_values.layers.{I..J-1}.*
               -> hidden.J, cache.layers.{I..J-1}.*          (decoder layers I..J-1; rotary and mask inside)
    head       hidden.L -> logits                             (final norm and lm_head)

Where the layers begin is found from the data flow, not from node names (compress strips them): `hidden.N` is
the last tensor every path from input_ids to the logits passes through (a dominator, shape reads aside) that
layer N's cache outputs depend on; `hidden.L` is the first such tensor after which only one node reads a weight
matrix: the lm_head. What the layers share (the causal mask, rotary cos/sin, shape arithmetic) is computed from
the block's own inputs — each block carries its copy of those few nodes, so a block runs alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx
from onnx import helper

from dstool.errors import StageFailed

SHAPE_OPS = {"Shape", "Size"}  # read a tensor's shape, not its values: no data flows through them
CACHE_OUT = re.compile(r"^cache\.layers\.(\d+)\.(\w+)$")
PAST = "past_key_values.layers.{}.{}"
HEAVY_1D = 1024  # a 1-D initializer this large that a constant subgraph reads is packed weights (bitmask, values)


@dataclass
class Part:
    """One graph of the package: its nodes (copies) and the tensors it takes and gives."""

    name: str
    layers: list[int]
    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    initializers: list[str] = field(default_factory=list)


def _dominators(graph: onnx.GraphProto) -> dict[str, frozenset[str]]:
    """Tensor -> the tensors every data path from input_ids to it passes through (itself included), for the
    tensors input_ids' values flow into."""
    dom = {"input_ids": frozenset({"input_ids"})}
    for node in graph.node:
        if node.op_type in SHAPE_OPS:
            continue
        preds = [dom[i] for i in node.input if i in dom]
        if preds:
            common = frozenset.intersection(*preds)
            dom.update({o: common | {o} for o in node.output if o})
    return dom


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in model.graph.node
               for a in n.attribute):
            raise StageFailed("the decoder graph has control flow (If/Loop/Scan): it cannot be split by layer")
        self.producer = {o: n for n in model.graph.node for o in n.output if o}
        self.order = {o: k for k, n in enumerate(model.graph.node) for o in n.output if o}
        self.inits = {t.name: t for t in model.graph.initializer}
        self.inputs = {v.name: v for v in model.graph.input if v.name not in self.inits}
        # tensors computed from initializers alone (a constant subgraph, such as a `--sparsity` output's weights
        # rebuilt from bitmask and values), and the weight matrices among all constants: a 2-D (or more)
        # initializer, or what a constant subgraph computes from one or from a large 1-D array
        self.constant_nodes: set[int] = set()
        self.heavy = {name for name, t in self.inits.items() if len(t.dims) >= 2}
        constant = set(self.inits)
        for node in model.graph.node:
            if all(not i or i in constant for i in node.input):
                self.constant_nodes.add(id(node))
                constant.update(o for o in node.output if o)
                if any(i in self.heavy or (i in self.inits and _numel(self.inits[i]) >= HEAVY_1D) for i in node.input):
                    self.heavy.update(o for o in node.output if o)

    def backward(self, outputs: list[str], stops: set[str]) -> list[onnx.NodeProto]:
        """The nodes that compute `outputs` from `stops`, graph inputs and initializers, in graph order."""
        seen: set[str] = set()
        nodes: dict[int, onnx.NodeProto] = {}
        stack = list(outputs)
        while stack:
            t = stack.pop()
            if not t or t in seen or t in stops or t in self.inits or t in self.inputs:
                continue
            seen.add(t)
            node = self.producer[t]
            if id(node) not in nodes:
                nodes[id(node)] = node
                stack.extend(node.input)
        return sorted(nodes.values(), key=lambda n: self.order[n.output[0]])

    def weighted(self, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
        """The nodes the data flows through that read a weight matrix (a MatMul's, a 4-bit MatMulNBits' packed
        weights and block scales, a rebuilt sparse weight; not the nodes that rebuild it)."""
        return [n for n in nodes if id(n) not in self.constant_nodes and any(i in self.heavy for i in n.input)]


def plan(model: onnx.ModelProto, layers_per_block: int) -> tuple[list[Part], dict[str, onnx.ValueInfoProto]]:
    """The parts of `model` (a decoder graph with past_key_values.layers.N.* inputs and cache.layers.N.* outputs):
    embed, ceil(layers / layers_per_block) blocks, head; and the type of every hidden.N between them.
    StageFailed where the graph does not split so."""
    g = _Graph(model)
    outputs = [o.name for o in model.graph.output]
    by_layer: dict[int, list[str]] = {}
    for name in outputs:
        if m := CACHE_OUT.match(name):
            by_layer.setdefault(int(m[1]), []).append(name)
    layers = sorted(by_layer)
    if "logits" not in outputs or "input_ids" not in g.inputs or layers != list(range(len(layers))) or not layers:
        raise StageFailed("the decoder graph lacks input_ids, logits or cache.layers.N.* outputs: export it with "
                          "dstool (`dstool export` or `dstool compress`)")
    dom = _dominators(model.graph)
    main = dom["logits"]
    starts = [max(main.intersection(*(dom[o] for o in by_layer[n])), key=lambda t: g.order.get(t, -1))
              for n in layers]
    if starts[0] == "input_ids" or any(g.order[a] >= g.order[b] for a, b in zip(starts, starts[1:])):
        raise StageFailed("the decoder graph's layers do not follow one another through one hidden state: it "
                          "cannot be split by layer")
    after = sorted((t for t in main if g.order.get(t, -1) > g.order[starts[-1]]), key=g.order.__getitem__)
    head_start = next((t for t in after if len(g.weighted(g.backward(["logits"], {t}))) == 1), None)
    if head_start is None:
        raise StageFailed("no point in the decoder graph after the last layer leaves only the lm_head: it cannot "
                          "be split into blocks and a head")
    cuts = [*starts, head_start]
    parts = [Part("embed", [], g.backward([starts[0]], set()), ["input_ids"], [starts[0]])]
    for first in range(0, len(layers), layers_per_block):
        block = list(range(first, min(first + layers_per_block, len(layers))))
        outs = [cuts[block[-1] + 1]] + [o for n in block for o in by_layer[n]]
        parts.append(_block(g, f"block-{len(parts) - 1:02d}", block, cuts[first], outs))
    parts.append(Part("head", [], g.backward(["logits"], {head_start}), [head_start], ["logits"]))
    names = {t: f"hidden.{n}" for n, t in enumerate(cuts)}
    known = {v.name: v for v in model.graph.value_info}
    missing = [t for t in cuts if t not in known]
    if missing:
        raise StageFailed(f"the decoder graph has no type for tensor {missing[0]}: it cannot be split there")
    hidden = {names[t]: known[t] for t in cuts}
    for part in parts:
        _check_reads(g, part)
        part.initializers = sorted({i for n in part.nodes for i in n.input if i in g.inits})
        _rename(part, names)
    return parts, hidden


def _block(g: _Graph, name: str, layers: list[int], start: str, outputs: list[str]) -> Part:
    """The nodes of decoder layers `layers`, the shared ones copied in: their reads of input_ids' shape are
    rewritten to position_ids' (the same [batch, new tokens] by the decoder's contract), those of another layer's
    cache shape to the block's first layer's (every layer's cache has the same batch and past length; the graph's
    static head counts and sizes must agree)."""
    nodes = []
    for node in g.backward(outputs, {start}):
        if node.op_type in SHAPE_OPS and node.input[0] in g.inputs:
            source = node.input[0]
            if source == "input_ids":
                node = _with_input(node, "position_ids")
            elif (m := re.match(r"^past_key_values\.layers\.(\d+)\.(\w+)$", source)) and int(m[1]) not in layers:
                own = PAST.format(layers[0], m[2])
                if _static_dims(g.inputs[source]) != _static_dims(g.inputs[own]):
                    raise StageFailed(f"{name} reads the shape of {source}, whose fixed dims differ from {own}'s")
                node = _with_input(node, own)
        nodes.append(node)
    reads = {i for n in nodes for i in n.input if i in g.inputs}
    ordered = [start] + [i for i in g.inputs if i in reads]
    return Part(name, layers, nodes, ordered, outputs)


def _check_reads(g: _Graph, part: Part) -> None:
    """A part may read only its own inputs: the embedding reads input_ids, a block its layers' caches."""
    allowed = set(part.inputs) | {"attention_mask", "position_ids"} if part.layers else set(part.inputs)
    allowed |= {PAST.format(n, k) for n in part.layers for k in ("keys", "values")}
    for node in part.nodes:
        for i in node.input:
            if i in g.inputs and i not in allowed:
                raise StageFailed(f"{part.name} would need graph input {i} (read by a {node.op_type} node): the "
                                  "decoder graph cannot be split so")


def _numel(tensor: onnx.TensorProto) -> int:
    n = 1
    for d in tensor.dims:
        n *= d
    return n


def _static_dims(value: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")]


def _with_input(node: onnx.NodeProto, name: str) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[0] = name
    return copy


def _rename(part: Part, names: dict[str, str]) -> None:
    """The hidden states between parts get their `hidden.N` names in the part's nodes and interface."""
    renamed = []
    for node in part.nodes:
        if any(t in names for t in (*node.input, *node.output)):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            for i, t in enumerate(copy.input):
                copy.input[i] = names.get(t, t)
            for i, t in enumerate(copy.output):
                copy.output[i] = names.get(t, t)
            node = copy
        renamed.append(node)
    part.nodes = renamed
    part.inputs = [names.get(t, t) for t in part.inputs]
    part.outputs = [names.get(t, t) for t in part.outputs]


def part_model(model: onnx.ModelProto, part: Part, hidden: dict[str, onnx.ValueInfoProto]) -> onnx.ModelProto:
    """`part` as a model of its own: its nodes, the initializers they read, the decoder's opsets and typed
    interface (`hidden`: the type of every hidden.N, taken from the decoder's value info)."""
    g = model.graph
    known = {v.name: v for v in (*g.value_info, *g.input, *g.output)} | hidden
    inits = {t.name: t for t in g.initializer}

    def typed(name: str) -> onnx.ValueInfoProto:
        if name not in known:
            raise StageFailed(f"the decoder graph has no type for tensor {name}: it cannot be split there")
        value = onnx.ValueInfoProto()
        value.CopyFrom(known[name])
        value.name = name
        return value

    produced = {o for n in part.nodes for o in n.output if o}
    graph = helper.make_graph(part.nodes, part.name, [typed(i) for i in part.inputs],
                              [typed(o) for o in part.outputs], [inits[i] for i in part.initializers],
                              value_info=[known[t] for t in sorted(produced - set(part.outputs)) if t in known])
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                            producer_name="dstool export --target edge")
    out.functions.extend(model.functions)
    return out

