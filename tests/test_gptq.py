"""GPTQ (compress/gptq.py) and its codes in ONNX Runtime's MatMulNBits graphs (compress/quantize.py), on a tiny
random Llama: the packing is ORT's own, byte for byte; GPTQ's layer error is below round-to-nearest's on the same
grid; ORT computes with exactly the weights the codes stand for."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from transformers import LlamaConfig, LlamaForCausalLM

from dstool.compress import gptq, quantize
from dstool.fused_decoder import export_fused_decoder
from dstool.onnx_export import export_logits_model, ort_session, run_logits

# hidden 160 in blocks of 64: 3 blocks, the last padded, an odd count of zero points (ORT's edge cases)
TINY = {"vocab_size": 300, "hidden_size": 160, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 5, "num_key_value_heads": 1, "max_position_embeddings": 256}
BLOCK = 64


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def calibration():
    # token ids with structure (a random walk over a small vocabulary band), so activations are correlated
    steps = np.random.default_rng(1).integers(-3, 4, 40 * 64)
    return (np.cumsum(steps) % 280 + 10).astype(np.int64)


def _rtn_table(model, block: int) -> dict[str, gptq.BlockCodes]:
    """Round-to-nearest codes of every decoder Linear, keyed as quantize_model keys GPTQ's (Q/K/V packed too)."""
    table = {}
    for layer in model.model.layers:
        linears = {name: m.weight.data for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        codes = {name: gptq.rtn(w, block) for name, w in linears.items()}
        table.update({gptq.onnx_digest(linears[name].numpy()): c for name, c in codes.items()})
        packed = torch.cat([linears[name] for name in gptq.FUSED]).numpy()
        table[gptq.onnx_digest(packed)] = gptq.BlockCodes.stacked([codes[name] for name in gptq.FUSED])
    return table


def _initializers(path) -> dict[str, bytes]:
    return {i.name: numpy_helper.to_array(i).tobytes() for i in onnx.load(str(path)).graph.initializer}


def test_round_to_nearest_codes_are_ort_own_byte_for_byte(tiny, tmp_path):
    table = _rtn_table(tiny, BLOCK)
    layers = TINY["num_hidden_layers"]
    for graph, expected in ((export_logits_model(tiny, tmp_path / "logits").path, 7 * layers),
                            (export_fused_decoder(tiny, tmp_path / "fused").path, 5 * layers)):
        ort = quantize.quantize_nbits(graph, graph.with_name("ort.onnx"), 4, BLOCK, symmetric=False)
        ours, used = quantize.quantize_nbits_precomputed(graph, graph.with_name("ours.onnx"), BLOCK, table)
        assert used == expected  # every decoder MatMul took the precomputed codes (lm_head: ORT's own)
        theirs, mine = _initializers(ort), _initializers(ours)
        assert theirs.keys() == mine.keys()
        assert [k for k in theirs if theirs[k] != mine[k]] == []


def test_gptq_layer_error_is_below_round_to_nearest_on_the_same_grid():
    rng = np.random.default_rng(0)
    k, n = 192, 96
    mixing = rng.standard_normal((k, k)) * np.exp(-np.arange(k) / 24)  # correlated inputs, decaying spectrum
    x_calib = torch.from_numpy((rng.standard_normal((2048, k)) @ mixing).astype(np.float32))
    x_other = torch.from_numpy((rng.standard_normal((2048, k)) @ mixing).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    hessian = x_calib.double().T @ x_calib.double()
    by_gptq = torch.from_numpy(gptq.gptq(w, hessian, BLOCK).dequantized())
    by_rtn = torch.from_numpy(gptq.rtn(w, BLOCK).dequantized())
    for x in (x_calib, x_other):
        err_gptq = torch.linalg.norm(x @ (w - by_gptq).T)
        err_rtn = torch.linalg.norm(x @ (w - by_rtn).T)
        assert err_gptq < 0.8 * err_rtn, (float(err_gptq), float(err_rtn))
    # act-order (columns by decreasing Hessian diagonal, the grids fixed up front) is GPTQ too
    by_order = torch.from_numpy(gptq.gptq(w, hessian, BLOCK, act_order=True).dequantized())
    assert torch.linalg.norm(x_calib @ (w - by_order).T) < 0.8 * torch.linalg.norm(x_calib @ (w - by_rtn).T)


def test_gptq_on_a_model_is_closer_to_fp32_than_round_to_nearest(tiny, calibration):
    table = gptq.quantize_model(tiny, calibration, BLOCK, windows=32, seq_len=64)
    assert len(table) == 8 * TINY["num_hidden_layers"]  # 7 Linear weights a layer, and Q/K/V packed
    rtn = _rtn_table(tiny, BLOCK)
    ids = torch.from_numpy(calibration[-8 * 64:].reshape(8, 64))  # past the 32 x 64 calibration tokens
    with torch.no_grad():
        reference = tiny(input_ids=ids).logits
        errors = {}
        for label, codes in (("gptq", table), ("rtn", rtn)):
            model = LlamaForCausalLM(tiny.config).eval()
            model.load_state_dict(tiny.state_dict())
            for m in model.model.layers.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.data = torch.from_numpy(codes[gptq.onnx_digest(m.weight.data.numpy())].dequantized())
            errors[label] = float((model(input_ids=ids).logits - reference).pow(2).mean())
    assert errors["gptq"] < errors["rtn"], errors
    assert torch.equal(tiny(input_ids=ids).logits, reference)  # the model itself is left as it was


def test_ort_computes_with_the_weights_the_codes_stand_for(tmp_path):
    rng = np.random.default_rng(2)
    k, n = 160, 48
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((3, 5, k)).astype(np.float32)
    codes = gptq.gptq(w, torch.from_numpy(x.reshape(-1, k).T @ x.reshape(-1, k) + np.eye(k)), BLOCK)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "one",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 5, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 5, n])],
        [numpy_helper.from_array(np.ascontiguousarray(w.numpy().T), "w")])
    fp32 = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(fp32))
    path, used = quantize.quantize_nbits_precomputed(fp32, tmp_path / "mm.int4.onnx", BLOCK,
                                                     {gptq.onnx_digest(w.numpy()): codes})
    assert used == 1
    got = ort_session(path).run(None, {"x": x})[0]
    expected = x @ codes.dequantized().T
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(got - x @ w.numpy().T).max() > 1e-3  # ... and they are not the fp32 weights


def test_a_gptq_logits_graph_runs_as_the_torch_model_with_its_weights(tiny, calibration, tmp_path):
    table = gptq.quantize_model(tiny, calibration, BLOCK, windows=8, seq_len=64)
    graph = export_logits_model(tiny, tmp_path / "logits").path
    path, used = quantize.quantize_nbits_precomputed(graph, tmp_path / "q.onnx", BLOCK, table)
    assert used == 7 * TINY["num_hidden_layers"]
    ids = calibration[:2 * 32].reshape(2, 32)
    assert np.isfinite(run_logits(ort_session(path), ids)).all()


def test_int4_is_an_option_of_bits_4():
    from pydantic import ValidationError

    from dstool.compress import CompressConfig

    assert CompressConfig(model="m", output="o", bits=4, int4="gptq").int4 == "gptq"
    with pytest.raises(ValidationError, match="--int4 chooses how --bits 4 quantizes"):
        CompressConfig(model="m", output="o", bits=8, int4="gptq")
