"""A real pretrained model (SmolLM2-135M-Instruct, shipped as llama.cpp's GGUF in a PyPI wheel) through dstool: read as
users have it, and quantized by a recipe that keeps what it knows (the toy model trained here proves plumbing only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dstool.artifacts import GGUFModel

from conftest import COMPRESS_CODE, built_once, cli, one_line_usage_error


def test_a_gguf_is_read_as_users_have_it(real_model, tmp_path):
    from dstool import gguf

    m = GGUFModel.read(real_model, verify=True)
    assert m.source_sha256 == gguf.KNOWN["smollm2"].sha256 and m.dequantized and m.architecture == "llama"
    assert m.tensor_types.get("Q4_1", 0) > 100 and m.precision == "fp32"
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (real_model / "chat_template.jinja").is_file() or "chat_template" in \
        json.loads((real_model / "tokenizer_config.json").read_text())
    # the file itself, or a folder holding it, is the same converted folder (cached by the file's digest)
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "SmolLM2.gguf").symlink_to(m.source)
    assert gguf.resolve(m.source) == str(real_model) == gguf.resolve(str(holder))
    from dstool.artifacts import source_model  # what every later stage's manifest records of it

    recorded = source_model(real_model)
    assert (recorded.kind, recorded.gguf, recorded.gguf_sha256) == ("gguf-model", m.source, m.source_sha256)
    # what is not a GGUF is refused in one line, before any work
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    one_line_usage_error(cli("compress", str(tmp_path / "junk.gguf"), "--bits", "8", "--output",
                             str(tmp_path / "out")), "is not a readable GGUF file")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    one_line_usage_error(cli("compress", str(two), "--bits", "8", "--output", str(tmp_path / "out")),
                         "holds 2 .gguf files")


@pytest.fixture(scope="module")
def real_logits(real_model, real_repo):
    """The real model's logits graph (fp32: `dstool export` refuses one beyond 1e-3 of PyTorch's logits) and held-out
    tokens of real text."""
    from transformers import AutoTokenizer

    from dstool.compress import measure

    _, heldout, _ = measure.heldout_tokens(real_model, AutoTokenizer.from_pretrained(real_model), None)
    return real_repo / "smol" / "1" / "model.onnx", heldout


@pytest.fixture(scope="module")
def real_quantized(real_logits, tmp_path_factory, worker_id) -> dict[str, Path]:
    """The real logits graph quantized four ways (ONNX Runtime's quantizers, as `dstool compress` calls them): kept
    between runs like the export they read (dynamic int8 alone takes ~11 s)."""
    from dstool.compress import quantize

    graph, _ = real_logits

    def build(out: Path) -> None:
        out.mkdir(parents=True)
        quantize.quantize_nbits(graph, out / "w8.onnx", 8, 128, True, 4)
        quantize.quantize_int8(graph, out / "dyn.onnx", quantize.int8_choice_for_this_cpu())
        quantize.quantize_nbits(graph, out / "w4.onnx", 4, 128, False, None)
        quantize.quantize_nbits(graph, out / "w4s.onnx", 4, 128, True, None)

    folder = built_once(tmp_path_factory, worker_id, "real_quantized", build, COMPRESS_CODE, (graph,))
    return {name: folder / f"{name}.onnx" for name in ("w8", "dyn", "w4", "w4s")}


def test_int8_keeps_the_real_models_quality(real_logits, real_quantized):
    """Weight-only int8 (the default) recovers >= 99 % of the held-out perplexity; per-tensor dynamic int8, the
    earlier default, does not (SmolLM2's activation outliers): the reason the default changed."""
    from dstool.compress import measure

    graph, heldout = real_logits
    base = measure.perplexity_onnx(graph, heldout, limit=8)
    recovery = {name: 100 * base / measure.perplexity_onnx(graph, heldout, limit=8)
                for name, graph in real_quantized.items()}
    assert 20 < base < 200, base  # a model that knows English (random weights: ~50,000)
    assert recovery["w8"] >= 99.0, recovery  # weight-only
    assert recovery["dyn"] < 95.0, recovery  # dynamic
    # the default 4-bit recipe (a zero point per block) is the better one here
    assert recovery["w4"] > recovery["w4s"], recovery
    assert np.isfinite(recovery["w4"]) and recovery["w4"] > 80


@pytest.mark.slow
def test_the_served_greedy_answer_is_transformers(real_model, real_repo, tmp_path):
    """The real model exported (fp32) and served by Triton behind the gateway: its greedy chat answer through the
    OpenAI client is transformers' `generate` on the same folder, token for token, and a structured answer holds its
    schema."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    from gatewaylib import GatewayProcess

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in expected  # a model that knows something
    srv = triton.start(real_repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), tmp_path / "t.log",
                       extra_args=["--model-control-mode=explicit", "--load-model=smol_llm"])  # what the gateway asks
    gw = GatewayProcess(tmp_path / "gw.log", config={"upstreams": [srv.http_url], "upstreams_grpc": [srv.grpc_url],
                                                     "cache": "memory"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="x", max_retries=0,
                               timeout=300)
        answer = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=20)
        assert answer.choices[0].message.content == expected
        city = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "The capital of France, as JSON."}], temperature=0,
            max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "c", "strict": True,
                "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}}})
        assert set(json.loads(city.choices[0].message.content)) == {"city"}
    finally:
        gw.stop()
        assert srv.stop() == 0
