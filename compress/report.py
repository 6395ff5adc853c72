"""report.md and report.png, rendered from the compress manifest: every figure measured in the run that wrote it."""

from __future__ import annotations

from pathlib import Path

from dstool.artifacts import CompressedModel, Pruning, Recipe, Sparsity


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def write(m: CompressedModel, out: Path) -> None:
    (out / m.report).write_text(markdown(m))
    plot(m, out / "report.png")


def layout_text(p: Pruning) -> str:
    """What every layer kept, before -> after (MoE: heads, routed experts, expert and shared-expert channels)."""
    if p.attention == "mla":
        text = f"attention heads (MLA) {p.query_heads[0]} -> {p.query_heads[1]}"
    else:
        text = (f"key/value groups {p.kv_heads[0]} -> {p.kv_heads[1]}, query heads {p.query_heads[0]} -> "
                f"{p.query_heads[1]}")
    text += f", MLP channels {p.mlp_channels[0]} -> {p.mlp_channels[1]}"
    if p.experts and p.expert_channels:
        text += (f" (dense layers); per MoE layer routed experts {p.experts[0]} -> {p.experts[1]}"
                 + (" (the least routed on calibration tokens removed)" if p.experts[1] < p.experts[0] else "")
                 + f", channels per expert {p.expert_channels[0]} -> {p.expert_channels[1]}")
    if p.shared_expert_channels:
        text += f", shared-expert channels {p.shared_expert_channels[0]} -> {p.shared_expert_channels[1]}"
    return text


def recipe_lines(r: Recipe) -> list[str]:
    """The recipe in sentences (the manifest holds it as data)."""
    lines = []
    if p := r.pruning:
        rule = {"lowest-loss": "the lowest calibration loss (--prune-ppl-tolerance 0: untimed)",
                "fastest-within-tolerance": f"the fastest at batch 8 x 128 (ONNX Runtime) among those within "
                                            f"{p.ppl_tolerance_pct:g} % of the best calibration perplexity",
                "given-ratios": "ratios as given"}[p.rule]
        mla = p.attention == "mla"

        def shape(c) -> str:
            if mla:
                return f"{c.kv_groups}/{c.channels}/{c.experts}x{c.expert_channels}"
            return f"{c.kv_groups}x{c.heads_per_group}/{c.channels}"

        tried = ", ".join(f"{shape(c)}: {c.calibration_loss:.3f}"
                          + (f", {c.latency_ms:.1f} ms" if c.latency_ms is not None else "") for c in p.candidates)
        legend = ("heads / dense MLP channels / routed experts x channels each" if mla else
                  "key/value groups x query heads per group / MLP channels")
        lines.append(f"pruning: {p.decoder_fraction_removed:.1%} of decoder-layer parameters removed "
                     f"({p.total_fraction_removed:.1%} of all): per layer {layout_text(p)}; layout: {rule}"
                     + (f"; candidates ({legend}: cross-entropy[, ms]): {tried}" if tried else ""))
    if (s := r.sparsity) and s.fraction is not None:
        lines.append(sparse_line(s))
    elif s := r.sparsity:
        lines.append(f"sparsity: {s.pattern} magnitude masks on {s.weights} decoder Linear and expert weights "
                     "(verified); sparse "
                     "kernels: " + ("used (to_sparse_semi_structured)" if s.sparse_kernels else
                                    "not used — no GPU semi-structured kernels here, so latency is dense"))
    if c := r.recovery:
        lines.append(f"recovery: {c.steps} steps, peak lr {c.lr:g}, ZeRO-0"
                     + (f", final train loss {c.final_train_loss:.4f}" if c.final_train_loss is not None else "")
                     + (f"; distilled from the original model (cross-entropy + KL to its logits), KL "
                        f"{c.distill_kl[0]:.4f} -> {c.distill_kl[1]:.4f}" if c.distill_kl else "")
                     + (f"; calibration perplexity {c.calibration_ppl_before:.3f} -> {c.calibration_ppl_after:.3f}"
                        if c.kept else f"; discarded: it raised the calibration perplexity "
                        f"{c.calibration_ppl_before:.3f} -> {c.calibration_ppl_after:.3f}, so the weights before "
                        "recovery are kept (a lower --recover-lr may help)"))
    if q := r.quantization:
        if q.format == "int8-dynamic-qoperator":
            lines.append(f"int8: dynamic (QOperator, MatMulInteger), MatMul weights {q.weight_type} symmetric "
                         f"per-channel={q.per_channel} reduce_range={q.reduce_range} (CPU "
                         f"{'has' if q.cpu_vnni else 'lacks'} VNNI), activations {q.activation_type} asymmetric "
                         f"per-tensor, embedding int8; activation x activation MatMuls "
                         f"{'int8' if q.activation_matmuls else 'fp32'}; kept in fp32 (measured): "
                         f"{', '.join(q.fp32_layers) or 'nothing'}; trials (calibration perplexity): "
                         + "; ".join(f"{'+'.join(t.fp32_layers) or 'all int8'}"
                                     f"{' (+activation MatMuls)' if t.activation_matmuls else ''}: {t.perplexity:.3f}"
                                     for t in q.trials))
        elif q.format in ("int4-matmulnbits", "int8-matmulnbits"):
            four = q.bits == 4
            lines.append(f"{q.bits}-bit: weight-only, MatMul -> MatMulNBits"
                         + (" and embedding Gather -> GatherBlockQuantized" if four else " (embedding fp32)")
                         + f", {q.weight_type}, a scale per {q.block_size} input channels; the logits graph "
                         f"computes in {'fp32' if four or not q.accuracy_level else 'int8'}, the decoder in "
                         f"{'int8 (activations quantized per block)' if q.accuracy_level else 'fp32'} (a batch-1 "
                         "decoding step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in q.decoding_step_ms.items())
                         + ")" + (f"; rounding: GPTQ on {q.calibration_tokens:,} calibration tokens "
                                  f"({q.gptq_seconds:.0f} s), its codes in " + ", ".join(
                                      f"{n} MatMuls of the {role} graph" for role, n in q.gptq_weights.items())
                                  + " (lm_head and the embedding round to nearest)"
                                  if q.method == "gptq" else "; rounding: to nearest" if four else ""))
        else:
            lines.append("torchao int8: Int8DynamicActivationInt8WeightConfig via TorchAoConfig in "
                         f"{q.torchao_folder}/ "
                         "(AutoModelForCausalLM.from_pretrained reloads it quantized; needs torchao); embeddings and "
                         "lm_head fp32")
    return lines


