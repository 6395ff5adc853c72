"""dstool compress on a model trained by `dstool train` (tiny preset): every mode on the real engines. The tests
read each output through its manifest (dstool.json), as `dstool export` does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from dstool.artifacts import CompressedModel
from dstool.compress import CompressConfig
from dstool.compress.sparse import check_n_m
from dstool.compress.steps import speed_gate

from conftest import COMPRESS_CODE, built_once, cli, dstool, one_line_usage_error


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def _manifest(out: Path) -> CompressedModel:
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 1000
    return CompressedModel.read(out, verify=True)  # every file listed, sizes and sha256 as written


def _compressed(trained: Path, tmp_path_factory, worker_id: str, name: str, *args: str) -> Path:
    """`dstool compress TRAINED ARGS`, kept between runs until the compress code or the trained model changes (as the
    int8 and int4 outputs are: tests/artefacts.py); the tests only read it."""
    return built_once(tmp_path_factory, worker_id, name,
                      lambda out: dstool("compress", str(trained), *args, "--output", str(out)), COMPRESS_CODE,
                      (trained, *args))


def _greedy(out: Path, m: CompressedModel, prompt: list[int], steps: int) -> tuple[list[int], list[int]]:
    """Greedy tokens from the decoder graph with its key/value cache, and from the logits graph recomputing the
    whole sequence every step."""
    from dstool.onnx_export import empty_cache, ort_session, run_decoder, run_logits

    decoder, logits = (ort_session(out / m.graphs[role].path) for role in ("decoder", "logits"))
    ids, cached = list(prompt), []
    step_logits, cache = run_decoder(decoder, np.array([prompt]), empty_cache(decoder, 1), 0)
    for _ in range(steps):
        cached.append(int(step_logits[0, -1].argmax()))
        step_logits, cache = run_decoder(decoder, np.array([[cached[-1]]]), cache, len(prompt) + len(cached) - 1)
    for _ in range(steps):
        ids.append(int(run_logits(logits, np.array([ids]))[0, -1].argmax()))
    return cached, ids[len(prompt):]


def test_int8_both_graphs_by_one_recipe(int8_output):
    import onnxruntime as ort

    m = _manifest(int8_output)
    q = m.recipe.quantization
    # weight-only by default: MatMulNBits, 8-bit symmetric blocks of 128, the decoder's compute measured
    assert q and q.format == "int8-matmulnbits" and q.block_size == 128 and q.weight_type == "int8 symmetric"
    assert set(q.decoding_step_ms) == {"fp32", "int8"} and q.accuracy_level in (None, 4)
    assert set(m.graphs) == {"logits", "decoder", "fused"}  # the fused-attention decoder by the same recipe
    for graph in m.graphs.values():
        ops = _ops(int8_output / graph.path)
        assert "MatMulNBits" in ops and "MatMulInteger" not in ops
        ort.InferenceSession(str(int8_output / graph.path), providers=["CPUExecutionProvider"])
        assert graph.fp32_parity < 1e-3
    assert not (int8_output / "onnx" / "logits" / "model.onnx").exists()  # the quantized graphs are the artefact
    f = m.figures
    assert f.compression_ratio < 0.6 and abs(f.perplexity_change_pct) < 0.5
    for measured in (f.before, f.after):  # decoding with the cache, each graph of the pair timed
        assert measured.decode_tokens_per_s_batch1 > 0 and measured.decode_tokens_per_s_batch16 > 0
    assert f.decode_speedup["16"] == f.after.decode_tokens_per_s_batch16 / f.before.decode_tokens_per_s_batch16
    assert 0.95 < f.top1_agreement <= 1.0  # weight-only int8 moves very few of the 64 x 127 held-out argmaxes
    assert f.zero_shot_choices == 4 and f.zero_shot_items >= 150
    assert abs(f.after.zero_shot_accuracy - f.before.zero_shot_accuracy) <= 0.02
    assert f.speed_target is None and "Speed gate: none" in (int8_output / "report.md").read_text()
    assert "held-out split" in f.heldout  # the training run's own split, named by the model's manifest
    assert m.source.kind == "hf-model" and len(m.source.weights_sha256) == 64
    cached, recomputed = _greedy(int8_output, m, [5, 17, 300, 42, 7, 99], 8)
    assert cached == recomputed  # the quantized decoder and logits graph are the same model


@pytest.mark.slow
def test_dynamic_int8_keeps_its_recipe_and_a_fused_decoder_that_disagrees_is_left_out(trained, tmp_path, monkeypatch,
                                                                                      caplog):
    """--int8 dynamic: MatMulInteger with per-tensor activations, the layouts tried recorded, both graphs alike. A
    fused-attention decoder that does not hold the recipe is left out, and the run completes without it (on SmolLM2
    the run exited 1 after 15 minutes, comparing the two quantized graphs' logits with each other)."""
    from dstool.compress import CompressConfig, compress, quantize

    monkeypatch.setattr(quantize, "fused_holds_the_recipe", lambda *errors: False)
    out = tmp_path / "dynamic"
    m = compress(CompressConfig(model=str(trained), output=str(out), bits=8, int8="dynamic", latency_repeats=3))
    q = m.recipe.quantization
    assert q and q.format == "int8-dynamic-qoperator" and q.cpu_vnni is not None and len(q.trials) >= 2
    assert set(m.graphs) == {"logits", "decoder"} and not (out / "onnx" / "fused").exists()
    for graph in m.graphs.values():
        assert {"MatMulInteger", "DynamicQuantizeLinear"} <= _ops(out / graph.path)
    assert len(q.fp32_nodes.get("decoder", [])) == len(q.fp32_nodes.get("logits", []))  # the same weights kept
    assert m.figures.compression_ratio < 0.35 and abs(m.figures.perplexity_change_pct) < 2.0
    cached, recomputed = _greedy(out, m, [5, 17, 300, 42, 7, 99], 8)
    assert cached == recomputed
    assert "int8: dynamic (QOperator, MatMulInteger)" in (out / "report.md").read_text()
    assert "left out, NAME_llm will run the decoder graph" in caplog.text


@pytest.mark.slow
def test_int4_cli(int8_output, int4_output):
    out = int4_output
    m = _manifest(out)
    # the fp32 baseline of `trained` was made for int8_output and kept: reused here, its figures as they were measured
    assert "baseline graphs and figures reused" in (out / "compress.log").read_text()
    kept = CompressedModel.read(int8_output).figures.before
    assert [getattr(m.figures.before, k) for k in ("parameters", "onnx_bytes", "perplexity", "zero_shot_accuracy")] \
        == [getattr(kept, k) for k in ("parameters", "onnx_bytes", "perplexity", "zero_shot_accuracy")]
    assert str(out / m.graphs["logits"].path) in (out.parent / "stdout").read_text()
    assert set(m.graphs) == {"logits", "decoder", "fused"}  # the fused-attention decoder by the same recipe
    assert all("MatMulNBits" in _ops(out / g.path) for g in m.graphs.values())
    assert "GroupQueryAttention" in _ops(out / m.graphs["fused"].path)
    assert m.recipe.quantization.block_size == 32 and m.recipe.quantization.weight_type == "int4 asymmetric"
    assert m.figures.compression_ratio < 0.25 and abs(m.figures.perplexity_change_pct) < 5


def _decoder_params(model) -> int:
    return sum(p.numel() for p in model.model.layers.parameters())


@pytest.mark.slow
def test_pruning_then_2_4_sparsity_with_distilled_recovery(trained, tmp_path_factory, worker_id):
    """The structural steps in one recipe: 40 % pruned, 2:4 masks on what is left, recovery (distilled from the
    original's logits) that keeps the masks. The lowest-loss layout, untimed (--prune-ppl-tolerance 0): timing the
    layouts within a tolerance is the next test's (at 0.4 here, five layouts exported and timed: a minute)."""
    from transformers import AutoModelForCausalLM

    out = _compressed(trained, tmp_path_factory, worker_id, "pruned_2_4", "--prune", "0.4", "--prune-ppl-tolerance",
                      "0", "--sparsity", "2:4", "--recover-steps", "8", "--distill", "--latency-repeats", "3")
    original = AutoModelForCausalLM.from_pretrained(trained)
    m = _manifest(out)
    pruned = AutoModelForCausalLM.from_pretrained(out / m.model)
    cfg = pruned.config
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0  # GQA: whole groups of query heads
    assert 0.40 <= 1 - _decoder_params(pruned) / _decoder_params(original) < 0.45
    assert m.figures.after.parameters == pruned.num_parameters() < m.figures.before.parameters
    assert m.figures.after.onnx_bytes < m.figures.before.onnx_bytes
    p = m.recipe.pruning
    assert p.rule == "lowest-loss" and p.ppl_tolerance_pct == 0
    assert p.mlp_channels == (512, cfg.intermediate_size)
    for removed in p.removed:  # what was removed, as indices of the original model
        assert len(removed.kv_groups) == 2 - cfg.num_key_value_heads
        assert len(removed.query_heads) == 6 - cfg.num_attention_heads
        assert len(removed.mlp_channels) == 512 - cfg.intermediate_size
    assert len(p.candidates) > 1 and all(c.latency_ms is None for c in p.candidates)  # each measured, none timed
    chosen = min(p.candidates, key=lambda c: c.calibration_loss)
    assert (chosen.kv_groups, chosen.kv_groups * chosen.heads_per_group, chosen.channels) == (
        cfg.num_key_value_heads, cfg.num_attention_heads, cfg.intermediate_size)
    masks = {n: w != 0 for n, w in pruned.named_parameters() if ".layers." in n and w.dim() == 2}
    check_n_m(pruned, masks, 2, 4)  # every group of 4 still has 2 zeros after fine-tuning
    assert sum(int((~mask).sum()) for mask in masks.values()) == sum(mask.numel() for mask in masks.values()) // 2
    assert m.recipe.sparsity.weights == len(masks) and not m.recipe.sparsity.sparse_kernels
    r = m.recipe.recovery
    assert r.distill and r.distill_kl[0] > 0 and r.kept
    assert r.calibration_ppl_after < r.calibration_ppl_before
    assert "in-domain" in (out / "report.md").read_text()  # its recovery figures are the recovery corpus's own
    cached, recomputed = _greedy(out, m, [5, 17, 300], 6)  # the pruned decoder graph, fp32
    assert cached == recomputed


@pytest.mark.slow
def test_fastest_layout_within_a_tolerance_then_a_recovery_that_is_discarded(trained, tmp_path_factory, worker_id):
    """--prune 0.1 --prune-ppl-tolerance 25: the tiny preset has two layouts (all 6 query heads, or 4 in 2 groups
    with more MLP channels), each exported and timed on ONNX Runtime; the fastest within 25 % is kept. Then a
    recovery at an lr far too high: its gate keeps the weights before it — exactly the original's kept rows."""
    from transformers import AutoModelForCausalLM

    out = _compressed(trained, tmp_path_factory, worker_id, "pruned_timed", "--prune", "0.1", "--prune-ppl-tolerance",
                      "25", "--recover-steps", "3", "--recover-lr", "0.3", "--latency-repeats", "3")
    m = _manifest(out)
    p = m.recipe.pruning
    assert len(p.candidates) == 2 and all(c.latency_ms > 0 for c in p.candidates)
    best_loss = min(c.calibration_loss for c in p.candidates)
    chosen = min((c for c in p.candidates if math.exp(c.calibration_loss - best_loss) <= 1.25 + 1e-9),
                 key=lambda c: c.latency_ms)
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert (chosen.kv_groups, chosen.kv_groups * chosen.heads_per_group, chosen.channels) == (
        cfg["num_key_value_heads"], cfg["num_attention_heads"], cfg["intermediate_size"])
    assert p.rule == "fastest-within-tolerance" and p.ppl_tolerance_pct == 25
    assert m.settings["prune_ppl_tolerance"] == 25
    r = m.recipe.recovery
    assert not r.kept and r.calibration_ppl_after > r.calibration_ppl_before
    original = AutoModelForCausalLM.from_pretrained(trained).model.layers
    pruned = AutoModelForCausalLM.from_pretrained(out / m.model).model.layers
    for layer, before, removed in zip(pruned, original, p.removed):  # untouched by the discarded fine-tuning
        kept = [c for c in range(512) if c not in removed.mlp_channels]
        assert torch.equal(layer.mlp.up_proj.weight, before.mlp.up_proj.weight[kept])
        assert torch.equal(layer.mlp.down_proj.weight, before.mlp.down_proj.weight[:, kept])


@pytest.mark.slow
def test_explicit_ratios_then_torchao_int8_in_one_recipe(trained, tmp_path_factory, worker_id):
    """--prune-heads/--prune-mlp as given, then torchao's PyTorch int8: a Hugging Face folder that reloads
    quantized, and both ONNX graphs of the pruned model (fp32)."""
    from transformers import AutoModelForCausalLM

    out = _compressed(trained, tmp_path_factory, worker_id, "pruned_torchao", "--prune-heads", "0.34", "--prune-mlp",
                      "0.5", "--bits", "8", "--engine", "torchao", "--latency-repeats", "3")
    m = _manifest(out)
    cfg = AutoModelForCausalLM.from_pretrained(out / m.model).config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 256)
    assert m.recipe.pruning.rule == "given-ratios" and m.recipe.quantization.format == "torchao-int8-dynamic"
    model = AutoModelForCausalLM.from_pretrained(out / m.recipe.quantization.torchao_folder)  # as a user would
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "Int8Tensor"
    t = m.torchao
    assert t.int8_weights == 4 * 7 and t.bytes < 0.8 * t.fp32_bytes
    assert abs(t.perplexity_int8 / t.perplexity_fp32 - 1) < 0.02
    decoder = onnx.load(str(out / m.graphs["decoder"].path), load_external_data=False).graph
    past = [i for i in decoder.input if i.name.startswith("past_key_values.")]
    assert past and all(i.type.tensor_type.shape.dim[1].dim_value == 2 for i in past)  # the pruned model's cache
    cached, recomputed = _greedy(out, m, [5, 17, 300], 6)
    assert cached == recomputed


