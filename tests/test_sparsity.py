"""Unstructured magnitude sparsity (`--sparsity 0.65`) on a model trained by `dstool train`: the exact share of
zeros, recovery that keeps them, and storage as bitmask + nonzero values that loads back into transformers and into
ONNX Runtime sessions with the dense logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from dstool import fused_decoder
from dstool.artifacts import CompressedModel
from dstool.compress import load, sparse
from dstool.onnx_export import empty_cache, export_logits_model, ort_session, run_decoder, run_logits

from conftest import COMPRESS_CODE, built_once, cli, dstool, one_line_usage_error

FRACTION = 0.65


@pytest.fixture(scope="module")
def sparse_output(trained, tmp_path_factory, worker_id) -> Path:
    args = (str(trained), "--sparsity", str(FRACTION), "--recover-steps", "6", "--latency-repeats", "2")
    return built_once(tmp_path_factory, worker_id, "sparsity", lambda out: dstool(
        "compress", *args, "--output", str(out), timeout=1800), COMPRESS_CODE, args)  # ~1 min on a quiet machine


def _linears(model) -> dict[str, torch.Tensor]:
    return {name: m.weight.detach() for name, m in model.model.layers.named_modules()
            if isinstance(m, torch.nn.Linear)}


def test_sparsity_output_zeros_storage_and_graphs(sparse_output):
    out = sparse_output
    m = CompressedModel.read(out, verify=True)
    s, r = m.recipe.sparsity, m.recipe.recovery
    assert s.fraction == FRACTION and s.n is None and not s.sparse_kernels
    assert r.kept and r.calibration_ppl_after < r.calibration_ppl_before  # recovery changed the weights...
    model = load(out / m.model)
    weights = _linears(model)
    assert len(weights) == s.weights == 28
    for name, w in weights.items():  # ...and every masked weight still holds exactly its zeros
        assert int((w == 0).sum()) == round(FRACTION * w.numel()), name
    params = list(model.parameters())
    assert s.total_zero_share == sum(int((p == 0).sum()) for p in params) / sum(p.numel() for p in params)
    assert s.decoder_zero_share == pytest.approx(FRACTION, abs=1e-4) and 0.25 < s.total_zero_share < 0.4
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(m.source.path)
    for part in ("get_input_embeddings", "get_output_embeddings"):  # not masked (recovery trains them, though)
        after, before = getattr(model, part)().weight, getattr(original, part)().weight
        assert int((after == 0).sum()) == int((before == 0).sum()) and not torch.equal(after, before)

    # stored as the manifest says, and as small as bitmask + values make it
    t = s.storage
    files = list((out / "model").glob("*.safetensors"))
    assert [f.name for f in files] == ["model.sparse.safetensors"]
    assert t.model_bytes == files[0].stat().st_size
    assert t.encoded == {"model": 28, "logits": 28, "decoder": 28, "fused": 20}  # Q, K and V packed in the last
    masked = sum(w.numel() for w in weights.values())
    kept = sum(int(w.count_nonzero()) for w in weights.values())
    expected = t.model_dense_bytes - 4 * masked + 4 * kept + masked / 8  # fp32 values + 1 bit an entry
    assert abs(t.model_bytes - expected) < 0.01 * t.model_dense_bytes
    assert t.model_bytes < 0.75 * t.model_dense_bytes  # embeddings and lm_head are half of the tiny preset, dense
    for role, g in m.graphs.items():
        size = (out / g.path).stat().st_size + (out / g.data).stat().st_size
        assert t.onnx_bytes[role] == size < 0.75 * t.onnx_dense_bytes[role]
        graph = onnx.load(str(out / g.path), load_external_data=False).graph
        assert sum(n.op_type == "CumSum" for n in graph.node) == t.encoded[role]
    assert m.figures.after.onnx_bytes == t.onnx_bytes["logits"]
    assert m.figures.compression_ratio == t.onnx_bytes["logits"] / m.figures.before.onnx_bytes

    # the graphs load in ONNX Runtime and compute what the reloaded model does
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 21))
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    logits = run_logits(ort_session(out / m.graphs["logits"].path), ids)
    decoder = ort_session(out / m.graphs["decoder"].path)
    prefill = run_decoder(decoder, ids, empty_cache(decoder, 2), 0)[0]
    assert np.abs(logits - ref).max() < 1e-4 and np.abs(prefill - logits).max() < 1e-4
    assert np.abs(fused_decoder.prefill(ort_session(out / m.graphs["fused"].path), ids) - logits).max() < 1e-4
    report = (out / "report.md").read_text()
    assert "kernels: dense" in report and "no faster" in report

    # plain transformers refuses the folder instead of loading other weights; dstool names the way
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(out / m.model)
    one_line_usage_error(cli("export", str(out / m.model), "--repository", str(out.parent / "r0")),
                         "dstool.compress.load")


def test_export_deploys_the_sparse_graphs(sparse_output, tmp_path):
    from dstool.serve.export import repository

    m = CompressedModel.read(sparse_output)
    result = cli("export", str(sparse_output), "--repository", str(tmp_path / "r"), "--name", "sp")
    assert result.returncode == 0, result.stderr
    names = repository.model_names("sp")
    ids = np.array([[5, 17, 300, 42, 7]])
    expected = run_logits(ort_session(sparse_output / m.graphs["logits"].path), ids)
    for role in ("logits", "decoder"):
        folder = tmp_path / "r" / names[role]
        repository.validate(folder / "config.pbtxt", folder / "1" / "model.onnx")
        assert (folder / "1" / "model.onnx.data").stat().st_mode & 0o044  # readable by a server in another account
    deployed = run_logits(ort_session(tmp_path / "r" / names["logits"] / "1" / "model.onnx"), ids)
    assert np.abs(deployed - expected).max() == 0
    fused = ort_session(tmp_path / "r" / names["llm"] / "1" / "fused" / "model.onnx")  # NAME_llm's, stored sparse
    assert np.abs(fused_decoder.prefill(fused, ids) - expected).max() < 1e-4


def test_storage_round_trip_is_exact_and_onnx_runtime_folds_it(trained, tmp_path):
    """Without the pipeline: the masked model's own logits back from the stored folder and graph, and ONNX
    Runtime's optimized graph is the dense graph's (the rebuild is folded at session creation, not run per call)."""
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    masks = sparse.apply_unstructured(model, 0.9)
    assert all(int((~mask).sum()) == round(0.9 * mask.numel()) for mask in masks.values())
    model.save_pretrained(tmp_path / "hf")
    assert sorted(sparse.save_folder(tmp_path / "hf")) == sorted(masks)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        assert torch.equal(load(tmp_path / "hf")(input_ids=ids).logits, ref)

    dense = export_logits_model(model, tmp_path / "dense").path
    shutil.copytree(dense.parent, tmp_path / "sparse")
    stored = tmp_path / "sparse" / dense.name
    assert len(sparse.encode_onnx(stored)) == len(masks)
    assert np.array_equal(run_logits(ort_session(stored), ids.numpy()), run_logits(ort_session(dense), ids.numpy()))
    optimized = {}
    for name, path in (("dense", dense), ("sparse", stored)):
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        optimized[name] = sorted(n.op_type for n in onnx.load(opts.optimized_model_filepath,
                                                                  load_external_data=False).graph.node)
    assert optimized["sparse"] == optimized["dense"] and "CumSum" not in optimized["sparse"]


@pytest.mark.parametrize("value", ["0", "1", "1.5", "abc"])
def test_bad_sparsity_fraction(trained, tmp_path, value):
    one_line_usage_error(cli("compress", str(trained), "--sparsity", value, "--output", str(tmp_path / "o")),
                         "fraction strictly between 0 and 1")
