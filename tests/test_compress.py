"""dstool compress on a model trained by `dstool train` (tiny preset): every mode on the real engines."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import onnx
import pytest
import torch

from conftest import dstool
from dstool.compress import CompressConfig, quantize_dynamic
from dstool.compress.api import speed_gate
from dstool.compress.prune import check_n_m
from dstool.errors import UsageError


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def _report(out: Path) -> dict:
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 1000
    return json.loads((out / "report.json").read_text())


def test_int8_python_api(trained, tmp_path):
    import onnxruntime as ort

    out = tmp_path / "int8"
    rep = quantize_dynamic(str(trained), str(out), bits=8)
    path = out / "onnx" / "model.int8.onnx"
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= _ops(path)
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    saved = _report(out)
    assert saved["compression_ratio"] < 0.35 and rep["compression_ratio"] == saved["compression_ratio"]
    assert abs(saved["perplexity_change_pct"]) < 2.0
    assert saved["speedup"]["8"] > 1.0  # measured, interleaved with the fp32 model
    assert "VNNI" in saved["choices"]["int8 reasoning"]
    assert not (out / "onnx" / "model.onnx").exists()  # the artefact is the quantized graph


def test_int4_cli(trained, tmp_path):
    out = tmp_path / "int4"
    proc = dstool("compress", str(trained), "--bits", "4", "--allow-slower", "--output", str(out))
    assert "model.int4.onnx" in proc.stdout
    assert "MatMulNBits" in _ops(out / "onnx" / "model.int4.onnx")
    rep = _report(out)
    assert rep["compression_ratio"] < 0.25 and abs(rep["perplexity_change_pct"]) < 5


def _decoder_params(model) -> int:
    return sum(p.numel() for p in model.model.layers.parameters())


def test_structured_pruning_with_distilled_recovery(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "pruned"
    dstool("compress", str(trained), "--prune", "0.4", "--recover-steps", "8", "--distill", "--output", str(out))
    original = AutoModelForCausalLM.from_pretrained(trained)
    pruned = AutoModelForCausalLM.from_pretrained(out / "model")
    cfg = pruned.config
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0  # GQA: whole groups of query heads
    assert 0.40 <= 1 - _decoder_params(pruned) / _decoder_params(original) < 0.45
    rep = _report(out)
    assert rep["after"]["parameters"] == pruned.num_parameters() < rep["before"]["parameters"]
    assert rep["after"]["onnx_bytes"] < rep["before"]["onnx_bytes"]
    for removed in rep["pruning"]["removed_per_layer"]:  # what was removed, as indices of the original model
        assert len(removed["kv_groups"]) == 2 - cfg.num_key_value_heads
        assert len(removed["query_heads"]) == 6 - cfg.num_attention_heads
        assert len(removed["mlp_channels"]) == 512 - cfg.intermediate_size
    chosen = min(rep["pruning"]["candidates"], key=lambda c: c["calibration_loss"])  # untimed by default
    assert (chosen["kv_groups"], chosen["kv_groups"] * chosen["heads_per_group"], chosen["channels"]) == (
        cfg.num_key_value_heads, cfg.num_attention_heads, cfg.intermediate_size)
    assert not any("latency_ms" in c for c in rep["pruning"]["candidates"])
    kl = re.search(r"KL ([\d.]+) -> ([\d.]+)", rep["choices"]["recovery"])
    assert "distilled from the original model" in rep["choices"]["recovery"] and kl and float(kl.group(1)) > 0
    gate = re.search(r"calibration perplexity ([\d.]+) -> ([\d.]+)", rep["choices"]["recovery"])
    assert gate and float(gate.group(2)) < float(gate.group(1)) and "discarded" not in rep["choices"]["recovery"]


def test_prune_ppl_tolerance_times_each_layout_and_takes_the_fastest_within_it(trained, tmp_path):
    """At 10 % the tiny preset has two layouts: all 6 query heads, or 4 in 2 groups with more MLP channels."""
    out = tmp_path / "timed"
    dstool("compress", str(trained), "--prune", "0.1", "--prune-ppl-tolerance", "25", "--latency-repeats", "5",
           "--output", str(out))
    rep = _report(out)
    candidates = rep["pruning"]["candidates"]
    assert len(candidates) == 2 and all(c["latency_ms"] > 0 for c in candidates)  # each exported and timed on ORT
    best_loss = min(c["calibration_loss"] for c in candidates)
    chosen = min((c for c in candidates if math.exp(c["calibration_loss"] - best_loss) <= 1.25 + 1e-9),
                 key=lambda c: c["latency_ms"])
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert (chosen["kv_groups"], chosen["kv_groups"] * chosen["heads_per_group"], chosen["channels"]) == (
        cfg["num_key_value_heads"], cfg["num_attention_heads"], cfg["intermediate_size"])
    assert "within 25 % of the best calibration perplexity" in rep["choices"]["pruning"]
    assert rep["settings"]["prune_ppl_tolerance"] == 25


def test_explicit_head_and_mlp_ratios(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ratios"
    dstool("compress", str(trained), "--prune-heads", "0.34", "--prune-mlp", "0.5", "--latency-repeats", "3",
           "--output", str(out))
    cfg = AutoModelForCausalLM.from_pretrained(out / "model").config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 256)
    assert "ratios as given" in _report(out)["choices"]["pruning"]


def test_2_4_sparsity_kept_through_recovery(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sparse"
    dstool("compress", str(trained), "--sparsity", "2:4", "--recover-steps", "5", "--output", str(out))
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    masks = {n: p != 0 for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    check_n_m(model, masks, 2, 4)  # every group of 4 still has 2 zeros after fine-tuning
    zeros = sum(int((~m).sum()) for m in masks.values())
    assert zeros == sum(m.numel() for m in masks.values()) // 2
    assert "sparse kernels: not used" in _report(out)["choices"]["sparsity"]


def test_recovery_that_raises_calibration_perplexity_is_discarded(trained, tmp_path):
    """A recovery lr far too high: the gate keeps the weights before recovery, i.e. the original's 2:4-masked."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bad_recovery"
    dstool("compress", str(trained), "--sparsity", "2:4", "--recover-steps", "3", "--recover-lr", "0.3",
           "--latency-repeats", "3", "--output", str(out))
    recovery = _report(out)["choices"]["recovery"]
    figures = re.search(r"discarded: it raised the calibration perplexity ([\d.]+) -> ([\d.]+)", recovery)
    assert figures and float(figures.group(2)) > float(figures.group(1)), recovery
    original = dict(AutoModelForCausalLM.from_pretrained(trained).named_parameters())
    for name, p in AutoModelForCausalLM.from_pretrained(out / "model").named_parameters():
        kept = p != 0
        assert torch.equal(p[kept], original[name][kept]), name  # untouched by the discarded fine-tuning


