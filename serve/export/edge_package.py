"""`dstool export --target edge`: an ONNX Runtime-format package of the model for a device with little memory.

The key/value-cache decoder graph — a `dstool compress` output's as its manifest names it (int8, pruned: cut as
compress made it, never re-quantized; a 4-bit one is refused, its int4 embedding table being a type the ORT
format cannot hold), or exported here from a Hugging Face folder (fp32, parity-checked against PyTorch) — is
cut into an embedding, blocks of decoder layers and a head (`edge_split`), and each part is converted with
onnxruntime's own tool (`convert_onnx_models_to_ort`, for ARM: no x86-only layouts), which also writes the
operators and types the parts use, for a minimal ONNX Runtime build. Before the package is renamed into place,
it is run against the unsplit graph: logits within 1e-3 and greedy tokens equal, else StageFailed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dstool import artifacts, gguf
from dstool import log as dlog
from dstool.artifacts import CompressedModel, EdgePackage, EdgeParity, EdgePart
from dstool.decoding.engine import Engine, Sequence
from dstool.errors import StageFailed, UsageError
from dstool.files import replace_folder
from dstool.serve.config.export_config import ExportConfig
from dstool.serve.edge import EdgeModel
from dstool.serve.export.repository import TOKENIZER_FILES
from dstool.serve.export.source import generation_facts, onnx_graphs, read_source

log = dlog.log
TOLERANCE = 1e-3  # max |logit diff| to the unsplit graph (measured: 0 for fp32 and int8 graphs of both presets)
GREEDY_PROBE = 8  # greedy tokens both must agree on
ORT_FORMAT_LIMIT = 2 << 30  # an .ort file is one flatbuffer, which cannot exceed 2 GiB
OPTIMIZATION = "Fixed style, level all, target_platform arm (NCHWc excluded)"
# tensor types the ORT format has no code for: onnxruntime writes such a file and then refuses to load it
# (measured: a 4-bit compress output's int4 embedding table, "Unsupported tensor data type")
UNSUPPORTED_BY_ORT_FORMAT = {21, 22, 23}  # onnx.TensorProto.UINT4, INT4, FLOAT4E2M1
# ops whose output at one position depends on the others' values: dynamic quantization's per-tensor scale
POSITION_MIXING = {"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"}


def export_edge(cfg: ExportConfig) -> EdgePackage:
    """Write the edge package of `cfg.model` to `cfg.output` (an earlier package there is replaced)."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {out} is a file: pass a folder for the edge package")
    if out.is_dir() and any(out.iterdir()) and artifacts.kind_of(out) != "edge-package":
        raise UsageError(f"--output {out} holds other files: pass a new folder (or an earlier edge package, which is "
                         "replaced)")
    cfg = cfg.model_copy(update={"model": gguf.resolve(cfg.model)})
    source = Path(cfg.model)
    compressed = read_source(source)
    layers = int(json.loads(((source / compressed.model) if compressed else source).joinpath("config.json")
                            .read_text()).get("num_hidden_layers", 0))
    if cfg.layers_per_block > layers:
        raise UsageError(f"--layers-per-block {cfg.layers_per_block} is more than the model's {layers} decoder layers: "
                         f"give 1 to {layers}")
    staging = out.with_name(out.name + ".tmp")  # kept, with its log, if the export fails
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    dlog.to_file(staging / "dstool-export.log")
    work = Path(tempfile.mkdtemp(prefix="dstool-edge-"))
    try:
        if compressed:
            log.info(f"dstool export: the decoder graph of {source} as its manifest names it")
            manifest = write_package(source / compressed.graphs["decoder"].path, source / compressed.model, staging,
                                     cfg.layers_per_block, compressed, str(source.resolve()))
        else:
            decoder = onnx_graphs(source, work, ("decoder",))["decoder"]
            manifest = write_package(decoder, source, staging, cfg.layers_per_block)
    except UsageError:
        shutil.rmtree(staging, ignore_errors=True)  # nothing to look into: the message says it all
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    replace_folder(staging, out)
    blocks = manifest.blocks
    log.info(f"dstool export: {out}: {manifest.resident_bytes / 2**20:.1f} MB resident (embedding, head) and "
             f"{len(blocks)} blocks of {manifest.layers_per_block} layer(s), "
             f"{sum(b.bytes for b in blocks) / 2**20:.1f} MB, in ORT format; operators for a minimal build: "
             f"{out / manifest.operators_config}; greedy tokens equal to the unsplit graph's "
             f"(max |logit diff| {manifest.parity.max_abs_logit_diff:.2g})")
    return manifest


