"""report.md and report.png, rendered from the compress manifest: every figure measured in the run that wrote it."""

from __future__ import annotations

from pathlib import Path

from dstool.artifacts import CompressedModel, Recipe


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def write(m: CompressedModel, out: Path) -> None:
    (out / m.report).write_text(markdown(m))
    plot(m, out / "report.png")


def recipe_lines(r: Recipe) -> list[str]:
    """The recipe in sentences (the manifest holds it as data)."""
    lines = []
    if p := r.pruning:
        rule = {"lowest-loss": "the lowest calibration loss (untimed: --prune-ppl-tolerance P takes the fastest "
                               "layout within P % of the best calibration perplexity)",
                "fastest-within-tolerance": f"the fastest at batch 8 x 128 (ONNX Runtime) among those within "
                                            f"{p.ppl_tolerance_pct:g} % of the best calibration perplexity",
                "given-ratios": "ratios as given"}[p.rule]
        tried = ", ".join(f"{c.kv_groups}x{c.heads_per_group}/{c.channels}: {c.calibration_loss:.3f}"
                          + (f", {c.latency_ms:.1f} ms" if c.latency_ms is not None else "") for c in p.candidates)
        lines.append(f"pruning: {p.decoder_fraction_removed:.1%} of decoder-layer parameters removed "
                     f"({p.total_fraction_removed:.1%} of all): per layer key/value groups {p.kv_heads[0]} -> "
                     f"{p.kv_heads[1]}, query heads {p.query_heads[0]} -> {p.query_heads[1]}, MLP channels "
                     f"{p.mlp_channels[0]} -> {p.mlp_channels[1]}; layout: {rule}"
                     + (f"; candidates (key/value groups x query heads per group / MLP channels: cross-entropy"
                        f"[, ms]): {tried}" if tried else ""))
    if s := r.sparsity:
        lines.append(f"sparsity: {s.pattern} magnitude masks on {s.weights} decoder Linear weights (verified); sparse "
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
        elif q.format == "int4-matmulnbits":
            lines.append(f"4-bit: weight-only, MatMul -> MatMulNBits and embedding Gather -> GatherBlockQuantized, "
                         f"block {q.block_size}, symmetric; the logits graph computes in fp32, the decoder in "
                         f"{'int8' if q.accuracy_level else 'fp32'} (a batch-1 decoding step: "
                         + ", ".join(f"{k} {v:.2f} ms" for k, v in q.decoding_step_ms.items()) + ")")
        else:
            lines.append("torchao int8: Int8DynamicActivationInt8WeightConfig via TorchAoConfig in "
                         f"{q.torchao_folder}/ "
                         "(AutoModelForCausalLM.from_pretrained reloads it quantized; needs torchao); embeddings and "
                         "lm_head fp32")
    return lines


def markdown(m: CompressedModel) -> str:
    f = m.figures
    b, a = f.before, f.after
    rows = [("parameters", f"{b.parameters:,}", f"{a.parameters:,}", f"{a.parameters / b.parameters:.3f}x"),
            ("ONNX file size", _mb(b.onnx_bytes), _mb(a.onnx_bytes), f"{f.compression_ratio:.3f}x"),
            ("held-out perplexity", f"{b.perplexity:.3f}", f"{a.perplexity:.3f}", f"{f.perplexity_change_pct:+.2f} %")]
    for batch in ("1", "8"):
        before, after = getattr(b, f"latency_ms_batch{batch}"), getattr(a, f"latency_ms_batch{batch}")
        rows.append((f"latency, batch {batch} x {f.latency_seq_len} tokens (ORT CPU, median)", f"{before:.2f} ms",
                     f"{after:.2f} ms", f"{f.speedup[batch]:.2f}x faster"))
    settings = ", ".join(f"{k}={v}" for k, v in m.settings.items() if k not in ("model", "output")
                         and v not in (None, False, 0))
    lines = [f"# dstool compress report: {Path(m.source.path).name}", "", f"Settings: {settings}", "",
             "| | before | after | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {a_} | {b_} | {c_} | {d_} |" for a_, b_, c_, d_ in rows]
    lines += ["", "## Recipe", ""] + [f"- {line}" for line in recipe_lines(m.recipe)]
    lines += ["", "## Graphs", ""] + [f"- {role}: `{g.path}` (fp32 parity before quantization: max |logit diff| "
                                       f"{g.fp32_parity:.2e})" for role, g in m.graphs.items()]
    if t := m.torchao:
        lines += ["", f"torchao (PyTorch CPU, batch 8 x 128): weights {t.bytes / t.fp32_bytes:.3f}x, perplexity "
                  f"{t.perplexity_fp32:.3f} -> {t.perplexity_int8:.3f}, {t.latency_ms_batch8_fp32:.1f} -> "
                  f"{t.latency_ms_batch8_int8:.1f} ms"]
    lines += ["", f"Held-out tokens: {f.heldout}. Measured on: {f.machine}. Everything above is in dstool.json.", ""]
    return "\n".join(lines)


def plot(m: CompressedModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = m.figures
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    series = [("ONNX size (MB)", [f.before.onnx_bytes / 1e6, f.after.onnx_bytes / 1e6]),
              ("held-out perplexity", [f.before.perplexity, f.after.perplexity]),
              ("latency batch 8 (ms)", [f.before.latency_ms_batch8, f.after.latency_ms_batch8])]
    for ax, (title, values) in zip(axes, series):
        bars = ax.bar(["before", "after"], values, color=["#888888", "#2a7ab9"])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(title)
    fig.suptitle("dstool compress: " + ", ".join(k for k, v in m.settings.items()
                                                  if v and k not in ("model", "output", "allow_slower",
                                                                     "latency_repeats", "engine", "max_ppl_increase")))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
