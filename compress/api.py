"""`compress(config)`: what `dstool compress` does, callable from Python.

A pipeline of named steps, each with a correctness gate (as Triton Model Navigator does):
  load        the folder is a causal LM with weights
  baseline    fp32 ONNX of the input (parity-checked) -> perplexity, latency, size
  prune       heads / MLP channels removed       gate: transformers reloads the saved folder, same logits
  sparsity    N:M magnitude masks                gate: every group of M has >= M-N zeros
  recover     fine-tune with the training engine  (masks held fixed)
  export      fp32 ONNX of the result (parity-checked)
  quantize    int8 dynamic / 4-bit weight-only   gate: ORT loads it and it holds integer ops
  report      measured before/after               gate: quantized must not be slower (unless allowed)
Everything is written to OUTPUT.tmp and renamed into place at the end.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path

import onnx
import torch

from dstool import models
from dstool.compress import measure, quantize, report
from dstool.compress.config import CompressConfig
from dstool.errors import UsageError
from dstool.manifest import read_manifest, write_manifest
from dstool.onnx_export import export_logits_model

KIND = "compressed-model"


def _check_input(cfg: CompressConfig) -> Path:
    src = Path(cfg.model)
    if not src.is_dir():
        raise UsageError(f"model {cfg.model} is not a folder: pass a Hugging Face causal-LM folder")
    models.check_model_folder(src)
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file: pass a folder for --output")
    if out.is_dir() and any(out.iterdir()) and (read_manifest(out) or {}).get("kind") != KIND:
        raise UsageError(f"output {out} exists and holds files dstool did not write: choose a new --output")
    return src


def compress(cfg: CompressConfig, echo=print) -> dict:
    """Run the pipeline; returns the report (also written to OUTPUT/report.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _check_input(cfg)  # --- load
    out = Path(cfg.output)
    stage = out.with_name(out.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix="dstool-compress-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        calib, heldout = measure.heldout_tokens(src, tokenizer, cfg.calibration)
        vocab, layers = model.config.vocab_size, model.config.num_hidden_layers

        echo("[baseline] exporting the input model to ONNX (fp32) and measuring it")  # --- baseline
        base = export_logits_model(model, work / "baseline")
        before = _measure(base.path, model, heldout)
        echo(f"[baseline] perplexity {before['perplexity']:.3f}, {before['onnx_bytes'] / 1e6:.2f} MB")

        choices: dict[str, str] = {}
        pruning, torchao_figures = {}, {}
        if cfg.prune or cfg.prune_heads or cfg.prune_mlp or cfg.sparsity:
            model, masks, pruning = _structural(model, cfg, calib, work, choices, echo)
            model.save_pretrained(stage / "model", safe_serialization=True)
            tokenizer.save_pretrained(stage / "model")
            _gate_reload(model, stage / "model")
            if cfg.recover_steps:  # --- recover
                model = _recover(stage / "model", src, cfg, work, masks, model, calib, choices, echo)
        else:
            shutil.copytree(src, stage / "model", ignore=shutil.ignore_patterns("dstool.json"))

        echo("[export] exporting the result to ONNX (parity-checked against PyTorch)")  # --- export
        fp32 = export_logits_model(model, stage / "onnx")
        choices["onnx parity (max |logit diff| vs PyTorch)"] = f"{fp32.max_abs_diff:.2e}"
        deploy = fp32.path
        if cfg.bits == 8 and cfg.engine == "onnxruntime":  # --- quantize
            choice, _, trials = quantize.choose_int8_exclusions(
                fp32.path, work, calib, measure.perplexity_onnx(fp32.path, calib), cfg.max_ppl_increase / 100,
                layers, echo)
            deploy = quantize.quantize_int8(fp32.path, stage / "onnx" / "model.int8.onnx", choice)
            choices["int8 format"] = (f"dynamic (QOperator, MatMulInteger), MatMul weights {choice.weight_type} "
                                      f"symmetric per-channel={choice.per_channel} reduce_range={choice.reduce_range}, "
                                      f"activations {choice.activation_type} asymmetric per-tensor, embedding int8")
            choices["int8 reasoning"] = choice.reason
            choices["int8 trials (calibration perplexity)"] = "; ".join(
                f"{'+'.join(t['excluded']) or 'all int8'}"
                f"{' (+activation MatMuls)' if t.get('activation_matmuls') else ''}: {t['perplexity']:.3f}"
                for t in trials)
        elif cfg.bits == 4:
            deploy = quantize.quantize_int4(fp32.path, stage / "onnx" / "model.int4.onnx")
            choices["4-bit format"] = ("weight-only: MatMul -> MatMulNBits and embedding Gather -> GatherBlockQuantized, "
                                       "block 32, symmetric, fp32 compute")
        elif cfg.bits == 8 and cfg.engine == "torchao":
            torchao_figures = _torchao_int8(stage / "model", model, heldout, stage / "torchao", echo)
            choices["torchao int8"] = torchao_figures["summary"]
        if cfg.bits and cfg.engine == "onnxruntime":
            _gate_integer_ops(deploy)
            for f in (fp32.path, Path(str(fp32.path) + ".data")):  # the quantized file is the artefact
                f.unlink(missing_ok=True)

        echo("[measure] measuring the result")  # --- report
        after = _measure(deploy, model, heldout)
        for batch in (1, 8):
            before[f"latency_ms_batch{batch}"], after[f"latency_ms_batch{batch}"] = measure.latency_ms(
                [base.path, deploy], vocab, batch, repeats=cfg.latency_repeats)
        rep = _report(cfg, before, after, choices, deploy, stage, pruning, torchao_figures)
        report.write(rep, stage)
        speed_gate(cfg, before, after)
        write_manifest(stage, KIND, hash_files=True, source=str(src), settings=rep["settings"])
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        rep["artefact"] = str(out / deploy.relative_to(stage))
        return rep
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)


def speed_gate(cfg: CompressConfig, before: dict, after: dict) -> None:
    """A quantized model measured slower than fp32 (batch 8) fails the run, unless --allow-slower."""
    if cfg.bits and cfg.engine == "onnxruntime" and not cfg.allow_slower \
            and after["latency_ms_batch8"] > before["latency_ms_batch8"]:
        raise UsageError(f"the {cfg.bits}-bit model measured slower than fp32 at batch 8 "
                         f"({after['latency_ms_batch8']:.2f} vs {before['latency_ms_batch8']:.2f} ms): "
                         "nothing written; pass --allow-slower to keep it anyway")


def _measure(onnx_path: Path, model, heldout) -> dict:
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "onnx_bytes": measure.onnx_bytes(onnx_path),
            "perplexity": measure.perplexity_onnx(onnx_path, heldout)}


