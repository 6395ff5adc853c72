"""`compress(config)`: what `dstool compress` does, callable from Python.

A list of steps (`dstool.steps`), each with a correctness gate:
  baseline   fp32 ONNX of the input, both graphs (parity-checked) -> perplexity, top-1 predictions, cloze task, size
  prune      heads / MLP channels removed        gate: transformers reloads the saved folder, same logits
  sparsity   N:M magnitude masks                 gate: every group of M has >= M-N zeros
             or unstructured (a fraction)        gate: every masked weight holds that share of zeros
  recover    fine-tune with the training engine  gate: kept only if it lowers the calibration perplexity
  export     fp32 ONNX of the result: the logits graph and the key/value-cache decoder (parity-checked)
  quantize   int8 dynamic / 4-bit weight-only, the same weights recipe on both graphs
             gate: both hold integer ops, and the decoder's prefill agrees with the logits graph
  store      unstructured sparsity: bitmask + nonzero values in model/ and the fp32 graphs
             gate: the masks held through recovery; both load back to the dense logits
  measure    held-out perplexity, top-1 agreement, cloze accuracy, ONNX Runtime prefill latency and decoding
             tokens/s     gate (opt-in, --speed-gate): quantized must not be slower on that figure
  write      the manifest (dstool.json: graphs, recipe, figures, source) and report.md / report.png
Everything is written to OUTPUT.tmp and renamed into place at the end; a failed run leaves OUTPUT.tmp (with
compress.log) for inspection, and the next run replaces it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from dstool import artifacts, models
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
    SparseStorage,
    Sparsity,
    TorchaoFigures,
)
from dstool.compress import baseline, measure, quality, quantize, report
from dstool.compress.config import CompressConfig
from dstool.errors import StageFailed, UsageError
from dstool.files import replace_folder, sha256_file
from dstool.onnx_export import OnnxExport, export_decoder_model, export_logits_model
from dstool.steps import Step, run_steps

log = dlog.log
# decoding speed: a DECODE_PROMPT-token prompt prefilled, then DECODE_TOKENS steps timed; the median of at most
# DECODE_REPEATS such generations
DECODE_PROMPT, DECODE_TOKENS, DECODE_REPEATS = 128, 32, 5


def _check_input(cfg: CompressConfig) -> Path:
    src = Path(cfg.model)
    if not src.is_dir():
        raise UsageError(f"model {cfg.model} is not a folder: pass a Hugging Face causal-LM folder")
    models.check_model_folder(src)
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file: pass a folder for --output")
    if out.is_dir() and any(out.iterdir()) and artifacts.kind_of(out) != "compressed-model":
        raise UsageError(f"output {out} exists and holds files dstool did not write: choose a new --output")
    _check_modes(cfg, src)
    return src


def _check_modes(cfg: CompressConfig, src: Path) -> None:
    """What the model's architecture and shapes rule out, refused before any work: read from its config (weights
    on the meta device, nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dstool.compress import prune, sparse

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    try:
        if cfg.prunes and not prune.family_of(model).has_experts and cfg.prune_experts:
            raise ValueError(f"--prune-experts removes routed experts, and {type(model).__name__} has none: use "
                             "--prune-heads/--prune-mlp or --prune")
        if cfg.prune and not prune.candidate_layouts(model, cfg.prune):
            raise ValueError(prune.no_layout_message(cfg.prune))
        if cfg.sparsity and ":" in cfg.sparsity:
            n, m = map(int, cfg.sparsity.split(":"))
            sparse.check_n_m_fits(model, n, m)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compress(cfg: CompressConfig) -> CompressedModel:
    """Run the steps; returns the manifest (also written to OUTPUT/dstool.json)."""
    src = _check_input(cfg)
    out = Path(cfg.output)
    stage = out.with_name(out.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    dlog.to_file(stage / "compress.log")
    work = Path(tempfile.mkdtemp(prefix="dstool-compress-"))
    try:
        job = _Compression(cfg, src, stage, work)
        run_steps(job.steps(), "compress")
    except UsageError:
        shutil.rmtree(stage, ignore_errors=True)  # bad input: nothing written
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    replace_folder(stage, out)
    return job.manifest


class _Compression:
    """The state the steps share: the model as it goes, and what the manifest will say."""

    def __init__(self, cfg: CompressConfig, src: Path, stage: Path, work: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.src, self.stage, self.work = cfg, src, stage, work
        self.tokenizer = AutoTokenizer.from_pretrained(src)
        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        dlog.adopt_libraries()
        self.calib, self.heldout, self.heldout_label = measure.heldout_tokens(src, self.tokenizer, cfg.calibration)
        self.cloze = quality.cloze_task(self.tokenizer, self.heldout)
        self.source = artifacts.source_model(src)  # the weights hashed once: the manifest and the baseline's key
        self.recipe = Recipe()
        self.masks: dict | None = None
        self.dense_outputs: dict[str, np.ndarray] = {}  # unstructured sparsity: the fp32 graphs' logits, before storing
        self.encoded_entries: dict[str, int] = {}  # and how many weight entries each file stores as bitmask + values
        self.graphs: dict[str, Graph] = {}
        self.fp32: dict[str, OnnxExport] = {}
        self.torchao: TorchaoFigures | None = None

    def steps(self) -> list[Step]:
        cfg = self.cfg
        structural = bool(cfg.prunes or cfg.sparsity)
        steps = [Step("baseline", "the input model to ONNX (fp32, both graphs), measured", self.baseline)]
        if cfg.prunes:
            steps.append(Step("prune", "remove attention heads, MLP channels and (MoE) routed experts", self.prune))
        if cfg.sparsity_fraction:
            steps.append(Step("sparsity", f"unstructured: the {100 * cfg.sparsity_fraction:g} % smallest-magnitude "
                              "entries of each decoder Linear weight zeroed", self.sparsify_unstructured))
        elif cfg.sparsity:
            steps.append(Step("sparsity", f"{cfg.sparsity} magnitude masks on the decoder's Linear weights",
                              self.sparsify))
        steps.append(Step("save", "the compressed weights as a Hugging Face folder (model/)", self.save,
                          gate=self.reloads if structural else None))
        if cfg.recover_steps:
            steps.append(Step("recover", f"fine-tune {cfg.recover_steps} steps with the dstool training engine"
                              + (", distilling from the original" if cfg.distill else ""), self.recover))
        steps.append(Step("export", "the result to ONNX: logits graph and key/value-cache decoder (parity-checked)",
                          self.export))
        if cfg.bits:
            steps.append(Step("quantize", f"{cfg.bits}-bit ({cfg.engine}), the same weights recipe on both graphs",
                              self.quantize))
        if cfg.sparsity_fraction:
            steps.append(Step("store", "the sparse weights as a bitmask and the nonzero values (model/, fp32 graphs)",
                              self.store, gate=self.stored))
        steps += [Step("measure", "held-out quality, ONNX Runtime prefill latency and decoding speed, before against "
                       "after", self.measure, gate=self.speed),
                  Step("write", "the manifest (dstool.json) and report.md / report.png", self.write)]
        return steps

    # ---- steps ---------------------------------------------------------------------------------------------
    def baseline(self) -> None:
        b = baseline.baseline(self.model, self.src, self.source.weights_sha256, self.heldout, self.cloze, self.work,
                              self.cfg.baseline_cache)
        self.base, self.base_decoder, self.before, self.before_top1 = b.logits, b.decoder, b.figures, b.top1
        log.info(f"perplexity {self.before['perplexity']:.3f} ({self.heldout_label}), cloze accuracy "
                 f"{_share(self.before['zero_shot_accuracy'])} ({self.cloze.items} items, chance "
                 f"{1 / self.cloze.choices:.0%}), {self.before['onnx_bytes'] / 1e6:.2f} MB")

    def prune(self) -> None:
        from dstool.compress import prune

        cfg = self.cfg
        rows = torch.from_numpy(measure.windows(self.calib, 128, 24))
        ranking, selection = rows[:16], rows[16:]
        timed = bool(cfg.prune and cfg.prune_ppl_tolerance)
        timer = _OnnxLayoutTimer(self.work, min(cfg.latency_repeats, 10)) if timed else None
        try:  # a ratio this model's layers cannot meet is bad input
            if cfg.prune:
                result = prune.prune_to_ratio(self.model, cfg.prune, calibration=ranking, selection=selection,
                                              timer=timer, ppl_tolerance=cfg.prune_ppl_tolerance / 100)
            else:
                result = prune.prune_structured(self.model, cfg.prune_heads or 0.0, cfg.prune_mlp or 0.0,
                                                calibration=ranking, experts_ratio=cfg.prune_experts or 0.0)
        except ValueError as e:
            raise UsageError(str(e)) from None
        rule = "given-ratios" if not cfg.prune else "fastest-within-tolerance" if timed else "lowest-loss"
        self.recipe.pruning = p = Pruning(
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

    def sparsify(self) -> None:
        from dstool.compress import sparse

        pattern = self.cfg.sparsity or "2:4"  # this step runs only with --sparsity
        n, m = map(int, pattern.split(":"))
        try:  # a width pruning left that M does not divide (the input's were checked up front)
            self.masks = sparse.apply_n_m_sparsity(self.model, n, m)
        except ValueError as e:
            raise UsageError(f"{e} (after pruning)") from None
        try:
            sparse.check_n_m(self.model, self.masks, n, m)
        except AssertionError as e:
            raise StageFailed(f"N:M masks: {e}") from None
        self.recipe.sparsity = Sparsity(pattern=pattern, n=n, m=m, weights=len(self.masks),
                                        sparse_kernels=_semi_structured_available())
        log.info(f"{self.cfg.sparsity} masks on {len(self.masks)} decoder Linear and expert weights (verified); "
                 "sparse kernels: "
                 + ("used" if self.recipe.sparsity.sparse_kernels else "not used (no GPU semi-structured kernels "
                    "here), so the latency is dense"))

    def sparsify_unstructured(self) -> None:
        from dstool.compress import sparse

        fraction = self.cfg.sparsity_fraction or 0.0  # this step runs only with a fraction
        self.masks = sparse.apply_unstructured(self.model, fraction)
        params = dict(self.model.named_parameters())
        short = [n for n in self.masks if int((params[n] == 0).sum()) < sparse.drop_count(fraction, params[n])]
        if short:
            raise StageFailed(f"unstructured masks: {short[0]} holds fewer than {fraction:.0%} zeros")
        decoder, total = sparse.zero_shares(self.model, self.masks)
        self.recipe.sparsity = s = Sparsity(
            pattern=f"unstructured {fraction:g}", fraction=fraction, weights=len(self.masks),
            decoder_zero_share=decoder, total_zero_share=total,
            perplexity_masked=measure.perplexity_torch(self.model, self.heldout), sparse_kernels=False)
        log.info(f"{decoder:.1%} of {s.weights} decoder weights (Linear, routed experts) zeroed by magnitude, each "
                 f"matrix on its own ({total:.1%} of all parameters; embeddings, lm_head and norms dense); held-out "
                 f"perplexity {s.perplexity_masked:.3f} before recovery")

    def store(self) -> None:
        """model/ and the fp32 graphs rewritten with their sparse tensors as bitmask + nonzero values (quantized
        graphs hold their own integer weights and stay as they are)."""
        from dstool.compress import sparse

        folder = self.stage / "model"
        model_dense = measure.safetensors_bytes(folder)
        encoded = {"model": sparse.save_folder(folder)}
        dense, stored = {}, {}
        ids = np.random.default_rng(4).integers(0, self.model.config.vocab_size, (2, 19))
        for role, path in self.deploy.items():
            dense[role] = measure.onnx_bytes(path)
            if path == self.fp32[role].path:
                self.dense_outputs[role] = _graph_logits(role, path, ids)
                encoded[role] = sparse.encode_onnx(path)
            stored[role] = measure.onnx_bytes(path)
        s = self.recipe.sparsity
        assert s is not None  # this step runs after sparsify_unstructured
        s.decoder_zero_share, s.total_zero_share = sparse.zero_shares(self.model, self.masks or {})
        self.encoded_entries = {k: sum(v.values()) for k, v in encoded.items()}
        s.storage = SparseStorage(model_bytes=measure.safetensors_bytes(folder), model_dense_bytes=model_dense,
                                  onnx_bytes=stored, onnx_dense_bytes=dense,
                                  encoded={k: len(v) for k, v in encoded.items()})
        log.info(f"stored sparse: model/ {s.storage.model_bytes / model_dense:.3f}x of fp32 safetensors, "
                 + ", ".join(f"{role} graph {stored[role] / dense[role]:.3f}x" for role in stored)
                 + " (ONNX Runtime rebuilds the dense weights when it loads a graph: dense kernels)")

    def stored(self, _) -> str | None:
        """The masks held through recovery; the stored folder and graphs give the dense ones' logits."""
        from dstool.compress import sparse

        masks, storage = self.masks or {}, self.recipe.sparsity.storage if self.recipe.sparsity else None
        if storage is None:
            return "nothing was stored sparse"
        if problem := sparse.masks_held(self.model, masks):
            return f"recovery did not hold the sparsity masks ({problem})"
        masked = sum(mask.numel() for mask in masks.values())
        if (self.cfg.sparsity_fraction or 0.0) < sparse.MIN_ZERO_SHARE:  # too few zeros to store smaller
            masked = 0
        wrong = {k: v for k, v in self.encoded_entries.items() if v != masked}
        if wrong:
            return f"expected the {masked:,} masked entries stored as bitmask + values, found {wrong}"
        reloaded = sparse.load(self.stage / "model")
        ids = torch.randint(0, self.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            diff = (reloaded(input_ids=ids).logits - self.model(input_ids=ids).logits).abs().max().item()
        if diff > 1e-5:
            return f"the sparse model/ loads back differently (max |logit diff| {diff:.3g})"
        for role, ref in self.dense_outputs.items():
            ids = np.random.default_rng(4).integers(0, self.model.config.vocab_size, ref.shape[:2])
            diff = float(np.abs(_graph_logits(role, self.deploy[role], ids) - ref).max())
            if diff > 1e-5:
                return f"the sparse {role} graph gives other logits than the dense one (max diff {diff:.3g})"
        return None

    def save(self) -> None:
        if self.recipe.pruning or self.recipe.sparsity:
            self.model.save_pretrained(self.stage / "model", safe_serialization=True)
            self.tokenizer.save_pretrained(self.stage / "model")
        else:
            shutil.copytree(self.src, self.stage / "model", ignore=shutil.ignore_patterns(artifacts.MANIFEST))

    def reloads(self, _) -> str | None:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(self.stage / "model", dtype=torch.float32).eval()
        ids = torch.randint(0, self.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            diff = (reloaded(input_ids=ids).logits - self.model(input_ids=ids).logits).abs().max().item()
        return None if diff <= 1e-4 else f"the saved model reloads differently (max |logit diff| {diff:.3g})"

    def recover(self) -> None:
        """Fine-tune the saved model with the `dstool train` engine (optionally distilling from the original's
        logits). Kept only if it lowers the calibration perplexity; otherwise the weights before it stay."""
        from transformers import AutoModelForCausalLM

        from dstool.train import read_metrics, train

        cfg, folder = self.cfg, self.stage / "model"
        run = self.work / "recover"
        with dlog.details_to_file():  # the training engine's own lines: in the log
            result = train(recovery_train_config(folder, run, cfg.recover_steps, cfg.recover_lr, cfg.calibration,
                                                 keep_zero_weights=self.masks is not None,
                                                 distill_from=self.src if cfg.distill else None))
        kl = [r["distill_kl"] for r in read_metrics(run) if "distill_kl" in r] if cfg.distill else []
        recovered = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32).eval()
        # Calibration tokens come from the training split, never from the held-out split the report measures.
        before, after = (measure.perplexity_torch(m, self.calib, limit=24) for m in (self.model, recovered))
        kept = after < before
        self.recipe.recovery = Recovery(steps=cfg.recover_steps, lr=cfg.recover_lr, distill=cfg.distill, kept=kept,
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
        self.model = recovered

    def export(self) -> None:
        r = self.recipe
        if r.pruning or r.sparsity or (r.recovery and r.recovery.kept):
            self.fp32 = {"logits": export_logits_model(self.model, self.stage / "onnx" / "logits"),
                         "decoder": export_decoder_model(self.model, self.stage / "onnx" / "decoder")}
        else:  # the weights are the input's: its baseline graphs are these (parity-checked when they were made)
            for role, e in (("logits", self.base), ("decoder", self.base_decoder)):
                shutil.copytree(e.path.parent, self.stage / "onnx" / role)
                self.fp32[role] = dataclasses.replace(e, path=self.stage / "onnx" / role / e.path.name)
        self.deploy = {role: e.path for role, e in self.fp32.items()}
        log.info("max |logit diff| to PyTorch: " + ", ".join(f"{role} {e.max_abs_diff:.2e}"
                                                            for role, e in self.fp32.items()))

    def quantize(self) -> None:
        cfg = self.cfg
        if cfg.engine == "torchao":
            self.torchao = _torchao_int8(self.stage / "model", self.model, self.heldout, self.stage / "torchao")
            self.recipe.quantization = Quantization(bits=8, engine="torchao", format="torchao-int8-dynamic",
                                                    weight_type="int8", activation_type="int8 dynamic",
                                                    torchao_folder="torchao")
            return
        logits, decoder = self.deploy["logits"], self.deploy["decoder"]
        for path in (logits, decoder):  # MoE: each routed expert's weights their own initializers, so they quantize
            quantize.fold_weight_constants(path)
        if cfg.bits == 8:
            choice, trials = quantize.choose_int8_exclusions(
                logits, self.work, self.calib, measure.perplexity_onnx(logits, self.calib),
                cfg.max_ppl_increase / 100, self.model.config.num_hidden_layers)
            decoder_nodes = quantize.same_weight_nodes(logits, choice.excluded_nodes, decoder)
            q_logits = quantize.quantize_int8(logits, logits.with_name("model.int8.onnx"), choice)
            decoder_choice = choice.with_excluded(decoder_nodes)
            q_decoder = quantize.quantize_int8(decoder, decoder.with_name("model.int8.onnx"), decoder_choice)
            self.recipe.quantization = Quantization(
                bits=8, engine="onnxruntime", format="int8-dynamic-qoperator", weight_type=choice.weight_type,
                activation_type=choice.activation_type, per_channel=choice.per_channel,
                reduce_range=choice.reduce_range, cpu_vnni=choice.vnni, activation_matmuls=choice.activation_matmuls,
                fp32_layers=choice.fp32_layers, fp32_nodes={"logits": choice.excluded_nodes, "decoder": decoder_nodes},
                trials=[Int8Trial(**t) for t in trials])
            log.info(f"int8: weights {choice.weight_type} per-channel, reduce_range={choice.reduce_range} (CPU VNNI: "
                     f"{choice.vnni}), activation MatMuls {'int8' if choice.activation_matmuls else 'fp32'}, kept in "
                     f"fp32: {', '.join(choice.fp32_layers) or 'nothing'}")
        else:
            # the logits graph (scoring, long sequences) computes in fp32; the decoder (generation, a token per
            # step) in whichever compute decodes faster on this CPU, measured
            level, step_ms = quantize.choose_int4_accuracy(decoder, self.work, self.model.config.vocab_size)
            q_logits = quantize.quantize_int4(logits, logits.with_name("model.int4.onnx"))
            q_decoder = quantize.quantize_int4(decoder, decoder.with_name("model.int4.onnx"), accuracy_level=level)
            self.recipe.quantization = Quantization(bits=4, engine="onnxruntime", format="int4-matmulnbits",
                                                    weight_type="int4 symmetric", block_size=quantize.INT4_BLOCK,
                                                    accuracy_level=level, decoding_step_ms=step_ms)
            log.info(f"4-bit: the decoder computes in {'int8' if level else 'fp32'}, measured faster per decoding "
                     f"step here ({', '.join(f'{k} {v:.2f} ms' for k, v in step_ms.items())})")
        for path in (q_logits, q_decoder):
            _gate_integer_ops(path)
        diff = quantize.decoder_prefill_diff(q_logits, q_decoder, self.model.config.vocab_size)
        mixed = self.recipe.quantization.accuracy_level is not None  # the decoder computes in int8, logits in fp32
        if diff > (quantize.MIXED_COMPUTE_TOLERANCE if mixed else quantize.PREFILL_TOLERANCE):
            raise StageFailed(f"the quantized decoder's prefill disagrees with the quantized logits graph (max |logit "
                              f"diff| {diff:.3g} > {quantize.PREFILL_TOLERANCE})")
        for path in (logits, decoder):  # the quantized files are the artefact
            path.unlink()
            Path(str(path) + ".data").unlink(missing_ok=True)
        self.deploy = {"logits": q_logits, "decoder": q_decoder}

    def measure(self) -> Figures:
        after, after_top1 = baseline.measured(self.deploy["logits"], self.model, self.heldout, self.cloze)
        figures = {"before": self.before, "after": after}
        vocab, repeats = self.model.config.vocab_size, self.cfg.latency_repeats
        for batch in (1, 8):
            ms = measure.latency_ms([self.base.path, self.deploy["logits"]], vocab, batch, repeats=repeats)
            figures["before"][f"latency_ms_batch{batch}"], figures["after"][f"latency_ms_batch{batch}"] = ms
        for batch in (1, 16):
            tps = measure.decode_tokens_per_s([self.base_decoder.path, self.deploy["decoder"]], vocab, batch,
                                              DECODE_PROMPT, DECODE_TOKENS, repeats=min(repeats, DECODE_REPEATS))
            figures["before"][f"decode_tokens_per_s_batch{batch}"] = tps[0]
            figures["after"][f"decode_tokens_per_s_batch{batch}"] = tps[1]
        b, a = (Measured(**figures[k]) for k in ("before", "after"))
        self.figures = f = Figures(
            before=b, after=a, compression_ratio=a.onnx_bytes / b.onnx_bytes,
            perplexity_change_pct=100 * (a.perplexity / b.perplexity - 1),
            top1_agreement=measure.top1_agreement(self.before_top1, after_top1), zero_shot_items=self.cloze.items,
            zero_shot_choices=self.cloze.choices,
            speedup={"1": b.latency_ms_batch1 / a.latency_ms_batch1, "8": b.latency_ms_batch8 / a.latency_ms_batch8},
            decode_speedup={"1": a.decode_tokens_per_s_batch1 / b.decode_tokens_per_s_batch1,
                            "16": a.decode_tokens_per_s_batch16 / b.decode_tokens_per_s_batch16},
            decode_prompt_len=DECODE_PROMPT, decode_new_tokens=DECODE_TOKENS, speed_target=self.cfg.speed_gate,
            latency_seq_len=128, heldout=self.heldout_label,
            machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, onnxruntime CPU provider")
        log.info(f"size {f.compression_ratio:.3f}x, perplexity {b.perplexity:.3f} -> {a.perplexity:.3f}, top-1 "
                 f"agreement {f.top1_agreement:.1%}, cloze {_share(b.zero_shot_accuracy)} -> "
                 f"{_share(a.zero_shot_accuracy)}; prefill batch 8 {b.latency_ms_batch8:.1f} -> "
                 f"{a.latency_ms_batch8:.1f} ms; decoding tokens/s batch 1 {b.decode_tokens_per_s_batch1:.0f} -> "
                 f"{a.decode_tokens_per_s_batch1:.0f}, batch 16 {b.decode_tokens_per_s_batch16:.0f} -> "
                 f"{a.decode_tokens_per_s_batch16:.0f}")
        return f

    def speed(self, figures: Figures) -> str | None:
        return speed_gate(self.cfg, figures)

    def write(self) -> None:
        self.graphs = {role: _graph(self.stage, path, self.fp32[role].max_abs_diff)
                       for role, path in self.deploy.items()}
        self.manifest = CompressedModel(
            source=self.source, settings=self.cfg.model_dump(mode="json"), graphs=self.graphs,
            recipe=self.recipe, figures=self.figures, torchao=self.torchao)
        report.write(self.manifest, self.stage)
        self.manifest.write(self.stage)


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


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def recovery_train_config(model_dir: Path, output: Path, steps: int, lr: float, data: str | None = None,
                          keep_zero_weights: bool = False, distill_from: Path | None = None):
    """The `dstool train` settings of the recovery fine-tuning: one rank, ZeRO-0, `steps` steps at peak `lr`
    (warm-up, cosine decay) on `data` (the embedded corpus when None)."""
    from dstool.train import TrainConfig

    return TrainConfig(model=str(model_dir), data=data, output=str(output), nproc=1, zero=0, max_steps=steps,
                       save_every=steps, lr=lr, keep_zero_weights=keep_zero_weights, tensorboard=False,
                       distill_from=str(distill_from) if distill_from else None, log_every=max(1, steps // 5))


def _graph(stage: Path, path: Path, parity: float) -> Graph:
    proto = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in proto.initializer}
    data = Path(str(path) + ".data")
    return Graph(path=str(path.relative_to(stage)), data=str(data.relative_to(stage)) if data.exists() else None,
                 sha256=sha256_file(path), inputs=[i.name for i in proto.input if i.name not in inits],
                 outputs=[o.name for o in proto.output], fp32_parity=parity)


def _graph_logits(role: str, path: Path, ids: np.ndarray) -> np.ndarray:
    """The logits of a logits graph, or of a decoder graph's prefill on an empty cache."""
    from dstool.onnx_export import empty_cache, ort_session, run_decoder, run_logits

    session = ort_session(path)
    if role == "logits":
        return run_logits(session, ids)
    return run_decoder(session, ids, empty_cache(session, len(ids)), 0)[0]


class _OnnxLayoutTimer:
    """prune.LayoutTimer on the deployed engine: each trial is exported to ONNX (then freed), and all are timed
    interleaved at batch 8 x 128 on ONNX Runtime, the report's latency figure."""

    def __init__(self, work: Path, repeats: int):
        self.work, self.repeats, self.vocab = work / "layouts", repeats, 0
        self.paths: list[Path] = []

    def add(self, trial) -> None:
        self.vocab = trial.config.vocab_size
        self.paths.append(export_logits_model(trial, self.work / str(len(self.paths))).path)

    def latencies_ms(self) -> list[float]:
        try:
            return measure.latency_ms(self.paths, self.vocab, 8, repeats=self.repeats)
        finally:
            shutil.rmtree(self.work, ignore_errors=True)


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
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=TorchAoConfig(Int8DynamicActivationInt8WeightConfig())).eval()
    quantized.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    int8 = [name for name, p in reloaded.named_parameters() if "Int8" in type(p).__name__]
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - quantized(input_ids=ids).logits).abs().max().item()
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