def test_torchao_int8_folder_reloads_quantized(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "torchao"
    dstool("compress", str(trained), "--bits", "8", "--engine", "torchao", "--latency-repeats", "3",
           "--output", str(out))
    rep = _report(out)
    assert "Int8DynamicActivationInt8WeightConfig" in rep["choices"]["torchao int8"]
    model = AutoModelForCausalLM.from_pretrained(out / "torchao")  # a plain from_pretrained, as a user would
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "Int8Tensor"
    figures = rep["torchao"]
    assert figures["int8_weights"] == 4 * 7 and figures["bytes"] < 0.8 * figures["fp32_bytes"]
    assert abs(figures["perplexity_int8"] / figures["perplexity_fp32"] - 1) < 0.02


@pytest.mark.parametrize("args,needle", [
    (["--bits", "3"], "bits must be 8 or 4"),
    (["--prune", "1.5"], "strictly between 0 and 1"),
    (["--prune-mlp", "0"], "strictly between 0 and 1"),
    (["--sparsity", "2-4"], "N:M pattern"),
    (["--sparsity", "4:2"], "N:M pattern"),
    ([], "nothing to do"),
    (["--bits", "8", "--distill"], "--distill needs --recover-steps"),
    (["--bits", "8", "--prune-ppl-tolerance", "5"], "give --prune RATIO with it"),
])
def test_bad_options(trained, tmp_path, args, needle):
    proc = dstool("compress", str(trained), *args, "--output", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_bad_folders(trained, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((trained / "config.json").read_text())
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    cases = [([str(tmp_path / "bert"), "--bits", "8", "--output", str(tmp_path / "o")], "not a causal LM"),
             ([str(tmp_path / "noweights"), "--bits", "8", "--output", str(tmp_path / "o")], "has no weights"),
             ([str(trained), "--bits", "8", "--output", str(theirs)], "did not write")]
    for args, needle in cases:
        proc = dstool("compress", *args, check=False)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists() and [p.name for p in theirs.iterdir()] == ["keep.txt"]


def test_speed_gate():
    cfg = CompressConfig(model="m", output="o", bits=8)
    speed_gate(cfg, {"latency_ms_batch8": 10.0}, {"latency_ms_batch8": 5.0})
    with pytest.raises(UsageError, match="slower than fp32"):
        speed_gate(cfg, {"latency_ms_batch8": 10.0}, {"latency_ms_batch8": 12.0})
    speed_gate(cfg.model_copy(update={"allow_slower": True}), {"latency_ms_batch8": 10.0}, {"latency_ms_batch8": 12.0})