class _OnnxLayoutTimer:
    """prune.LayoutTimer on the deployed engine: each trial is exported to ONNX (then freed), and all are timed
    interleaved at batch 8 x 128 on ONNX Runtime, the report's latency figure."""

    def __init__(self, work: Path, repeats: int):
        self.work, self.repeats, self.paths, self.vocab = work / "layouts", repeats, [], 0

    def add(self, trial) -> None:
        self.vocab = trial.config.vocab_size
        self.paths.append(export_logits_model(trial, self.work / str(len(self.paths))).path)

    def latencies_ms(self) -> list[float]:
        try:
            return measure.latency_ms(self.paths, self.vocab, 8, repeats=self.repeats)
        finally:
            shutil.rmtree(self.work, ignore_errors=True)


def _structural(model, cfg: CompressConfig, calib, work: Path, choices: dict, echo):
    """Prune and/or sparsify `model` in place; returns it, the N:M masks (or None) and the pruning details."""
    from dstool.compress import prune

    masks, details = None, {}
    if cfg.prune or cfg.prune_heads or cfg.prune_mlp:
        rows = torch.from_numpy(measure.windows(calib, 128, 24))
        ranking, selection = rows[:16], rows[16:]
        if cfg.prune:
            timer = _OnnxLayoutTimer(work, min(cfg.latency_repeats, 10)) if cfg.prune_ppl_tolerance else None
            echo(f"[prune] measuring every layout that removes {cfg.prune:.0%}"
                 + (" (calibration loss, ONNX Runtime latency)" if timer else " (calibration loss)"))
            result = prune.prune_to_ratio(model, cfg.prune, calibration=ranking, selection=selection, timer=timer,
                                          ppl_tolerance=cfg.prune_ppl_tolerance / 100)
            rule = (f"the fastest at batch 8 x 128 (ORT) among those within {cfg.prune_ppl_tolerance:g} % of the best "
                    "calibration perplexity" if timer else "the lowest cross-entropy (untimed: --prune-ppl-tolerance P "
                    "takes the fastest layout within P % of the best calibration perplexity)")
            how = (f"layout: {rule}, cross-entropy on {len(selection)} x 128 other calibration tokens; candidates "
                   "(key/value groups x query heads per group / MLP channels: cross-entropy[, ms]): " + ", ".join(
                       f"{c['kv_groups']}x{c['heads_per_group']}/{c['channels']}: {c['calibration_loss']:.3f}"
                       + (f", {c['latency_ms']:.1f} ms" if "latency_ms" in c else "") for c in result.candidates))
        else:
            try:
                result = prune.prune_structured(model, cfg.prune_heads or 0.0, cfg.prune_mlp or 0.0,
                                                calibration=ranking)
            except ValueError as e:
                raise UsageError(str(e)) from None
            how = "ratios as given"
        choices["pruning"] = (f"{result.decoder_fraction_removed:.1%} of decoder-layer parameters removed "
                              f"({1 - result.params_after / result.params_before:.1%} of all): per layer key/value "
                              f"groups {result.kv_heads_before} -> {result.kv_heads_after}, query heads "
                              f"{result.heads_before} -> {result.heads_after}, MLP channels {result.intermediate_before}"
                              f" -> {result.intermediate_after}; ranked by activations on {len(ranking)} x 128 "
                              f"calibration tokens; {how}")
        echo(f"[prune] {choices['pruning']}")
        details = {"decoder_fraction_removed": result.decoder_fraction_removed,
                   "removed_per_layer": result.removed, "candidates": result.candidates}
    if cfg.sparsity:
        n, m = map(int, cfg.sparsity.split(":"))
        masks = prune.apply_n_m_sparsity(model, n, m)
        prune.check_n_m(model, masks, n, m)
        sparse_kernels = _semi_structured_available()
        choices["sparsity"] = (f"{cfg.sparsity} magnitude masks on {len(masks)} decoder Linear weights (verified); "
                               f"sparse kernels: {'used (to_sparse_semi_structured)' if sparse_kernels else 'not used — no GPU semi-structured kernels here, so latency is dense'}")
        echo(f"[sparsity] {choices['sparsity']}")
    return model, masks, details