@pytest.mark.parametrize("args,needle", [
    (["--bits", "3"], "bits must be 8 or 4"),
    (["--prune", "1.5"], "strictly between 0 and 1"),
    (["--prune-mlp", "0"], "strictly between 0 and 1"),
    (["--sparsity", "2-4"], "N:M pattern"),
    (["--sparsity", "4:2"], "N:M pattern"),
    ([], "nothing to do"),
    (["--bits", "8", "--distill"], "--distill needs --recover-steps"),
    (["--bits", "8", "--prune-ppl-tolerance", "5"], "give --prune RATIO with it"),
    (["--bits", "8", "--speed-gate", "fast"], "--speed-gate"),
])
def test_bad_options(trained, tmp_path, args, needle):
    one_line_usage_error(cli("compress", str(trained), *args, "--output", str(tmp_path / "o")), needle)
    assert not (tmp_path / "o").exists()


def test_bad_folders(trained, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((trained / "config.json").read_text())
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    for args, needle in (([str(tmp_path / "bert"), "--bits", "8", "--output", str(tmp_path / "o")], "not a causal LM"),
                         ([str(tmp_path / "noweights"), "--bits", "8", "--output", str(tmp_path / "o")],
                          "has no weights"),
                         ([str(trained), "--bits", "8", "--output", str(theirs)], "did not write"),
                         ([str(trained.parent), "--bits", "8", "--output", str(tmp_path / "o")],
                          f"is a dstool train run; pass its model folder {trained}"),
                         (["--bits", "8", "--output", str(tmp_path / "o")], "missing MODEL_DIR")):
        one_line_usage_error(cli("compress", *args), needle)
    assert not (tmp_path / "o").exists() and [p.name for p in theirs.iterdir()] == ["keep.txt"]


def test_speed_gate_is_opt_in(int8_output):
    """No gate by default (a slower model is written, its speeds reported); --speed-gate FIGURE compares that figure:
    here a model faster at prefill and at batch-1 decoding, slower at batch-16 decoding."""
    figures = CompressedModel.read(int8_output).figures.model_copy(
        update={"speedup": {"1": 2.0, "8": 1.5}, "decode_speedup": {"1": 0.96, "16": 0.9}})
    assert speed_gate(CompressConfig(model="m", output="o", bits=8), figures) is None  # the design card's command
    for target, passes in (("prefill", True), ("decode", False), ("batched-decode", False)):
        refused = speed_gate(CompressConfig(model="m", output="o", bits=4, speed_gate=target), figures)
        assert (refused is None) == passes
    assert "slower than fp32 in decoding tokens/s at batch 16 (0.90x, --speed-gate batched-decode)" in refused
    assert speed_gate(CompressConfig(model="m", output="o", prune=0.3, speed_gate="batched-decode"), figures) is None


def test_fp32_layers_stay_fp32_in_both_graphs(repo, trained, tmp_path):
    """A layer int8 keeps in fp32 in the logits graph stays fp32 in the decoder graph too: the exporter names the
    graphs' constants differently, so the weights are matched by content."""
    from dstool.compress import quantize

    logits, decoder = repo / "dstool_lm" / "1" / "model.onnx", repo / "dstool_lm_decoder" / "1" / "model.onnx"
    choice = quantize.int8_choice_for_this_cpu().with_excluded(quantize.weight_matmuls(logits)[-1:])  # lm_head
    nodes = quantize.same_weight_nodes(logits, choice.excluded_nodes, decoder)
    assert len(nodes) == 1
    a = quantize.quantize_int8(logits, tmp_path / "logits.onnx", choice)
    b = quantize.quantize_int8(decoder, tmp_path / "decoder.onnx", choice.with_excluded(nodes))
    kept_a, kept_b = (sorted(quantize.matmul_weight_digests(p).values()) for p in (a, b))
    assert kept_a == kept_b and len(kept_a) == 1 and "MatMulInteger" in _ops(b)
    vocab = json.loads((trained / "config.json").read_text())["vocab_size"]
    assert quantize.decoder_prefill_diff(a, b, vocab) <= quantize.PREFILL_TOLERANCE
    # the fused-attention decoder: its lm_head found by name (its Q, K, V weights are packed, so no digest matches)
    fused = repo / "dstool_lm_llm" / "1" / "fused" / "model.onnx"
    nodes = quantize.fused_nodes(fused, ["lm_head"])
    assert nodes == ["lm_head"] and len(quantize.fused_nodes(fused, ["layer 1"])) == 5
    c = quantize.quantize_int8(fused, tmp_path / "fused.onnx", choice.with_excluded(nodes))
    assert sorted(quantize.matmul_weight_digests(c).values()) == kept_a and "MatMulInteger" in _ops(c)
    assert quantize.fused_holds_the_recipe(*quantize.fused_prefill_errors(decoder, b, c, vocab))


def test_quality_measures(repo, trained):
    """The cloze task is deterministic, each item's true word first and unlike its distractors; a scorer that ignores
    the context (word counts of the training split) is near chance, one that reads the context's last token (bigram
    counts) well above it; a graph's top-1 predictions agree with themselves."""
    from transformers import AutoTokenizer

    from dstool.compress import measure, quality

    tokenizer = AutoTokenizer.from_pretrained(trained)
    calib, heldout, _ = measure.heldout_tokens(trained, tokenizer, None)
    task, again = quality.cloze_task(tokenizer, heldout), quality.cloze_task(tokenizer, heldout)
    assert np.array_equal(task.contexts, again.contexts) and np.array_equal(task.candidates, again.candidates)
    assert task.items >= 150 and task.contexts.shape[1] == 48 and task.choices == 4
    assert all(len(set(row)) == 4 for row in task.candidates.tolist())
    vocab = len(tokenizer)
    unigram = np.bincount(calib, minlength=vocab) + 1.0
    pairs, counts = np.unique(calib[:-1] * vocab + calib[1:], return_counts=True)
    keys = task.contexts[:, -1:] * vocab + task.candidates
    found = np.searchsorted(pairs, keys).clip(0, len(pairs) - 1)
    bigram = np.where(pairs[found] == keys, counts[found], 0) + unigram[task.candidates] / unigram.sum()

    def accuracy(score: np.ndarray) -> float:
        return float((score[:, 0] > score[:, 1:].max(1)).mean())

    assert abs(accuracy(unigram[task.candidates]) - 0.25) < 0.08 and accuracy(bigram) > 0.4
    graph = repo / "dstool_lm" / "1" / "model.onnx"
    assert 0 <= quality.cloze_accuracy(graph, task) <= 1
    ppl, top1 = measure.score_onnx(graph, heldout)
    assert ppl > 1 and top1.shape == (64, 127)  # the windows perplexity scores, every position but the last
    assert measure.top1_agreement(top1[:8], measure.score_onnx(graph, heldout, limit=8)[1]) == 1.0


def test_a_kept_baseline_is_keyed_by_what_makes_it_and_checked_before_reuse(tmp_path, monkeypatch):
    from dstool import artifacts
    from dstool.compress import baseline, quality
    from dstool.onnx_export import OnnxExport

    monkeypatch.setenv("DSTOOL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "config.json").write_text('{"vocab_size": 8}')
    heldout = np.arange(64)
    cloze = quality.Cloze(np.zeros((2, 4), np.int64), np.ones((2, 4), np.int64))
    key = baseline._key(src, artifacts.weights_sha256(src), heldout, cloze)
    assert baseline._key(src, artifacts.weights_sha256(src), heldout[:-1], cloze) != key  # other held-out tokens
    (src / "model.safetensors").write_bytes(b"other weights")
    assert baseline._key(src, artifacts.weights_sha256(src), heldout, cloze) != key  # other weights

    graphs = {}
    for role in ("logits", "decoder"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "model.onnx").write_bytes(role.encode())
        graphs[role] = OnnxExport(tmp_path / role / "model.onnx", 1e-6, ["input_ids"], ["logits"])
    entry = baseline._root() / key
    figures = {"parameters": 3, "onnx_bytes": 6, "perplexity": 2.5, "zero_shot_accuracy": 0.25}
    baseline._write(entry, baseline.Baseline(graphs["logits"], graphs["decoder"], figures, np.arange(5)))
    found = baseline._read(entry)
    assert found is not None and found.figures == figures and found.top1.tolist() == [0, 1, 2, 3, 4]
    assert found.logits.path.read_bytes() == b"logits" and found.logits.max_abs_diff == 1e-6
    (entry / "decoder" / "model.onnx").write_bytes(b"tampered")
    assert baseline._read(entry) is None  # made again, never reused changed
