"""DeepSeek MTP as a self-speculative draft: the tiny-moe preset trained with --mtp-layers 1, exported (the decoder
graph giving its last hidden state, the MTP layer as a draft graph in NAME_llm's folder, recorded in the manifest),
the graph equal to train/mtp.py's MTP layer on the model's real hidden states, greedy output identical with and
without MTP drafting (in process and on a real Triton), drafts accepted and counted; bad options refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dstool.decoding.engine import Engine, MTPDrafter, PrefixCache, Sequence, Speculation, engine_for
from dstool.decoding.sampling import Sampler, SamplingParams
from dstool.serve.export.repository import cache_shapes

from conftest import EXPORT_CODE, TRAIN_CODE, built_once, cli, dstool, one_line_usage_error
from llmlib import run_to_end

MTP = Speculation(2, method="deepseek_mtp")
# 40 steps at lr 3e-3 (the session's tiny model's run): enough for the MTP layer to predict some tokens right
TRAIN = ["--model", "tiny-moe", "--nproc", "1", "--zero", "0", "--max-steps", "40", "--save-every", "40", "--lr",
         "3e-3", "--seq-len", "64", "--micro-batch-size", "4", "--log-every", "10", "--no-tensorboard",
         "--mtp-layers", "1"]
PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?", "KING RICHARD:\nNow is the winter",
           "JULIET:\n"]
DECODER, DRAFT = "dstool_lm_decoder/1/model.onnx", "dstool_lm_llm/1/mtp/1/model.onnx"


@pytest.fixture(scope="module")
def mtp_repo(tmp_path_factory, worker_id) -> tuple[Path, Path]:
    """(the trained model folder, the repository its export wrote, NAME_llm drafting with deepseek_mtp)."""
    def build(out: Path) -> None:
        dstool("train", "--output", str(out / "run"), *TRAIN)
        dstool("export", str(out / "run" / "model"), "--repository", str(out / "repository"), "--instances", "1",
               "--speculative-config", MTP.text())
    made = built_once(tmp_path_factory, worker_id, "mtp_serving", build, TRAIN_CODE + EXPORT_CODE, (*TRAIN, MTP.text()))
    return made / "run" / "model", made / "repository"


@pytest.fixture(scope="module")
def graphs(mtp_repo):
    import onnxruntime as ort
    from transformers import AutoTokenizer

    model, repo = mtp_repo
    decoder, draft = (ort.InferenceSession(str(repo / g), providers=["CPUExecutionProvider"]) for g in (DECODER, DRAFT))
    return decoder, MTPDrafter(draft), cache_shapes(repo / "dstool_lm_generate" / "config.pbtxt"), \
        AutoTokenizer.from_pretrained(model)


def test_export_writes_the_mtp_graph_and_records_it(mtp_repo):
    from dstool.artifacts import Repository
    from dstool.files import sha256_file

    _, repo = mtp_repo
    deployment = Repository.read(repo).deployments[-1]
    assert deployment.graphs["mtp1"] == sha256_file(repo / DRAFT)
    config = (repo / "dstool_lm_llm" / "config.pbtxt").read_text()
    assert "mtp/1/model.onnx" in config and "deepseek_mtp" in config


def test_the_mtp_graph_is_train_mtp_s_layer_on_the_real_hidden_states(mtp_repo, graphs):
    """The decoder graph's hidden_states are the main model's last hidden state after its final norm, and the draft
    graph run on them (a prefill, then single steps on its cache) gives train/mtp.py's MTP-layer logits and output."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    from dstool.onnx_export import RELATIVE
    from dstool.train import mtp

    folder, _ = mtp_repo
    decoder, drafter, shapes, tokenizer = graphs
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert mtp.attach(model, 1, str(folder)) == 1
    model.eval()
    layer = mtp.layers(model)[0]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    n = len(ids) - 1
    with torch.no_grad():
        t = torch.tensor([ids])
        hidden = model.model(input_ids=t).last_hidden_state
        embeds = model.model.embed_tokens(t)
        pos = torch.arange(n)[None]
        mask = create_causal_mask(config=model.config, inputs_embeds=embeds[:, 1:], attention_mask=None, cache=None,
                                  position_ids=pos)
        out = layer(hidden[:, :n], embeds[:, 1:], attention_mask=mask, position_ids=pos,
                    position_embeddings=model.model.rotary_emb(embeds, pos))
        ref_logits = model.lm_head(layer.shared_head.norm(out))[0].numpy()
    empty = {name: np.zeros((1, h, 0, d), np.float32) for name, (h, d) in shapes.items()}
    ours = decoder.run(["hidden_states"], {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), int),
                                           "position_ids": np.arange(len(ids))[None], **empty})[0][0]
    assert np.abs(ours - hidden[0].numpy()).max() <= 1e-3 + RELATIVE * np.abs(hidden.numpy()).max()
    split = n - 3  # a prefill of the first positions, then one position at a time on the draft graph's cache
    logits, states, cache = drafter.run(ids[1:split + 1], ours[:split], 0, None)
    for i in range(split, n):
        row, state, cache = drafter.run(ids[i + 1:i + 2], ours[i:i + 1], i, cache)
        logits, states = np.concatenate([logits, row]), np.concatenate([states, state])
    assert np.abs(logits - ref_logits).max() <= 1e-3 + RELATIVE * np.abs(ref_logits).max()
    assert np.abs(states - out[0].numpy()).max() <= 1e-3 + RELATIVE * np.abs(out.numpy()).max()