def _semi_structured_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def _gate_reload(model, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"saved compressed model reloads differently (max |logit diff| {diff:.3g})")


def recovery_train_config(model_dir: Path, output: Path, steps: int, lr: float, data: str | None = None,
                          keep_zero_weights: bool = False, distill_from: Path | None = None):
    """The `dstool train` settings of the recovery fine-tuning: one rank, ZeRO-0, `steps` steps at peak `lr`
    (warm-up, cosine decay) on `data` (the embedded corpus when None)."""
    from dstool.config import TrainConfig

    return TrainConfig(model=str(model_dir), data=data, output=str(output), nproc=1, zero=0, max_steps=steps,
                       save_every=steps, lr=lr, keep_zero_weights=keep_zero_weights, tensorboard=False,
                       distill_from=str(distill_from) if distill_from else None, log_every=max(1, steps // 5))


def _recover(folder: Path, original: Path, cfg: CompressConfig, work: Path, masks, model, calib, choices: dict, echo):
    """Fine-tune the saved compressed model with the `dstool train` engine (optionally distilling from
    `original`'s logits). Gate: the result replaces the folder's weights only if it lowers the calibration
    perplexity; otherwise the compressed `model` is kept and the report says so. Returns the model kept."""
    from transformers import AutoModelForCausalLM

    from dstool.train import train
    from dstool.train.metrics import read_metrics

    echo(f"[recover] fine-tuning {cfg.recover_steps} steps with the dstool training engine"
         + (", distilling from the original model's logits" if cfg.distill else ""))
    run = work / "recover"
    result = train(recovery_train_config(folder, run, cfg.recover_steps, cfg.recover_lr, cfg.calibration,
                                         keep_zero_weights=masks is not None,
                                         distill_from=original if cfg.distill else None), echo=lambda *_: None)
    choices["recovery"] = (f"{cfg.recover_steps} steps, peak lr {cfg.recover_lr:g}, ZeRO-0, final train loss "
                           f"{result.train_loss:.4f}"
                           + ("; N:M masks held fixed" if masks is not None else ""))
    if cfg.distill:
        kl = [r["distill_kl"] for r in read_metrics(run) if "distill_kl" in r]
        choices["recovery"] += (f"; distilled from the original model (loss = cross-entropy + KL to its logits), "
                                f"KL {kl[0]:.4f} -> {kl[-1]:.4f}")
    recovered = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32).eval()
    # Calibration tokens come from the training split, never from the held-out split the report measures.
    ppl_before, ppl_after = (measure.perplexity_torch(m, calib, limit=24) for m in (model, recovered))
    if ppl_after >= ppl_before:
        choices["recovery"] += (f"; discarded: it raised the calibration perplexity {ppl_before:.3f} -> "
                                f"{ppl_after:.3f}, so the weights before recovery are kept (a lower --recover-lr "
                                "may help)")
        echo(f"[recover] discarded: calibration perplexity {ppl_before:.3f} -> {ppl_after:.3f}; keeping the "
             f"weights before recovery (a lower --recover-lr than {cfg.recover_lr:g} may help)")
        return model
    choices["recovery"] += f"; calibration perplexity {ppl_before:.3f} -> {ppl_after:.3f}"
    for f in result.model_dir.iterdir():
        if f.name != "dstool.json":
            shutil.copy2(f, folder / f.name)
    return recovered


def _gate_integer_ops(path: Path) -> None:
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    integer = ops & {"MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLinear", "MatMulNBits"}
    if not integer:
        raise RuntimeError(f"quantized graph {path.name} holds no integer ops ({sorted(ops)})")
    measure.ort_session(path)  # loads in ONNX Runtime


def _torchao_int8(model_dir: Path, model, heldout, folder: Path, echo) -> dict:
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
        raise RuntimeError(f"torchao folder reloads wrongly ({len(int8)} int8 weights, max |logit diff| {diff:.3g})")
    ppl_fp32, ppl_int8 = measure.perplexity_torch(model, heldout), measure.perplexity_torch(reloaded, heldout)
    fp32_ms, int8_ms = measure.latency_torch_ms([model, reloaded], model.config.vocab_size, batch=8)
    figures = {"folder": folder.name, "int8_weights": len(int8), "bytes": measure.safetensors_bytes(folder),
               "fp32_bytes": measure.safetensors_bytes(model_dir), "perplexity_fp32": ppl_fp32,
               "perplexity_int8": ppl_int8, "latency_ms_batch8_fp32": fp32_ms, "latency_ms_batch8_int8": int8_ms}
    figures["summary"] = (f"Int8DynamicActivationInt8WeightConfig via TorchAoConfig on {len(int8)} Linear weights "
                          f"(embeddings, lm_head fp32) in {folder.name}/ (AutoModelForCausalLM.from_pretrained reloads "
                          f"it quantized; needs torchao); weights {figures['bytes'] / figures['fp32_bytes']:.3f}x; "
                          f"PyTorch perplexity {ppl_fp32:.3f} -> {ppl_int8:.3f}; PyTorch CPU batch 8 x 128: "
                          f"{fp32_ms:.1f} -> {int8_ms:.1f} ms")
    echo(f"[torchao] {figures['summary']}")
    return figures


def _report(cfg: CompressConfig, before: dict, after: dict, choices: dict, deploy: Path, stage: Path,
            pruning: dict, torchao_figures: dict) -> dict:
    return {
        "model": cfg.model,
        "settings": cfg.model_dump(exclude={"model", "output", "latency_repeats"}),
        "before": before, "after": after,
        "compression_ratio": after["onnx_bytes"] / before["onnx_bytes"],
        "perplexity_change_pct": 100 * (after["perplexity"] / before["perplexity"] - 1),
        "speedup": {"1": before["latency_ms_batch1"] / after["latency_ms_batch1"],
                    "8": before["latency_ms_batch8"] / after["latency_ms_batch8"]},
        "latency_seq_len": 128,
        "onnx": str(deploy.relative_to(stage)),
        "choices": choices,
        **({"pruning": pruning} if pruning else {}),
        **({"torchao": torchao_figures} if torchao_figures else {}),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, onnxruntime CPU provider",
    }
