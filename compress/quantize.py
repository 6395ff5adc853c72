"""ONNX Runtime quantization: weight-only int8 and 4-bit (MatMulNBits), and dynamic int8 (MatMulInteger)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer, MatMulNBitsQuantizer

from dstool import log as dlog
from dstool.compress.gptq import BlockCodes
from dstool.compress.measure import perplexity_onnx, timed_in_rotation
from dstool.errors import StageFailed
from dstool.fused_decoder import prefill
from dstool.onnx_export import empty_cache, ort_session, run_decoder, run_logits

LARGE_MODEL_BYTES = 1_800_000_000  # past this, weights go to an external-data file (2 GB protobuf limit)
# The decoder graph quantized with the logits graph's recipe must give its logits on a prefill (an empty cache):
# the same weights and the same per-call activation ranges. Measured on the tiny preset: 0.0 for int8.
PREFILL_TOLERANCE = 1e-3
# ... and both computing in int8, activations quantized per block as they come (weight-only int8). 4-bit weights
# computed in int8 (the decoder) and fp32 (the logits graph) differ by more than any tolerance on a real model
# (SmolLM2-135M, group 128: 5.2 on random tokens, logits up to 36.6; the tiny preset: 0.017): there the decoder is
# quantized once more computing in fp32, and that twin must give the logits graph's logits (PREFILL_TOLERANCE).
MIXED_COMPUTE_TOLERANCE = 0.05
# The fused-attention decoder quantized with the decoder's recipe (its Q, K and V weights packed into one MatMul,
# quantized per output column as the three were): its error against the fp32 decoder on a prefill at most this
# multiple of the quantized decoder's own, plus FUSED_TOLERANCE.
FUSED_ERROR_RATIO = 1.25
FUSED_TOLERANCE = 0.05


@dataclass
class Int8Choice:
    """How int8 is laid out for the CPU this runs on, and why (recorded in the report)."""

    vnni: bool
    reduce_range: bool
    per_channel: bool = True
    weight_type: str = "QInt8"
    activation_type: str = "QUInt8"
    activation_matmuls: bool = False  # also MatMuls of two activations (attention scores), as Optimum's ORTQuantizer
    excluded_nodes: list[str] = field(default_factory=list)
    fp32_layers: list[str] = field(default_factory=list)  # what excluded_nodes are: lm_head, layer N

    def with_excluded(self, nodes: list[str]) -> Int8Choice:
        """The same recipe for another graph of the same model, whose nodes holding those weights are `nodes`."""
        return dataclasses.replace(self, excluded_nodes=list(nodes))


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def int8_choice_for_this_cpu() -> Int8Choice:
    """VNNI (AVX512-VNNI / AVX-VNNI) computes u8 x s8 exactly: full-range signed weights. AVX2/AVX512 without
    VNNI use vpmaddubsw, whose 16-bit intermediate saturates: 7-bit weights (reduce_range) avoid it."""
    vnni = bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})
    return Int8Choice(vnni=vnni, reduce_range=not vnni)


def weight_matmuls(onnx_path: Path) -> list[str]:
    """Names of the MatMul nodes whose second input is a weight (in graph order; the last is lm_head)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in weights]


# ops that only move or select a constant's entries: folded when all their inputs are constants (fold_weight_constants)
_DATA_MOVEMENT = {"Split", "Squeeze", "Unsqueeze", "Transpose", "Reshape", "Slice", "Gather", "Identity"}


def fold_weight_constants(onnx_path: Path) -> int:
    """Rewrite the graph in place with every data-movement node (Split, Squeeze, Transpose, ...) whose inputs are
    all constants replaced by its result as initializers; returns how many nodes went. The exporter keeps the routed
    experts' stacked weights [experts, in, out] as one initializer, split and squeezed per expert in the graph: the
    quantizers take a MatMul's weight only from an initializer, so unfolded the experts stay fp32 in the file and
    int8 quantizes them again on every call (DynamicQuantizeLinear)."""
    model = onnx.load(str(onnx_path))
    graph = model.graph
    overridable = {i.name for i in graph.input}  # an initializer that is also a graph input is not a constant
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name not in overridable}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                   if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"})
    kept, folded = [], 0
    for node in graph.node:
        if not (node.op_type in _DATA_MOVEMENT and node.domain in ("", "ai.onnx") and node.input
                and all(not i or i in values for i in node.input)):
            kept.append(node)
            continue
        inputs = [i for i in node.input if i]
        single = helper.make_model(helper.make_graph(
            [node], "fold", [helper.make_tensor_value_info(i, onnx.TensorProto.UNDEFINED, None) for i in inputs],
            [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output]),
            opset_imports=model.opset_import)
        for name, value in zip(node.output, ReferenceEvaluator(single).run(None, {i: values[i] for i in inputs})):
            values[name] = np.asarray(value)
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        folded += 1
    if not folded:
        return 0
    del graph.node[:]
    graph.node.extend(kept)
    used = _names_read(graph) | {o.name for o in graph.output}
    live = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)
    sidecar = Path(str(onnx_path) + ".data")
    if sidecar.exists():
        sidecar.unlink()
        onnx.save(model, str(onnx_path), save_as_external_data=True, location=sidecar.name)
    else:
        onnx.save(model, str(onnx_path))
    return folded