def _run(engine: Engine, prompts: list[str], tokenizer, new_tokens: int = 40, params: dict | None = None
         ) -> list[list[int]]:
    """Each prompt's tokens (greedy, or sampled with `params`), the prompts added together."""
    sequences = [Sequence(str(i), tokenizer(p)["input_ids"], new_tokens,
                          Sampler(SamplingParams.from_parameters(params or {})).next, set())
                 for i, p in enumerate(prompts)]
    return run_to_end(engine, sequences)


def test_greedy_output_is_identical_and_mtp_drafts_are_accepted(graphs):
    """K 1 and 3 (past the model's one MTP depth: the layer chained on its own output), each prompt alone; then the
    three together (a batch: no drafting until one runs alone)."""
    decoder, drafter, shapes, tokenizer = graphs
    accepted = 0
    for k in (1, 3):
        for prompt in PROMPTS:
            plain = _run(engine_for(decoder, shapes), [prompt], tokenizer)
            engine = engine_for(decoder, shapes, speculation=Speculation(k, method="deepseek_mtp"), mtp=drafter)
            assert _run(engine, [prompt], tokenizer) == plain
            counts = engine.spec_counts
            assert counts.drafts > 0 and counts.accepted <= counts.draft_tokens <= k * counts.drafts
            assert sum(counts.accepted_at) == counts.accepted and len(counts.accepted_at) == k
            accepted += counts.accepted
    assert accepted > 0  # mean accept length above 0: bench/mtp_serving.py measures it on a longer-trained model
    engine = engine_for(decoder, shapes, speculation=MTP, mtp=drafter)
    assert _run(engine, PROMPTS, tokenizer) == _run(engine_for(decoder, shapes), PROMPTS, tokenizer)


def test_a_batched_rows_unread_hidden_states_are_bounded(graphs, monkeypatch):
    """Rows in a batch do not draft, so their hidden states would pile up for the whole sequence: past MTP_PENDING
    the MTP layer reads them in (a bound of 4 here, the prompts 7-17 tokens). The output stays the same, and the row
    left alone at the end still drafts and has drafts accepted."""
    from dstool.decoding import engine as engine_module

    decoder, drafter, shapes, tokenizer = graphs
    plain = _run(engine_for(decoder, shapes), PROMPTS, tokenizer)
    monkeypatch.setattr(engine_module, "MTP_PENDING", 4)
    engine = engine_for(decoder, shapes, speculation=MTP, mtp=drafter)
    sequences = [Sequence(str(i), tokenizer(p)["input_ids"], 40 + 20 * i, Sampler(SamplingParams()).next, set())
                 for i, p in enumerate(PROMPTS)]
    for s in sequences:
        engine.add(s)
    most = 0
    while engine.busy:
        for s, token in engine.step():
            assert token is not None, s.error
        most = max([most, *(s.mtp.pending for s in sequences if s.mtp is not None)])
    assert 0 < most <= 4
    assert [s.output[:40] for s in sequences] == plain
    assert engine.spec_counts.drafts > 0 and engine.spec_counts.accepted > 0


