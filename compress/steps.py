"""The compression steps as objects (`dstool.steps.Step`, as the rest of dstool runs them): `plan` lists the ones a
config asks for, in order. What a step hands to a later one lives in `Work` (the model as it goes, the recipe, the
graphs, the figures); what only a step and its own gate use lives in that step.

Each step says what it reads and writes:
  Baseline      reads the input model               writes work.baseline (its fp32 graphs and figures)
  Prune         reads work.model, calibration       writes work.model (smaller), recipe.pruning
  Sparsify*     reads work.model                    writes work.model (masked), work.masks, recipe.sparsity
  Save          reads work.model                    writes model/                      gate: it reloads the same
  Recover       reads model/, work.masks            writes model/, work.model, recipe.recovery
  Export        reads work.model, work.baseline     writes onnx/ (fp32), work.fp32, work.deploy
  Quantize      reads work.deploy                   writes the quantized graphs, work.deploy, recipe.quantization
  Store         reads model/, work.deploy           writes them sparse, recipe.sparsity.storage  gate: same logits
  Measure       reads work.deploy, work.baseline    writes work.figures                gate: --speed-gate
  Write         reads all of it                     writes dstool.json, report.md / report.png
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

from dstool import artifacts, fused_decoder, logits_graph
from dstool import log as dlog
from dstool.artifacts import (
    SPEED_FIGURES,
    CompressedModel,
    Figures,
    Graph,
    Int8Trial,
    LayerRemoval,
    Measured,
    PruneCandidate,
    Pruning,
    Quantization,
    Recipe,
    Recovery,
    SourceModel,
    SparseStorage,
    Sparsity,
    TorchaoFigures,
)
from dstool.compress import baseline, gptq, measure, prune, quality, quantize, report, sparse
from dstool.compress.baseline import Baseline
from dstool.compress.config import CompressConfig
from dstool.errors import StageFailed, UsageError
from dstool.files import sha256_file
from dstool.fused_decoder import export_fused_decoder, unsupported
from dstool.onnx_export import (
    OnnxExport,
    empty_cache,
    export_decoder_model,
    export_logits_model,
    ort_session,
    run_decoder,
    run_logits,
)
from dstool.steps import Step
from dstool.train import TrainConfig, read_metrics, train

log = dlog.log
# decoding speed: a DECODE_PROMPT-token prompt prefilled, then DECODE_TOKENS steps timed; the median of at most
# DECODE_REPEATS such generations
DECODE_PROMPT, DECODE_TOKENS, DECODE_REPEATS = 128, 32, 5


@dataclass
class Work:
    """What the steps hand to one another: the input, the model as it goes, and what the manifest will say."""

    cfg: CompressConfig
    src: Path
    stage: Path  # OUTPUT.tmp: what the run writes
    scratch: Path  # removed at the end
    tokenizer: Any
    model: Any
    calib: np.ndarray  # calibration tokens (the training split)
    heldout: np.ndarray  # the tokens the report measures
    heldout_label: str
    cloze: quality.Cloze
    source: SourceModel  # the weights hashed once: the manifest and the baseline's key
    recipe: Recipe = field(default_factory=Recipe)
    baseline: Baseline | None = None
    masks: dict | None = None  # sparsity: {weight name: kept entries}
    fp32: dict[str, OnnxExport] = field(default_factory=dict)  # the result's fp32 graphs, by role
    deploy: dict[str, Path] = field(default_factory=dict)  # the graphs the output serves, by role
    figures: Figures | None = None
    torchao: TorchaoFigures | None = None
    manifest: CompressedModel | None = None

    @classmethod
    def load(cls, cfg: CompressConfig, src: Path, stage: Path, scratch: Path) -> Work:
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        dlog.adopt_libraries()
        calib, heldout, label = measure.heldout_tokens(src, tokenizer, cfg.calibration)
        return cls(cfg, src, stage, scratch, tokenizer, model, calib, heldout, label,
                   quality.cloze_task(tokenizer, heldout), artifacts.source_model(src))

    @property
    def base(self) -> Baseline:
        assert self.baseline is not None, "the baseline step runs first"
        return self.baseline


class CompressStep:
    """One step: `run(work)`, and a `gate(work, result)` that says why the result does not hold (None: it holds)."""

    name = ""
    has_gate = False

    def what(self, cfg: CompressConfig) -> str:
        raise NotImplementedError

    def run(self, work: Work) -> Any:
        raise NotImplementedError

    def gate(self, work: Work, result: Any) -> str | None:
        return None

    def step(self, work: Work) -> Step:
        gate = (lambda result: self.gate(work, result)) if self.has_gate else None
        return Step(self.name, self.what(work.cfg), lambda: self.run(work), gate=gate)


def plan(cfg: CompressConfig) -> list[CompressStep]:
    """The steps `cfg` asks for, in order."""
    steps: list[CompressStep] = [BaselineStep()]
    if cfg.prunes:
        steps.append(Prune())
    if cfg.sparsity_fraction:
        steps.append(SparsifyUnstructured())
    elif cfg.sparsity:
        steps.append(SparsifyNM())
    steps.append(Save(checked=bool(cfg.prunes or cfg.sparsity)))
    if cfg.recover_steps:
        steps.append(Recover())
    steps.append(Export())
    if cfg.bits:
        steps.append(Quantize())
    if cfg.sparsity_fraction:
        steps.append(Store())
    return steps + [Measure(), Write()]


class BaselineStep(CompressStep):
    name = "baseline"

    def what(self, cfg):
        return "the input model to ONNX (fp32, both graphs), measured"

    def run(self, work):
        work.baseline = b = baseline.baseline(work.model, work.src, work.source.weights_sha256, work.heldout,
                                              work.cloze, work.scratch, work.cfg.baseline_cache)
        log.info(f"perplexity {b.figures['perplexity']:.3f} ({work.heldout_label}), cloze accuracy "
                 f"{_share(b.figures['zero_shot_accuracy'])} ({work.cloze.items} items, chance "
                 f"{1 / work.cloze.choices:.0%}), {b.figures['onnx_bytes'] / 1e6:.2f} MB")


class Prune(CompressStep):
    name = "prune"

    def what(self, cfg):
        return "remove attention heads, MLP channels and (MoE) routed experts"

    def run(self, work):
        cfg = work.cfg
        rows = torch.from_numpy(measure.windows(work.calib, 128, 24))
        ranking, selection = rows[:16], rows[16:]
        timed = bool(cfg.prune and cfg.prune_ppl_tolerance)
        timer = _OnnxLayoutTimer(work.scratch, min(cfg.latency_repeats, 10)) if timed else None
        try:  # a ratio this model's layers cannot meet is bad input
            if cfg.prune:
                result = prune.prune_to_ratio(work.model, cfg.prune, calibration=ranking, selection=selection,
                                              timer=timer, ppl_tolerance=cfg.prune_ppl_tolerance / 100)
            else:
                result = prune.prune_structured(work.model, cfg.prune_heads or 0.0, cfg.prune_mlp or 0.0,
                                                calibration=ranking, experts_ratio=cfg.prune_experts or 0.0)
        except ValueError as e:
            raise UsageError(str(e)) from None
        rule = "given-ratios" if not cfg.prune else "fastest-within-tolerance" if timed else "lowest-loss"
        work.recipe.pruning = p = Pruning(
            rule=rule, target_ratio=cfg.prune, ppl_tolerance_pct=cfg.prune_ppl_tolerance if timed else 0.0,
            kv_heads=(result.kv_heads_before, result.kv_heads_after),
            query_heads=(result.heads_before, result.heads_after),
            mlp_channels=(result.intermediate_before, result.intermediate_after),
            attention="mla" if result.experts else "gqa", experts=result.experts,
            expert_channels=result.expert_channels, shared_expert_channels=result.shared_expert_channels,
            decoder_fraction_removed=result.decoder_fraction_removed,
            total_fraction_removed=1 - result.params_after / result.params_before,
            removed=[LayerRemoval(**r) for r in result.removed],
            candidates=[PruneCandidate(**c) for c in result.candidates])
        log.info(f"{p.decoder_fraction_removed:.1%} of decoder-layer parameters removed "
                 f"({p.total_fraction_removed:.1%} of all): per layer " + report.layout_text(p) + f" ({rule} layout)")


class SparsifyNM(CompressStep):
    name = "sparsity"

    def what(self, cfg):
        return f"{cfg.sparsity} magnitude masks on the decoder's Linear weights"

    def run(self, work):
        pattern = work.cfg.sparsity or "2:4"  # this step runs only with --sparsity
        n, m = map(int, pattern.split(":"))
        try:  # a width pruning left that M does not divide (the input's were checked up front)
            work.masks = masks = sparse.apply_n_m_sparsity(work.model, n, m)
        except ValueError as e:
            raise UsageError(f"{e} (after pruning)") from None
        try:
            sparse.check_n_m(work.model, masks, n, m)
        except AssertionError as e:
            raise StageFailed(f"N:M masks: {e}") from None
        work.recipe.sparsity = s = Sparsity(pattern=pattern, n=n, m=m, weights=len(masks),
                                            sparse_kernels=_semi_structured_available())
        log.info(f"{pattern} masks on {len(masks)} decoder Linear and expert weights (verified); sparse kernels: "
                 + ("used" if s.sparse_kernels else "not used (no GPU semi-structured kernels here), so the latency "
                    "is dense"))


class SparsifyUnstructured(CompressStep):
    name = "sparsity"

    def what(self, cfg):
        return (f"unstructured: the {100 * (cfg.sparsity_fraction or 0):g} % smallest-magnitude entries of each "
                "decoder Linear weight zeroed")

    def run(self, work):
        fraction = work.cfg.sparsity_fraction or 0.0  # this step runs only with a fraction
        work.masks = masks = sparse.apply_unstructured(work.model, fraction)
        params = dict(work.model.named_parameters())
        short = [n for n in masks if int((params[n] == 0).sum()) < sparse.drop_count(fraction, params[n])]
        if short:
            raise StageFailed(f"unstructured masks: {short[0]} holds fewer than {fraction:.0%} zeros")
        decoder, total = sparse.zero_shares(work.model, masks)
        work.recipe.sparsity = s = Sparsity(
            pattern=f"unstructured {fraction:g}", fraction=fraction, weights=len(masks),
            decoder_zero_share=decoder, total_zero_share=total,
            perplexity_masked=measure.perplexity_torch(work.model, work.heldout), sparse_kernels=False)
        log.info(f"{decoder:.1%} of {s.weights} decoder weights (Linear, routed experts) zeroed by magnitude, each "
                 f"matrix on its own ({total:.1%} of all parameters; embeddings, lm_head and norms dense); held-out "
                 f"perplexity {s.perplexity_masked:.3f} before recovery")


class Save(CompressStep):
    """model/: the changed weights saved (gate, when `checked`: transformers reloads them with the same logits), or
    the input copied."""

    name = "save"

    def __init__(self, checked: bool):
        self.has_gate = checked

    def what(self, cfg):
        return "the compressed weights as a Hugging Face folder (model/)"

    def run(self, work):
        if work.recipe.pruning or work.recipe.sparsity:
            work.model.save_pretrained(work.stage / "model", safe_serialization=True)
            work.tokenizer.save_pretrained(work.stage / "model")
        else:
            shutil.copytree(work.src, work.stage / "model", ignore=shutil.ignore_patterns(artifacts.MANIFEST))

    def gate(self, work, result):
        reloaded = AutoModelForCausalLM.from_pretrained(work.stage / "model", dtype=torch.float32).eval()
        diff = logit_diff(reloaded, work.model)
        return None if diff <= 1e-4 else f"the saved model reloads differently (max |logit diff| {diff:.3g})"


class Recover(CompressStep):
    """Fine-tune the saved model with the `dstool train` engine (optionally distilling from the original's logits).
    Kept only if it lowers the calibration perplexity; otherwise the weights before it stay."""

    name = "recover"

    def what(self, cfg):
        return (f"fine-tune {cfg.recover_steps} steps with the dstool training engine"
                + (", distilling from the original" if cfg.distill else ""))

    def run(self, work):

        cfg, folder = work.cfg, work.stage / "model"
        run = work.scratch / "recover"
        with dlog.details_to_file():  # the training engine's own lines: in the log
            result = train(recovery_train_config(folder, run, cfg.recover_steps, cfg.recover_lr, cfg.calibration,
                                                 keep_zero_weights=work.masks is not None,
                                                 distill_from=work.src if cfg.distill else None))
        kl = [r["distill_kl"] for r in read_metrics(run) if "distill_kl" in r] if cfg.distill else []
        recovered = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32).eval()
        # Calibration tokens come from the training split, never from the held-out split the report measures.
        before, after = (measure.perplexity_torch(m, work.calib, limit=24) for m in (work.model, recovered))
        kept = after < before
        work.recipe.recovery = Recovery(steps=cfg.recover_steps, lr=cfg.recover_lr, distill=cfg.distill, kept=kept,
                                        calibration_ppl_before=before, calibration_ppl_after=after,
                                        final_train_loss=result.train_loss,
                                        distill_kl=(kl[0], kl[-1]) if kl else None)
        if not kept:
            log.warning(f"recovery discarded: it raised the calibration perplexity {before:.3f} -> {after:.3f}; "
                        f"the weights before it are kept (a lower --recover-lr than {cfg.recover_lr:g} may help)")
            return
        log.info(f"recovery kept: calibration perplexity {before:.3f} -> {after:.3f}")
        for f in result.model_dir.iterdir():
            if f.name != artifacts.MANIFEST:
                shutil.copy2(f, folder / f.name)
        work.model = recovered


class Export(CompressStep):
    name = "export"

    def what(self, cfg):
        return ("the result to ONNX: logits graph, key/value-cache decoder and (Llama layouts) the fused-attention "
                "decoder, each parity-checked")

    def run(self, work):
        r = work.recipe
        if r.pruning or r.sparsity or (r.recovery and r.recovery.kept):
            decoder = export_decoder_model(work.model, work.stage / "onnx" / "decoder")
            work.fp32 = {"logits": logits_graph.from_decoder(work.model, decoder, work.stage / "onnx" / "logits"),
                         "decoder": decoder}
        else:  # the weights are the input's: its baseline graphs are these (parity-checked when they were made)
            for role, e in (("logits", work.base.logits), ("decoder", work.base.decoder)):
                shutil.copytree(e.path.parent, work.stage / "onnx" / role)
                work.fp32[role] = dataclasses.replace(e, path=work.stage / "onnx" / role / e.path.name)

        if why := unsupported(work.model.config):
            log.info(f"no fused-attention decoder ({why}): NAME_llm will run the decoder graph")
        else:
            work.fp32["fused"] = export_fused_decoder(work.model, work.stage / "onnx" / "fused")
        work.deploy = {role: e.path for role, e in work.fp32.items()}
        log.info("max |logit diff| to PyTorch: " + ", ".join(f"{role} {e.max_abs_diff:.2e}"
                                                            for role, e in work.fp32.items()))


class Quantize(CompressStep):
    name = "quantize"

    def __init__(self) -> None:
        self.codes: dict[str, gptq.BlockCodes] | None = None  # --int4 gptq: the codes of the decoder's weights

    def what(self, cfg):
        return f"{cfg.bits}-bit ({cfg.engine}), the same weights recipe on both graphs"

    def run(self, work):
        cfg = work.cfg
        if cfg.engine == "torchao":
            work.torchao = _torchao_int8(work.stage / "model", work.model, work.heldout, work.stage / "torchao")
            work.recipe.quantization = Quantization(bits=8, engine="torchao", format="torchao-int8-dynamic",
                                                    weight_type="int8", activation_type="int8 dynamic",
                                                    torchao_folder="torchao")
            return
        logits, decoder = work.deploy["logits"], work.deploy["decoder"]
        for path in (logits, decoder):  # MoE: each routed expert's weights their own initializers, so they quantize
            quantize.fold_weight_constants(path)
        if cfg.bits == 8 and cfg.int8 == "dynamic":
            q_logits, q_decoder = self._int8_dynamic(work, logits, decoder)
        else:
            q_logits, q_decoder = self._weight_only(work, logits, decoder)
        quantized = {"logits": q_logits, "decoder": q_decoder}
        if "fused" in work.deploy and (q_fused := self._fused(work, work.deploy["fused"])):
            quantized["fused"] = q_fused
        for path in quantized.values():
            _gate_integer_ops(path)
        vocab = work.model.config.vocab_size
        q = work.recipe.quantization
        assert q is not None
        mixed = q.accuracy_level is not None  # activations quantized per block, as they come
        if mixed and q.bits == 4:  # the logits graph computes in fp32: the decoder's twin that does too must agree
            twin = self._decoder_twin(work, decoder)
            inner = quantize.decoder_prefill_diff(q_logits, q_decoder, vocab)
            diff, limit = quantize.decoder_prefill_diff(q_logits, twin, vocab), quantize.PREFILL_TOLERANCE
            twin.unlink()
            Path(str(twin) + ".data").unlink(missing_ok=True)
            log.info(f"the decoder's prefill computed in int8 is {inner:.3g} from the logits graph's in fp32 (max "
                     f"|logit diff|, random tokens); with the same weights in fp32, {diff:.3g}")
        else:
            diff = quantize.decoder_prefill_diff(q_logits, q_decoder, vocab)
            limit = quantize.MIXED_COMPUTE_TOLERANCE if mixed else quantize.PREFILL_TOLERANCE
        if diff > limit:
            raise StageFailed(f"the quantized decoder's prefill disagrees with the quantized logits graph (max |logit "
                              f"diff| {diff:.3g} > {limit})")
        if "fused" in quantized:
            errors = quantize.fused_prefill_errors(work.deploy["decoder"], q_decoder, quantized["fused"], vocab)
            if not quantize.fused_holds_the_recipe(*errors):  # an optimisation that does not hold: served without it
                log.warning(f"the quantized fused-attention decoder's prefill is further from fp32 than the quantized "
                            f"decoder's (max |logit diff| {errors[1]:.3g} against {errors[0]:.3g}): left out, NAME_llm "
                            "will run the decoder graph")
                del quantized["fused"]
                shutil.rmtree(work.deploy.pop("fused").parent)
        for path in work.deploy.values():  # the quantized files are the artefact
            path.unlink()
            Path(str(path) + ".data").unlink(missing_ok=True)
        work.deploy = quantized

    def _decoder_twin(self, work: Work, decoder: Path) -> Path:
        """The fp32 decoder graph quantized as the decoder was, computing in fp32 as the 4-bit logits graph does."""
        q = work.recipe.quantization
        assert q is not None and q.block_size is not None
        twin = work.scratch / "decoder-fp32-compute.onnx"
        if self.codes is not None:
            return quantize.quantize_nbits_precomputed(decoder, twin, q.block_size, self.codes)[0]
        return quantize.quantize_nbits(decoder, twin, q.bits, q.block_size, q.bits == 8)

    def _fused(self, work: Work, fused: Path) -> Path | None:
        """The fused-attention decoder with the decoder's recipe (None where that recipe has no fused form)."""
        q = work.recipe.quantization
        assert q is not None
        if q.format.endswith("matmulnbits"):
            assert q.block_size is not None
            if self.codes is not None:
                path, q.gptq_weights["fused"] = quantize.quantize_nbits_precomputed(
                    fused, fused.with_name("model.int4.onnx"), q.block_size, self.codes, q.accuracy_level)
                return path
            return quantize.quantize_nbits(fused, fused.with_name(f"model.int{q.bits}.onnx"), q.bits, q.block_size,
                                           q.bits == 8, q.accuracy_level)
        if q.activation_matmuls:  # the fused op computes attention scores in fp32: not the recipe measured
            log.info("int8: no fused-attention decoder (the recipe quantizes the attention-score MatMuls, which the "
                     "fused attention op computes in fp32): NAME_llm will run the decoder graph")
            return None
        q.fp32_nodes["fused"] = nodes = quantize.fused_nodes(fused, q.fp32_layers)
        choice = quantize.Int8Choice(vnni=bool(q.cpu_vnni), reduce_range=bool(q.reduce_range),
                                     per_channel=bool(q.per_channel), excluded_nodes=nodes, fp32_layers=q.fp32_layers)
        return quantize.quantize_int8(fused, fused.with_name("model.int8.onnx"), choice)

    @staticmethod
    def _int8_dynamic(work: Work, logits: Path, decoder: Path) -> tuple[Path, Path]:
        cfg = work.cfg
        choice, trials = quantize.choose_int8_exclusions(
            logits, work.scratch, work.calib, measure.perplexity_onnx(logits, work.calib), cfg.max_ppl_increase / 100,
            work.model.config.num_hidden_layers)
        decoder_nodes = quantize.same_weight_nodes(logits, choice.excluded_nodes, decoder)
        q_logits = quantize.quantize_int8(logits, logits.with_name("model.int8.onnx"), choice)
        q_decoder = quantize.quantize_int8(decoder, decoder.with_name("model.int8.onnx"),
                                           choice.with_excluded(decoder_nodes))
        work.recipe.quantization = Quantization(
            bits=8, engine="onnxruntime", format="int8-dynamic-qoperator", weight_type=choice.weight_type,
            activation_type=choice.activation_type, per_channel=choice.per_channel, reduce_range=choice.reduce_range,
            cpu_vnni=choice.vnni, activation_matmuls=choice.activation_matmuls, fp32_layers=choice.fp32_layers,
            fp32_nodes={"logits": choice.excluded_nodes, "decoder": decoder_nodes},
            trials=[Int8Trial(**t) for t in trials])
        log.info(f"int8: weights {choice.weight_type} per-channel, reduce_range={choice.reduce_range} (CPU VNNI: "
                 f"{choice.vnni}), activation MatMuls {'int8' if choice.activation_matmuls else 'fp32'}, kept in "
                 f"fp32: {', '.join(choice.fp32_layers) or 'nothing'}")
        return q_logits, q_decoder

    def _weight_only(self, work: Work, logits: Path, decoder: Path) -> tuple[Path, Path]:
        # int8 symmetric, 4-bit asymmetric (measured the better on a real model: docs/real-model.md). The decoder
        # (generation, a token per step) computes in whichever of fp32 and int8 decodes faster on this CPU, measured;
        # the 4-bit logits graph (scoring, long sequences) in fp32, the int8 one as the decoder (fp32 compute on 8-bit
        # weights is slower than the fp32 graph itself: docs/real-model.md).
        bits, block = work.cfg.bits or 4, work.cfg.block
        symmetric = bits == 8
        level, step_ms = quantize.choose_nbits_accuracy(decoder, work.scratch, work.model.config.vocab_size, bits,
                                                        block, symmetric)
        work.recipe.quantization = q = Quantization(
            bits=bits, engine="onnxruntime", format=f"int{bits}-matmulnbits",
            weight_type=f"int{bits} {'symmetric' if symmetric else 'asymmetric'}", block_size=block,
            accuracy_level=level, decoding_step_ms=step_ms, method=work.cfg.int4 if bits == 4 else None)
        if q.method == "gptq":
            started = time.perf_counter()
            try:
                self.codes = gptq.quantize_model(work.model, work.calib, block)
            except ValueError as e:  # too little calibration text
                raise UsageError(f"--int4 gptq: {e}; give more --calibration text") from None
            q.gptq_seconds = time.perf_counter() - started
            q.calibration_tokens = min(len(work.calib) // gptq.SEQ_LEN, gptq.WINDOWS) * gptq.SEQ_LEN
            q_logits, q.gptq_weights["logits"] = quantize.quantize_nbits_precomputed(
                logits, logits.with_name("model.int4.onnx"), block, self.codes)
            q_decoder, q.gptq_weights["decoder"] = quantize.quantize_nbits_precomputed(
                decoder, decoder.with_name("model.int4.onnx"), block, self.codes, level)
            if q.gptq_weights["logits"] != q.gptq_weights["decoder"] or not q.gptq_weights["logits"]:
                raise StageFailed(f"GPTQ's codes reached {q.gptq_weights['logits']} MatMuls of the logits graph and "
                                  f"{q.gptq_weights['decoder']} of the decoder graph: the graphs do not hold the "
                                  "model's weights")
        else:
            q_logits = quantize.quantize_nbits(logits, logits.with_name(f"model.int{bits}.onnx"), bits, block,
                                               symmetric, level if bits == 8 else None)
            q_decoder = quantize.quantize_nbits(decoder, decoder.with_name(f"model.int{bits}.onnx"), bits, block,
                                                symmetric, level)
        log.info(f"{bits}-bit weight-only, group {block}: the decoder computes in {'int8' if level else 'fp32'}, "
                 f"measured faster per decoding step here ({', '.join(f'{k} {v:.2f} ms' for k, v in step_ms.items())})")
        return q_logits, q_decoder


class Store(CompressStep):
    """model/ and the fp32 graphs rewritten with their sparse tensors as bitmask + nonzero values (quantized graphs
    hold their own integer weights and stay as they are). Gate: the masks held through recovery, and the stored
    folder and graphs give the dense ones' logits."""

    name = "store"
    has_gate = True

    def __init__(self) -> None:
        self.dense_outputs: dict[str, np.ndarray] = {}  # the fp32 graphs' logits, before storing
        self.encoded_entries: dict[str, int] = {}  # how many weight entries each file stores as bitmask + values

    def what(self, cfg):
        return "the sparse weights as a bitmask and the nonzero values (model/, fp32 graphs)"

    def run(self, work):
        folder = work.stage / "model"
        model_dense = measure.safetensors_bytes(folder)
        encoded = {"model": sparse.save_folder(folder)}
        dense, stored = {}, {}
        ids = np.random.default_rng(4).integers(0, work.model.config.vocab_size, (2, 19))
        for role, path in work.deploy.items():
            dense[role] = measure.onnx_bytes(path)
            if path == work.fp32[role].path:
                self.dense_outputs[role] = _graph_logits(role, path, ids)
                encoded[role] = sparse.encode_onnx(path)
            stored[role] = measure.onnx_bytes(path)
        s = work.recipe.sparsity
        assert s is not None  # this step runs after SparsifyUnstructured
        s.decoder_zero_share, s.total_zero_share = sparse.zero_shares(work.model, work.masks or {})
        self.encoded_entries = {k: sum(v.values()) for k, v in encoded.items()}
        s.storage = SparseStorage(model_bytes=measure.safetensors_bytes(folder), model_dense_bytes=model_dense,
                                  onnx_bytes=stored, onnx_dense_bytes=dense,
                                  encoded={k: len(v) for k, v in encoded.items()})
        log.info(f"stored sparse: model/ {s.storage.model_bytes / model_dense:.3f}x of fp32 safetensors, "
                 + ", ".join(f"{role} graph {stored[role] / dense[role]:.3f}x" for role in stored)
                 + " (ONNX Runtime rebuilds the dense weights when it loads a graph: dense kernels)")

    def gate(self, work, result):
        masks, storage = work.masks or {}, work.recipe.sparsity.storage if work.recipe.sparsity else None
        if storage is None:
            return "nothing was stored sparse"
        if problem := sparse.masks_held(work.model, masks):
            return f"recovery did not hold the sparsity masks ({problem})"
        masked = sum(mask.numel() for mask in masks.values())
        if (work.cfg.sparsity_fraction or 0.0) < sparse.MIN_ZERO_SHARE:  # too few zeros to store smaller
            masked = 0
        wrong = {k: v for k, v in self.encoded_entries.items() if v != masked}
        if wrong:
            return f"expected the {masked:,} masked entries stored as bitmask + values, found {wrong}"
        diff = logit_diff(sparse.load(work.stage / "model"), work.model)
        if diff > 1e-5:
            return f"the sparse model/ loads back differently (max |logit diff| {diff:.3g})"
        for role, ref in self.dense_outputs.items():
            ids = np.random.default_rng(4).integers(0, work.model.config.vocab_size, ref.shape[:2])
            diff = float(np.abs(_graph_logits(role, work.deploy[role], ids) - ref).max())
            if diff > 1e-5:
                return f"the sparse {role} graph gives other logits than the dense one (max diff {diff:.3g})"
        return None


class Measure(CompressStep):
    """Held-out quality, prefill latency and decoding speed, before against after. Gate (opt-in, --speed-gate): a
    quantized model not slower than fp32 on that figure."""

    name = "measure"
    has_gate = True

    def what(self, cfg):
        return "held-out quality, ONNX Runtime prefill latency and decoding speed, before against after"

    def run(self, work):
        base = work.base
        after, after_top1 = baseline.measured(work.deploy["logits"], work.model, work.heldout, work.cloze)
        figures = {"before": dict(base.figures), "after": after}
        vocab, repeats = work.model.config.vocab_size, work.cfg.latency_repeats
        for batch in (1, 8):
            ms = measure.latency_ms([base.logits.path, work.deploy["logits"]], vocab, batch, repeats=repeats)
            figures["before"][f"latency_ms_batch{batch}"], figures["after"][f"latency_ms_batch{batch}"] = ms
        for batch in (1, 16):
            tps = measure.decode_tokens_per_s([base.decoder.path, work.deploy["decoder"]], vocab, batch,
                                              DECODE_PROMPT, DECODE_TOKENS, repeats=min(repeats, DECODE_REPEATS))
            figures["before"][f"decode_tokens_per_s_batch{batch}"] = tps[0]
            figures["after"][f"decode_tokens_per_s_batch{batch}"] = tps[1]
        b, a = (Measured(**figures[k]) for k in ("before", "after"))
        work.figures = f = Figures(
            before=b, after=a, compression_ratio=a.onnx_bytes / b.onnx_bytes,
            perplexity_change_pct=100 * (a.perplexity / b.perplexity - 1),
            top1_agreement=measure.top1_agreement(base.top1, after_top1), zero_shot_items=work.cloze.items,
            zero_shot_choices=work.cloze.choices,
            speedup={"1": b.latency_ms_batch1 / a.latency_ms_batch1, "8": b.latency_ms_batch8 / a.latency_ms_batch8},
            decode_speedup={"1": a.decode_tokens_per_s_batch1 / b.decode_tokens_per_s_batch1,
                            "16": a.decode_tokens_per_s_batch16 / b.decode_tokens_per_s_batch16},
            recovery=recovery(b, a), min_recovery=work.cfg.min_recovery,
            decode_prompt_len=DECODE_PROMPT, decode_new_tokens=DECODE_TOKENS, speed_target=work.cfg.speed_gate,
            latency_seq_len=128, heldout=work.heldout_label,
            machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, onnxruntime CPU provider")
        log.info(f"size {f.compression_ratio:.3f}x, perplexity {b.perplexity:.3f} -> {a.perplexity:.3f}, top-1 "
                 f"agreement {f.top1_agreement:.1%}, cloze {_share(b.zero_shot_accuracy)} -> "
                 f"{_share(a.zero_shot_accuracy)}; prefill batch 8 {b.latency_ms_batch8:.1f} -> "
                 f"{a.latency_ms_batch8:.1f} ms; decoding tokens/s batch 1 {b.decode_tokens_per_s_batch1:.0f} -> "
                 f"{a.decode_tokens_per_s_batch1:.0f}, batch 16 {b.decode_tokens_per_s_batch16:.0f} -> "
                 f"{a.decode_tokens_per_s_batch16:.0f}")
        return f

    def gate(self, work, result):
        return quality_gate(result) or speed_gate(work.cfg, result)


class Write(CompressStep):
    name = "write"

    def what(self, cfg):
        return "the manifest (dstool.json) and report.md / report.png"

    def run(self, work):
        assert work.figures is not None  # Measure ran
        graphs = {role: _graph(work.stage, path, work.fp32[role].max_abs_diff) for role, path in work.deploy.items()}
        work.manifest = m = CompressedModel(
            source=work.source, settings=work.cfg.model_dump(mode="json"), graphs=graphs, recipe=work.recipe,
            figures=work.figures, torchao=work.torchao)
        report.write(m, work.stage)
        m.write(work.stage)


def recovery(before: Measured, after: Measured) -> dict[str, float]:
    """The result's quality as a % of the input's, per measure (the cloze only where the input scores above 0)."""
    out = {"perplexity": 100 * before.perplexity / after.perplexity}
    if before.zero_shot_accuracy and after.zero_shot_accuracy is not None:
        out["cloze"] = 100 * after.zero_shot_accuracy / before.zero_shot_accuracy
    return out


def quality_gate(figures: Figures) -> str | None:
    """--min-recovery: why the result keeps too little of the input's held-out perplexity (None: it keeps enough, or
    no gate). Only perplexity gates: the cloze task's 200 items move 0.7 % of recovery an item, noise at this bar."""
    kept = figures.recovery.get("perplexity", 100.0)
    if figures.min_recovery is None or kept >= figures.min_recovery:
        return None
    return (f"keeps too little of the input's quality: held-out perplexity recovery {kept:.2f} % < --min-recovery "
            f"{figures.min_recovery:g} %")


def speed_gate(cfg: CompressConfig, figures: Figures) -> str | None:
    """With --speed-gate FIGURE (opt-in: timing on a busy machine is noise a default must not fail on), a quantized
    model measured slower than fp32 on that figure fails the run."""
    if cfg.speed_gate is None or not cfg.bits or cfg.engine != "onnxruntime":
        return None
    speedup, what = figures.speedup_on(cfg.speed_gate)
    if speedup < 1:
        others = "|".join(t for t in SPEED_FIGURES if t != cfg.speed_gate)
        return (f"the {cfg.bits}-bit model measured slower than fp32 in {what} ({speedup:.2f}x, --speed-gate "
                f"{cfg.speed_gate}), so it was not written to the output; leave --speed-gate out to keep it anyway, "
                f"or gate on {others} if that is what it will serve")
    return None


def recovery_train_config(model_dir: Path, output: Path, steps: int, lr: float, data: str | None = None,
                          keep_zero_weights: bool = False, distill_from: Path | None = None):
    """The `dstool train` settings of the recovery fine-tuning: one rank, ZeRO-0, `steps` steps at peak `lr`
    (warm-up, cosine decay) on `data` (the embedded corpus when None)."""
    return TrainConfig(model=str(model_dir), data=data, output=str(output), nproc=1, zero=0, max_steps=steps,
                       save_every=steps, lr=lr, keep_zero_weights=keep_zero_weights, tensorboard=False,
                       distill_from=str(distill_from) if distill_from else None, log_every=max(1, steps // 5))


@torch.no_grad()
def logit_diff(model, reference) -> float:
    """The parity check of a model written and read back (a saved folder, the sparse storage, torchao's folder):
    max |logit diff| to `reference` on the same 2 x 24 random token ids."""
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    return (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _graph(stage: Path, path: Path, parity: float) -> Graph:
    proto = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in proto.initializer}
    data = Path(str(path) + ".data")
    return Graph(path=str(path.relative_to(stage)), data=str(data.relative_to(stage)) if data.exists() else None,
                 sha256=sha256_file(path), inputs=[i.name for i in proto.input if i.name not in inits],
                 outputs=[o.name for o in proto.output], fp32_parity=parity)


def _graph_logits(role: str, path: Path, ids: np.ndarray) -> np.ndarray:
    """The logits of a logits graph, or of a decoder graph's prefill on an empty cache."""
    session = ort_session(path)
    if role == "logits":
        return run_logits(session, ids)
    if role == "fused":
        return fused_decoder.prefill(session, ids)
    return run_decoder(session, ids, empty_cache(session, len(ids)), 0)[0]


class _OnnxLayoutTimer:
    """prune.LayoutTimer on the deployed engine: each trial is exported to ONNX (then freed), and all are timed
    interleaved at batch 8 x 128 on ONNX Runtime, the report's latency figure."""

    def __init__(self, scratch: Path, repeats: int):
        self.folder, self.repeats, self.vocab = scratch / "layouts", repeats, 0
        self.paths: list[Path] = []

    def add(self, trial) -> None:
        self.vocab = trial.config.vocab_size
        self.paths.append(export_logits_model(trial, self.folder / str(len(self.paths))).path)

    def latencies_ms(self) -> list[float]:
        try:
            return measure.latency_ms(self.paths, self.vocab, 8, repeats=self.repeats)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def _semi_structured_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def _gate_integer_ops(path: Path) -> None:
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    if not ops & {"MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLinear", "MatMulNBits"}:
        raise StageFailed(f"quantized graph {path.name} holds no integer ops ({sorted(ops)})")
    measure.ort_session(path)  # loads in ONNX Runtime


def _torchao_int8(model_dir: Path, model, heldout, folder: Path) -> TorchaoFigures:
    """PyTorch-side int8: transformers' TorchAoConfig with torchao's Int8DynamicActivationInt8WeightConfig
    (decoder Linear layers; embeddings and lm_head stay fp32, transformers' default), saved as a Hugging Face
    folder that `AutoModelForCausalLM.from_pretrained(folder)` reloads quantized. Gate: the reloaded model holds
    int8 weights and gives the quantized model's logits."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig  # noqa: PLC0415 (torchao: only for the PyTorch-side int8 figures; it warns at import)

    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=TorchAoConfig(Int8DynamicActivationInt8WeightConfig())).eval()
    quantized.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    int8 = [name for name, p in reloaded.named_parameters() if "Int8" in type(p).__name__]
    diff = logit_diff(reloaded, quantized)
    if not int8 or diff > 1e-4:
        raise StageFailed(f"torchao folder reloads wrongly ({len(int8)} int8 weights, max |logit diff| {diff:.3g})")
    ppl_fp32, ppl_int8 = measure.perplexity_torch(model, heldout), measure.perplexity_torch(reloaded, heldout)
    fp32_ms, int8_ms = measure.latency_torch_ms([model, reloaded], model.config.vocab_size, batch=8)
    figures = TorchaoFigures(int8_weights=len(int8), bytes=measure.safetensors_bytes(folder),
                             fp32_bytes=measure.safetensors_bytes(model_dir), perplexity_fp32=ppl_fp32,
                             perplexity_int8=ppl_int8, latency_ms_batch8_fp32=fp32_ms, latency_ms_batch8_int8=int8_ms)
    log.info(f"torchao int8 on {len(int8)} Linear weights in {folder.name}/: weights "
             f"{figures.bytes / figures.fp32_bytes:.3f}x, PyTorch perplexity {ppl_fp32:.3f} -> {ppl_int8:.3f}, batch 8 "
             f"x 128 {fp32_ms:.1f} -> {int8_ms:.1f} ms")
    return figures