def sparse_line(s: Sparsity) -> str:
    """Unstructured sparsity in a sentence: what was zeroed, how it is stored, what runs it."""
    text = (f"sparsity: unstructured magnitude, {s.decoder_zero_share:.1%} zeros in {s.weights} decoder weights "
            f"(Linear and routed experts, each matrix pruned on its own; {s.total_zero_share:.1%} of all parameters: "
            f"embeddings, lm_head and norms dense); held-out perplexity {s.perplexity_masked:.3f} before recovery")
    if t := s.storage:
        text += (f"; stored as bitmask + nonzero values: model/ {t.model_bytes / t.model_dense_bytes:.3f}x of its fp32 "
                 "safetensors (dstool.compress.load reads it), " + ", ".join(
                     f"{role} graph {t.onnx_bytes[role] / t.onnx_dense_bytes[role]:.3f}x" for role in t.onnx_bytes)
                 + ("" if all(t.encoded.get(role) for role in t.onnx_bytes) else " (quantized graphs: as quantized)"))
    return text + ("; kernels: dense — ONNX Runtime rebuilds the dense weights when it loads a graph and runs dense "
                   "MatMuls, so it is no faster")


def markdown(m: CompressedModel) -> str:
    f = m.figures
    b, a = f.before, f.after
    rows = [("parameters", f"{b.parameters:,}", f"{a.parameters:,}", f"{a.parameters / b.parameters:.3f}x"),
            ("ONNX file size", _mb(b.onnx_bytes), _mb(a.onnx_bytes), f"{f.compression_ratio:.3f}x"),
            ("held-out perplexity", f"{b.perplexity:.3f}", f"{a.perplexity:.3f}", f"{f.perplexity_change_pct:+.2f} %"
             + (f" (recovery {f.recovery['perplexity']:.2f} %)" if "perplexity" in f.recovery else "")),
            ("top-1 next token = the input model's (held-out positions)", "100.00%", f"{f.top1_agreement:.2%}", ""),
            (f"zero-shot cloze accuracy ({f.zero_shot_items} items, chance {1 / f.zero_shot_choices:.0%})",
             _pct(b.zero_shot_accuracy), _pct(a.zero_shot_accuracy),
             f"{100 * (a.zero_shot_accuracy - b.zero_shot_accuracy):+.1f} points"
             + (f" (recovery {f.recovery['cloze']:.1f} %)" if "cloze" in f.recovery else "")
             if a.zero_shot_accuracy is not None and b.zero_shot_accuracy is not None else "")]
    for batch in ("1", "8"):
        before, after = getattr(b, f"latency_ms_batch{batch}"), getattr(a, f"latency_ms_batch{batch}")
        rows.append((f"prefill latency, batch {batch} x {f.latency_seq_len} tokens (median)", f"{before:.2f} ms",
                     f"{after:.2f} ms", _faster(f.speedup[batch])))
    for batch in ("1", "16"):
        before, after = (getattr(x, f"decode_tokens_per_s_batch{batch}") for x in (b, a))
        rows.append((f"decoding, batch {batch} (tokens/s, {f.decode_new_tokens} steps after a {f.decode_prompt_len}-"
                     "token prompt, median)", f"{before:.1f}", f"{after:.1f}",
                     _faster(f.decode_speedup[batch])))
    unused = {"model", "output"} | (set() if m.settings.get("prune") else {"prune_ppl_tolerance"})
    settings = ", ".join(f"{k}={v}" for k, v in m.settings.items() if k not in unused and v not in (None, False, 0))
    lines = [f"# dstool compress report: {Path(m.source.gguf or m.source.path).name}", "", f"Settings: {settings}", "",
             "| | before | after | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {a_} | {b_} | {c_} | {d_} |" for a_, b_, c_, d_ in rows]
    lines += ["", quality_gate_line(m), "", speed_gate_line(m)]
    lines += ["", "## Recipe", ""] + [f"- {line}" for line in recipe_lines(m.recipe)]
    lines += ["", "## Graphs", ""] + [f"- {role}: `{g.path}` (fp32 parity before quantization: max |logit diff| "
                                       f"{g.fp32_parity:.2e})" for role, g in m.graphs.items()]
    if t := m.torchao:
        lines += ["", f"torchao (PyTorch CPU, batch 8 x 128): weights {t.bytes / t.fp32_bytes:.3f}x, perplexity "
                  f"{t.perplexity_fp32:.3f} -> {t.perplexity_int8:.3f}, {t.latency_ms_batch8_fp32:.1f} -> "
                  f"{t.latency_ms_batch8_int8:.1f} ms"]
    lines += ["", f"Held-out tokens: {f.heldout}. Measured on: {f.machine}. Everything above is in dstool.json.", ""]
    return "\n".join(lines)