def _names_read(graph) -> set[str]:
    """Every name a node of `graph` reads, also inside its subgraphs (If/Loop bodies read outer-scope names)."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= _names_read(sub)
    return names


def _save_kwargs(onnx_path: Path) -> bool:
    sidecar = Path(str(onnx_path) + ".data")
    size = onnx_path.stat().st_size + (sidecar.stat().st_size if sidecar.exists() else 0)
    return size > LARGE_MODEL_BYTES


def quantize_int8(fp32: Path, out: Path, choice: Int8Choice) -> Path:
    # MatMul weights -> MatMulInteger; the embedding table (Gather) -> int8 + DequantizeLinear. (ORT logs advice
    # to pre-process the model, which applies to static, calibrated quantization: it goes to the log file.)
    quantize_dynamic(str(fp32), str(out), op_types_to_quantize=["MatMul", "Gather"], per_channel=choice.per_channel,
                     reduce_range=choice.reduce_range, weight_type=QuantType.QInt8,
                     nodes_to_exclude=choice.excluded_nodes, use_external_data_format=_save_kwargs(fp32),
                     extra_options={"MatMulConstBOnly": not choice.activation_matmuls,
                                    # contrib ops' outputs (GroupQueryAttention) have no inferred type: fp32
                                    "DefaultTensorType": onnx.TensorProto.FLOAT})
    strip_exporter_metadata(out)
    return out


def strip_exporter_metadata(path: Path) -> None:
    """Drop the exporter's per-node debug metadata (stack traces, FX node names: ~3 % of an int8 file)."""
    model = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    for node in model.graph.node:
        del node.metadata_props[:]
    onnx.save(model, str(path))


def quantize_nbits(fp32: Path, out: Path, bits: int, block_size: int, symmetric: bool = True,
                   accuracy_level: int | None = None) -> Path:
    """Weight-only `bits` (8 or 4), block-wise (com.microsoft MatMulNBits): a scale (and, asymmetric, a zero point)
    per `block_size` input channels of each MatMul weight (4-bit: the embedding table too, GatherBlockQuantized);
    `accuracy_level` 4 computes in int8, activations quantized per block as they come; None dequantizes the weights
    to fp32 compute. Round-to-nearest (ORT's own quantizer)."""
    return _nbits(fp32, out, bits, block_size, symmetric, accuracy_level, None)[0]


def quantize_nbits_precomputed(fp32: Path, out: Path, block_size: int, codes: dict[str, BlockCodes],
                               accuracy_level: int | None = None) -> tuple[Path, int]:
    """4-bit asymmetric MatMulNBits as `quantize_nbits`, with the codes of `codes` ({gptq.onnx_digest of a MatMul
    weight: its codes}, GPTQ's) for the weights it holds, round-to-nearest for the rest (lm_head, the embedding
    table). Returns the graph and how many MatMuls took precomputed codes."""
    return _nbits(fp32, out, 4, block_size, False, accuracy_level, codes)


class _PrecomputedCodes(DefaultWeightOnlyQuantizer):
    """ORT's weight-only quantizer whose block quantization returns precomputed codes for the weights it knows (by
    content), its own round-to-nearest for the others."""

    def __init__(self, config, codes: dict[str, BlockCodes]):
        super().__init__(config)
        self.codes, self.used = codes, 0

    def qbits_block_quant(self, fp32weight):
        weight = np.asarray(fp32weight, dtype=np.float32)
        found = self.codes.get(hashlib.sha256(np.ascontiguousarray(weight).tobytes()).hexdigest())
        if found is None:
            return super().qbits_block_quant(fp32weight)
        if found.block != self.config.block_size or found.k != weight.shape[0]:
            raise StageFailed(f"precomputed 4-bit codes of block {found.block} and {found.k} input channels for a "
                              f"weight of {weight.shape[0]} quantized in blocks of {self.config.block_size}")
        self.used += 1
        return found.matmulnbits()