def write_package(decoder: Path, hf_dir: Path, folder: Path, layers_per_block: int,
                  compressed: CompressedModel | None = None, compressed_path: str | None = None) -> EdgePackage:
    """The edge package of the decoder graph `decoder` (its tokenizer and generation facts from `hf_dir`) written
    into `folder`, checked against that graph, its manifest last."""
    with tempfile.TemporaryDirectory(prefix="dstool-edge-parts-") as work:
        facts = _package(decoder, Path(work), folder, layers_per_block)
    eos, positions = generation_facts(hf_dir)
    _tokenizer(hf_dir, folder / "tokenizer")
    draft = EdgePackage(**facts, source=compressed.source if compressed else artifacts.source_model(hf_dir),
                        compressed=compressed_path, recipe=compressed.recipe if compressed else None,
                        eos_token_ids=eos, max_positions=positions, head_last_position=False,
                        parity=EdgeParity(max_abs_logit_diff=0.0, greedy_tokens=0))
    vocab = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    parity, last_position = _parity(decoder, folder, draft, vocab)
    manifest = draft.model_copy(update={"parity": parity, "head_last_position": last_position})
    manifest.write(folder)
    return manifest


def _package(decoder: Path, work: Path, staging: Path, layers_per_block: int) -> dict:
    """Cut `decoder` into parts, convert them to ORT format into `staging`; what the manifest says of them."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    from dstool.serve.export import edge_split  # noqa: PLC0415 (onnx at import: the export extra)

    model = onnx.load(str(decoder))
    four_bit = [t.name for t in model.graph.initializer if t.data_type in UNSUPPORTED_BY_ORT_FORMAT]
    if four_bit:
        raise UsageError(f"{decoder} holds {len(four_bit)} 4-bit tensor(s) ({four_bit[0]}), a type the ORT format "
                         f"cannot hold (onnxruntime {ort.__version__} refuses the file): export an int8 or fp32 model "
                         "for --target edge")
    layers = sum(1 for o in model.graph.output if edge_split.CACHE_OUT.match(o.name) and o.name.endswith(".keys"))
    parts, hidden = edge_split.plan(model, layers_per_block)
    onnx_dir = work / "parts"
    onnx_dir.mkdir()
    for part in parts:
        part_model = edge_split.part_model(model, part, hidden)
        if part_model.ByteSize() >= ORT_FORMAT_LIMIT:
            raise UsageError(f"{part.name} would hold {part_model.ByteSize() / 2**30:.1f} GiB, more than one "
                             "ORT-format file can (2 GiB): give a smaller --layers-per-block, or compress the model "
                             "first")
        onnx.save(part_model, str(onnx_dir / f"{part.name}.onnx"))
    log.info(f"dstool export: {len(parts)} parts cut from {decoder.name}; converting them to ORT format "
             f"(onnxruntime {ort.__version__}, {OPTIMIZATION})")
    ort_dir = work / "ort"
    with dlog.captured_stdout("onnxruntime.tools"):
        convert_onnx_models_to_ort(onnx_dir, output_dir=ort_dir, optimization_styles=[OptimizationStyle.Fixed],
                                   target_platform="arm", enable_type_reduction=True)
    config = "required_operators_and_types.config"
    # the tool names the files it read by their absolute (temporary) paths: name them as the package does
    text = (ort_dir / config).read_text().replace(f"{ort_dir}/", "")
    (staging / config).write_text(text)
    entries = {}
    for part in parts:
        rel = f"blocks/{part.name}.ort" if part.layers else f"{part.name}.ort"
        (staging / rel).parent.mkdir(exist_ok=True)
        shutil.move(ort_dir / f"{part.name}.ort", staging / rel)
        entries[part.name] = EdgePart(path=rel, bytes=(staging / rel).stat().st_size, layers=part.layers,
                                      inputs=part.inputs, outputs=part.outputs)
    inputs = {v.name: v for v in model.graph.input}
    cache = {name: [d.dim_value for d in inputs[name].type.tensor_type.shape.dim][1::2]
             for name in inputs if name.startswith("past_key_values.")}
    if any(0 in dims for dims in cache.values()):
        raise StageFailed(f"{decoder}: the cache inputs need static head counts and sizes, got {cache}")
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return {"onnxruntime": ort.__version__, "ort_format_version": _format_version(staging / entries["embed"].path),
            "opset": opset, "optimization": OPTIMIZATION, "embed": entries["embed"],
            "head": entries["head"], "blocks": [entries[p.name] for p in parts if p.layers], "layers": layers,
            "layers_per_block": layers_per_block,
            "resident_bytes": entries["embed"].bytes + entries["head"].bytes, "cache": cache,
            "operators_config": config}


def ort_operators(ort_file: Path) -> set[str]:
    """The op types of an .ort file's nodes (read with onnxruntime's own flatbuffers bindings)."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.InferenceSession import InferenceSession

    graph = InferenceSession.GetRootAsInferenceSession(ort_file.read_bytes(), 0).Model().Graph()
    return {graph.Nodes(i).OpType().decode() for i in range(graph.NodesLength())}