def test_seeded_sampling_and_prefix_cache_hits_give_the_same_tokens(graphs):
    """Seeded sampling draws the same tokens (verification chooses with the sequence's own sampler); a prompt whose
    prefix comes from the prefix cache (no hidden states for those positions: the MTP cache starts after them)
    too."""
    decoder, drafter, shapes, tokenizer = graphs
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 5}
    engine = engine_for(decoder, shapes, speculation=MTP, mtp=drafter)
    assert _run(engine, PROMPTS[:1], tokenizer, params=sampled) == \
        _run(engine_for(decoder, shapes), PROMPTS[:1], tokenizer, params=sampled)
    assert engine.spec_counts.drafts > 0
    long = [PROMPTS[0] + " " + PROMPTS[1]]  # more than a 16-token block
    cached = engine_for(decoder, shapes, prefix_cache=PrefixCache(16, 256), speculation=MTP, mtp=drafter)
    plain = _run(engine_for(decoder, shapes), long, tokenizer)
    assert _run(cached, long, tokenizer) == plain and _run(cached, long, tokenizer) == plain
    assert cached.prefix_cache is not None and cached.prefix_cache.hit > 0


@pytest.mark.parametrize("value, needle", [
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 17}', "num_speculative_tokens must be"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "prompt_lookup_max is not read"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be")])
def test_bad_mtp_options_are_refused_by_name(value, needle):
    with pytest.raises(ValueError, match=needle):
        Speculation.parse(value)
    assert Speculation.parse('{"method": "mtp", "num_speculative_tokens": 3}') == Speculation(3, method="mtp")


def test_mtp_on_a_model_without_it_is_refused_in_one_line(mtp_repo, graphs, tmp_path):
    decoder, _, shapes, _ = graphs
    with pytest.raises(ValueError, match="has none .num_nextn_predict_layers 0"):
        engine_for(decoder, shapes, speculation=MTP)
    folder, _ = mtp_repo
    plain = tmp_path / "no_mtp"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    one_line_usage_error(cli("export", str(plain), "--repository", str(tmp_path / "r"), "--speculative-config",
                             MTP.text()), "speculative_config: method deepseek_mtp drafts with the model's MTP module")
    assert not (tmp_path / "r").exists()


def test_triton_serves_mtp_drafting_with_identical_output_and_counts_it(mtp_repo, session_tmp):
    """NAME_llm with deepseek_mtp on a real Triton, beside the same model without speculation (plain_llm): the same
    text, its drafts and accepted tokens on /metrics."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    from llmlib import post

    _, exported = mtp_repo
    repo = session_tmp / "mtp_triton_repository"
    for model in ("dstool_lm_llm", "dstool_lm_decoder"):  # NAME_llm reads the decoder graph in NAME_decoder's folder
        shutil.copytree(exported / model, repo / model)
    shutil.copytree(exported / "dstool_lm_llm", repo / "plain_llm")
    config = text_format.Parse((repo / "plain_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = "plain_llm"
    del config.parameters["speculative_config"]
    (repo / "plain_llm" / "config.pbtxt").write_text(text_format.MessageToString(config))
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "mtp-triton.log")
    try:
        texts = {}
        for model in ("dstool_lm_llm", "plain_llm"):
            status, _, raw = post(srv.http_port, f"/v2/models/{model}/generate",
                                  {"text_input": PROMPTS[0], "max_new_tokens": 40,
                                   "parameters": {"min_tokens": 40}})  # (the tiny model soon ends a line's text)
            assert status == 200, raw
            texts[model] = json.loads(raw)["text_output"]
        assert texts["dstool_lm_llm"] == texts["plain_llm"] and texts["plain_llm"]
        counts = _spec_counters(srv.metrics_port)
        assert counts["vllm:spec_decode_num_drafts_total"] > 0
        assert 0 < counts["vllm:spec_decode_num_accepted_tokens_total"] <= \
            counts["vllm:spec_decode_num_draft_tokens_total"]
    finally:
        assert srv.stop() == 0, srv.log_tail(30)


def _spec_counters(port: int) -> dict[str, float]:
    """dstool_lm's vLLM spec_decode counters on Triton's /metrics, once they stop moving (NAME_llm publishes a
    step's figures after its responses)."""
    import re
    import time
    import urllib.request

    last: dict[str, float] = {}
    for _ in range(50):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        now = {m[1]: float(m[2]) for m in re.finditer(r'^(vllm:spec_decode_num_\w+_total)\{model_name="dstool_lm"\} '
                                                      r'(\S+)$', text, re.M)}
        if now and now == last:
            return now
        last = now
        time.sleep(0.3)
    raise AssertionError(f"the spec_decode counters kept moving: {last}")