def _nbits(fp32: Path, out: Path, bits: int, block_size: int, symmetric: bool, accuracy_level: int | None,
           codes: dict[str, BlockCodes] | None) -> tuple[Path, int]:
    extra = {} if accuracy_level is None else {"accuracy_level": accuracy_level}
    ops = ("MatMul", "Gather") if bits == 4 else ("MatMul",)  # ORT quantizes Gather tables to 4 bits only
    with dlog.details_to_file():  # ORT's opset and per-node notes
        quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=bits, block_size=block_size,
                                         is_symmetric=symmetric, op_types_to_quantize=ops, **extra)
        if codes is not None:
            quantizer.node_quantizer = precomputed = _PrecomputedCodes(quantizer.algo_config, codes)
        quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=_save_kwargs(fp32))
    strip_exporter_metadata(out)
    return out, precomputed.used if codes is not None else 0


def decoding_step_ms(paths: list[Path], vocab: int, past_len: int = 32, repeats: int = 20) -> list[float]:
    """Median time of one decoding step (batch 1, one new token after `past_len` cached ones) of each decoder
    graph, timed in alternation."""
    sessions = [ort_session(p) for p in paths]
    ids = np.random.default_rng(0).integers(0, vocab, (1, past_len))
    pasts = [run_decoder(s, ids, empty_cache(s, 1), 0)[1] for s in sessions]
    steps = [functools.partial(run_decoder, s, ids[:, -1:], past, past_len) for s, past in zip(sessions, pasts)]
    return [1000 * s for s in timed_in_rotation(steps, repeats)]


def choose_nbits_accuracy(decoder: Path, work: Path, vocab: int, bits: int, block_size: int, symmetric: bool
                          ) -> tuple[int | None, dict[str, float]]:
    """The MatMulNBits compute that decodes faster on this CPU, measured on the decoder graph at batch 1 (fp32
    compute or int8; CPUs differ: on one AMD EPYC int8 compute decoded 1.9x faster, on a VNNI one it was slower at
    prefill shapes). Returns the level (None: fp32 compute, 4: int8) and each one's step time in ms."""
    levels = {"fp32": None, "int8": 4}
    paths = [quantize_nbits(decoder, work / f"decoder.nbits-{name}.onnx", bits, block_size, symmetric, level)
             for name, level in levels.items()]
    ms = dict(zip(levels, decoding_step_ms(paths, vocab)))
    for path in paths:
        path.unlink()
        Path(str(path) + ".data").unlink(missing_ok=True)
    return levels[min(ms, key=ms.__getitem__)], ms


def choose_int8_exclusions(fp32: Path, work: Path, tokens: np.ndarray, base_ppl: float, budget: float,
                           num_layers: int) -> tuple[Int8Choice, list[dict]]:
    """Choose by perplexity on `tokens` (calibration text, not the held-out split the report measures; `base_ppl`
    is fp32's on the same tokens). First whether the MatMuls of two activations (attention scores) are quantized
    too, as Optimum's ORTQuantizer does, or stay fp32 (kept only if measured more accurate). Then, if perplexity
    rises more than `budget` (a fraction), measure what keeping each candidate in fp32 buys (lm_head, then each
    decoder layer's projections) and keep the best ones in fp32, greedily, until the budget holds or a quarter
    of the weights' MatMuls are excluded. Returns the choice and every trial (fp32_layers, activation_matmuls,
    perplexity)."""
    choice = int8_choice_for_this_cpu()
    trial = work / "trial.onnx"
    ppl_weights = perplexity_onnx(quantize_int8(fp32, trial, choice), tokens)
    choice.activation_matmuls = True
    ppl_both = perplexity_onnx(quantize_int8(fp32, trial, choice), tokens)
    choice.activation_matmuls = ppl_both < ppl_weights
    ppl_all = min(ppl_weights, ppl_both)
    trials = [{"fp32_layers": [], "activation_matmuls": False, "perplexity": ppl_weights},
              {"fp32_layers": [], "activation_matmuls": True, "perplexity": ppl_both}]
    if ppl_all <= base_ppl * (1 + budget):
        return choice, trials
    nodes = weight_matmuls(fp32)
    candidates = {"lm_head": [nodes[-1]]}
    candidates.update({f"layer {i}": group for i, group in enumerate(_per_layer(fp32, nodes[:-1], num_layers))})
    gains = []
    for label, group in candidates.items():
        choice.excluded_nodes = group
        ppl = perplexity_onnx(quantize_int8(fp32, trial, choice), tokens)
        trials.append({"fp32_layers": [label], "activation_matmuls": choice.activation_matmuls, "perplexity": ppl})
        gains.append((ppl, label, group))
        dlog.log.info(f"int8 sensitivity: keeping {label} in fp32 -> perplexity {ppl:.3f} (all int8: {ppl_all:.3f})")
    excluded: list[str] = []
    labels: list[str] = []
    best = ppl_all
    for ppl, label, group in sorted(gains):
        if best <= base_ppl * (1 + budget) or len(excluded) + len(group) > len(nodes) // 4 or ppl >= ppl_all:
            break
        choice.excluded_nodes = excluded + group
        trial_ppl = perplexity_onnx(quantize_int8(fp32, trial, choice), tokens)
        trials.append({"fp32_layers": labels + [label], "activation_matmuls": choice.activation_matmuls,
                       "perplexity": trial_ppl})
        if trial_ppl < best:
            excluded, labels, best = excluded + group, labels + [label], trial_ppl
    choice.excluded_nodes, choice.fp32_layers = excluded, labels
    return choice, trials