def _format_version(ort_file: Path) -> str:
    """The ORT format version an .ort file declares (read with onnxruntime's own flatbuffers bindings)."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.InferenceSession import InferenceSession

    return InferenceSession.GetRootAsInferenceSession(ort_file.read_bytes(), 0).OrtVersion().decode()


def _tokenizer(hf_dir: Path, folder: Path) -> None:
    """tokenizer.json as transformers configures it (post-processor included), for the `tokenizers` library alone
    on the device; checked to encode as AutoTokenizer does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder.mkdir()
    auto = AutoTokenizer.from_pretrained(hf_dir)
    auto.backend_tokenizer.save(str(folder / "tokenizer.json"))
    for name in TOKENIZER_FILES:
        if name != "tokenizer.json" and (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, folder / name)
    alone = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for probe in ("ROMEO:", "Hello, world! 123", "  spaced\nlines\tand tabs", "naïve café"):
        if alone.encode(probe).ids != auto(probe)["input_ids"]:
            raise StageFailed(f"the tokenizers library encodes {probe!r} unlike transformers' AutoTokenizer for "
                              f"{hf_dir}: the package's tokenizer would not match the model")


def _parity(decoder: Path, staging: Path, manifest: EdgePackage, vocab: int) -> tuple[EdgeParity, bool]:
    """The package (every block open) against the unsplit decoder graph in onnxruntime: the last position's logits
    on an 11-token prefill and 3 single-token steps, then GREEDY_PROBE greedy tokens from a 5-token prompt; and
    whether its head may run on the last position alone (the same logits as on the whole prompt)."""
    from dstool.onnx_export import empty_cache, ort_session, run_decoder  # noqa: PLC0415 (dstool.onnx_export imports torch)

    full = ort_session(decoder)
    package = EdgeModel(staging, manifest=manifest)
    ids = np.random.default_rng(1).integers(0, vocab, (1, 14))
    package.last_position_head = False
    whole = package.forward(ids[:, :11], package.empty_cache(), 0)[0]
    package.last_position_head = True
    last_only = package.forward(ids[:, :11], package.empty_cache(), 0)[0]
    # a head that quantizes its input with one scale over the whole tensor gives other logits on the last position
    # alone, even where one probe happens to agree (measured: an int8 head's DynamicQuantizeMatMul agreed on the
    # probe and differed by 0.019 on another prompt): such a head always runs on every position
    mixing = sorted(ort_operators(staging / manifest.head.path) & POSITION_MIXING)
    package.last_position_head = not mixing and bool(np.abs(whole - last_only).max() <= 1e-6)

    def unsplit(ids: np.ndarray, past: dict, past_len: int) -> tuple[np.ndarray, dict]:
        logits, grown = run_decoder(full, ids, past, past_len)
        return logits[0, -1], grown

    diffs = []
    past, ref_past = package.empty_cache(), empty_cache(full, 1)
    for start, end in ((0, 11), (11, 12), (12, 13), (13, 14)):
        got, past = package.forward(ids[:, start:end], past, start)
        ref, ref_past = unsplit(ids[:, start:end], ref_past, start)
        diffs.append(float(np.abs(got - ref).max()))
    if not max(diffs) <= TOLERANCE:
        raise StageFailed(f"the edge package disagrees with the unsplit decoder graph: max |logit diff| "
                          f"{max(diffs):.3g} > {TOLERANCE}")
    shapes = {name: (heads, size) for name, (heads, size) in manifest.cache.items()}
    mine, theirs = (_greedy(runner, shapes, ids[0, :5].tolist()) for runner in (package, full))
    if mine != theirs:
        raise StageFailed(f"the edge package's greedy tokens {mine} differ from the unsplit decoder graph's {theirs}")
    return EdgeParity(max_abs_logit_diff=max(diffs), greedy_tokens=len(mine)), package.last_position_head


def _greedy(runner, cache_shapes: dict, prompt: list[int]) -> list[int]:
    """GREEDY_PROBE greedy tokens of `runner` (the package, or the unsplit graph's session) on dstool's decode loop."""
    probe = Sequence("probe", prompt, GREEDY_PROBE, lambda logits, _p, _o: int(np.argmax(logits)), set())
    engine = Engine(runner, cache_shapes, max_batch=1, max_prefill_tokens=len(prompt))
    engine.add(probe)
    while engine.busy:
        engine.step()
    if probe.error:
        raise StageFailed(f"the edge package's greedy probe failed: {probe.error}")
    return probe.output