def _faster(speedup: float) -> str:
    return f"{speedup:.2f}x " + ("faster" if speedup >= 1 else "(slower)")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def quality_gate_line(m: CompressedModel) -> str:
    """What the quality gate asked (its figures held, or the run would have failed)."""
    f = m.figures
    kept = ", ".join(f"{k} {v:.2f} %" for k, v in f.recovery.items())
    if f.min_recovery is None:
        line = (f"Recovery (the result's quality as a share of the input's): {kept}; gate: none (opt-in: "
                "--min-recovery).")
    else:
        line = f"Recovery: {kept}; gate --min-recovery {f.min_recovery:g} % (perplexity): passed."
    if m.recipe.recovery:  # measured: a 2:4 SmolLM2 at 129.8 % here kept 7.6 % of its perplexity on other prose
        line += (" Both are measured on held-out text of the corpus the recovery fine-tuning trained on: in-domain, "
                 "so a recovered model can score above its input here and still lose its general quality; score it "
                 "on other text with `dstool eval` (docs/real-model.md).")
    return line


def speed_gate_line(m: CompressedModel) -> str:
    """Which figure the speed gate compared, and what it found."""
    gate = m.figures.speed_target
    if gate is None:
        return ("Speed gate: none (opt-in: --speed-gate decode|batched-decode|prefill); the speeds above are as "
                "measured, slower ones included.")
    speedup, what = m.figures.speedup_on(gate)
    if not m.settings.get("bits") or m.settings.get("engine") != "onnxruntime":
        return f"Speed gate: not applied (it gates ONNX Runtime quantization); its figure would be {what}."
    return f"Speed gate: {what} (--speed-gate {gate}), {speedup:.2f}x: passed (not slower than fp32)."


def plot(m: CompressedModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = m.figures
    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    b, a = f.before, f.after
    series = [("ONNX size (MB)", [b.onnx_bytes / 1e6, a.onnx_bytes / 1e6]),
              (f"held-out perplexity\n(top-1 agreement {f.top1_agreement:.1%})", [b.perplexity, a.perplexity]),
              (f"zero-shot cloze accuracy\n({f.zero_shot_items} items, chance {1 / f.zero_shot_choices:.0%})",
               [b.zero_shot_accuracy or 0.0, a.zero_shot_accuracy or 0.0]),
              ("prefill batch 8 x 128 (ms)", [b.latency_ms_batch8, a.latency_ms_batch8]),
              ("decoding batch 1 (tokens/s)", [b.decode_tokens_per_s_batch1, a.decode_tokens_per_s_batch1]),
              ("decoding batch 16 (tokens/s)", [b.decode_tokens_per_s_batch16, a.decode_tokens_per_s_batch16])]
    for ax, (title, values) in zip(axes.flat, series):
        bars = ax.bar(["before", "after"], values, color=["#888888", "#2a7ab9"])
        ax.bar_label(bars, fmt="%.4g")
        ax.margins(y=0.15)
        ax.set_title(title)
    fig.suptitle("dstool compress: " + ", ".join(k for k, v in m.settings.items()
                                                  if v and k not in ("model", "output", "speed_gate",
                                                                     "latency_repeats", "engine", "max_ppl_increase",
                                                                     "prune_ppl_tolerance")))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