def _per_layer(onnx_path: Path, nodes: list[str], num_layers: int) -> list[list[str]]:
    """The weight MatMuls `nodes` of each decoder layer: by the exporter's name scope (model.layers.N) where every
    node has one (layers differ in MatMuls: MoE experts, dense MLPs), else in equal runs of graph order."""
    scopes = {}
    for node in onnx.load(str(onnx_path), load_external_data=False).graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        found = re.search(r"model\.layers\.(\d+)\b", meta.get("pkg.torch.onnx.name_scopes", ""))
        if found:
            scopes[node.name] = int(found.group(1))
    if all(n in scopes and scopes[n] < num_layers for n in nodes):
        return [[n for n in nodes if scopes[n] == i] for i in range(num_layers)]
    per_layer = max(1, len(nodes) // max(num_layers, 1))
    return [nodes[i * per_layer:(i + 1) * per_layer] for i in range(num_layers)]


def matmul_weight_digests(onnx_path: Path) -> dict[str, str]:
    """MatMul node name -> sha256 of its weight initializer."""
    graph = onnx.load(str(onnx_path)).graph
    weights = {i.name: i for i in graph.initializer}
    return {n.name: hashlib.sha256(numpy_helper.to_array(weights[n.input[1]]).tobytes()).hexdigest()
            for n in graph.node if n.op_type == "MatMul" and n.input[1:2] and n.input[1] in weights}


def same_weight_nodes(source: Path, nodes: list[str], target: Path) -> list[str]:
    """The MatMul nodes of graph `target` that hold the weights `nodes` hold in graph `source` (both fp32 graphs of
    one model: matched by content, since the exporter names their constants differently)."""
    if not nodes:
        return []
    wanted = {d for n, d in matmul_weight_digests(source).items() if n in nodes}
    found = [n for n, d in matmul_weight_digests(target).items() if d in wanted]
    if len(found) != len(nodes):
        raise StageFailed(f"{target.name}: {len(found)} MatMul nodes hold the weights of the {len(nodes)} kept in fp32 "
                          f"in {source.name}; the two graphs do not lay out the same weights")
    return found


def fused_nodes(fused: Path, fp32_layers: list[str]) -> list[str]:
    """The weight MatMuls of the fused-attention decoder `fused` in `fp32_layers` (lm_head, layer N)."""
    prefixes = tuple("lm_head" if label == "lm_head" else f"layers.{label.split()[-1]}." for label in fp32_layers)
    return [n for n in weight_matmuls(fused) if prefixes and n.startswith(prefixes)]


def fused_prefill_errors(fp32_decoder: Path, decoder_graph: Path, fused_graph: Path, vocab: int
                         ) -> tuple[float, float]:
    """max |logit diff| to the fp32 decoder's prefill of the same tokens: of the quantized decoder graph, and of the
    quantized fused-attention decoder. Quantized activations make each graph's error its own (the fused decoder
    packs Q, K and V into one MatMul), so the fused decoder holds the recipe when its error is the decoder's, not
    when it gives the decoder's logits (measured on SmolLM2-135M, weight-only int8: 4.08 and 4.06 on logits up to
    36.6, 2.46 apart)."""
    ids = np.random.default_rng(4).integers(0, vocab, (2, 24))
    reference = ort_session(fp32_decoder)
    expected, _ = run_decoder(reference, ids, empty_cache(reference, len(ids)), 0)
    decoder = ort_session(decoder_graph)
    quantized, _ = run_decoder(decoder, ids, empty_cache(decoder, len(ids)), 0)
    fused = prefill(ort_session(fused_graph), ids)
    return float(np.abs(quantized - expected).max()), float(np.abs(fused - expected).max())


def fused_holds_the_recipe(decoder_error: float, fused_error: float) -> bool:
    return fused_error <= FUSED_ERROR_RATIO * decoder_error + FUSED_TOLERANCE


def decoder_prefill_diff(logits_graph: Path, decoder_graph: Path, vocab: int) -> float:
    """max |logit diff| between the logits graph and the decoder graph's prefill (empty cache) on the same tokens."""
    ids = np.random.default_rng(4).integers(0, vocab, (2, 24))
    decoder = ort_session(decoder_graph)
    prefill, _ = run_decoder(decoder, ids, empty_cache(decoder, len(ids)), 0)
    return float(np.abs(run_logits(ort_session(logits_graph), ids) - prefill).max())
