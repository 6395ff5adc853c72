"""report.json, report.md and report.png: every figure measured in the run that writes them."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def write(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "report.png")


def markdown(r: dict) -> str:
    b, a = r["before"], r["after"]
    rows = [
        ("parameters", f"{b['parameters']:,}", f"{a['parameters']:,}", f"{a['parameters'] / b['parameters']:.3f}x"),
        ("ONNX file size", _fmt_bytes(b["onnx_bytes"]), _fmt_bytes(a["onnx_bytes"]), f"{r['compression_ratio']:.3f}x"),
        ("held-out perplexity", f"{b['perplexity']:.3f}", f"{a['perplexity']:.3f}", f"{r['perplexity_change_pct']:+.2f} %"),
    ]
    for batch in ("1", "8"):
        key = f"latency_ms_batch{batch}"
        rows.append((f"latency, batch {batch} x {r['latency_seq_len']} tokens (ORT CPU, median)",
                     f"{b[key]:.2f} ms", f"{a[key]:.2f} ms", f"{r['speedup'][batch]:.2f}x faster"))
    lines = [f"# dstool compress report: {Path(r['model']).name}", "",
             f"Settings: {', '.join(f'{k}={v}' for k, v in r['settings'].items() if v not in (None, False, 0))}", "",
             "| | before | after | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {a_} | {b_} | {c_} | {d_} |" for a_, b_, c_, d_ in rows]
    lines += ["", "## Choices", ""] + [f"- {k}: {v}" for k, v in r["choices"].items()]
    lines += ["", f"Measured on: {r['machine']}", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    labels = ["before", "after"]
    series = [("ONNX size (MB)", [r["before"]["onnx_bytes"] / 1e6, r["after"]["onnx_bytes"] / 1e6]),
              ("held-out perplexity", [r["before"]["perplexity"], r["after"]["perplexity"]]),
              ("latency batch 8 (ms)", [r["before"]["latency_ms_batch8"], r["after"]["latency_ms_batch8"]])]
    for ax, (title, values) in zip(axes, series):
        bars = ax.bar(labels, values, color=["#888888", "#2a7ab9"])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(title)
    fig.suptitle(f"dstool compress: {', '.join(k for k, v in r['settings'].items() if v and k != 'allow_slower')}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
