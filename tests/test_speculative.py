"""N-gram (prompt-lookup) speculative decoding in the engine (dstool/decoding/engine.py) on the exported graphs of the
session's tiny model: outputs identical with and without it (greedy, seeded sampling, a grammar), vLLM's counters,
the rule of when it drafts; NAME_llm on a real Triton: the speculative config in its parameters, its vllm:spec_decode_*
metrics, a request turning it off; bad values refused, by export and by NAME_llm."""

from __future__ import annotations

import json
import shutil

import pytest

from dstool.decoding.engine import Engine, Sequence, SpecCounts, Speculation, engine_for
from dstool.decoding.grammar import Grammars
from dstool.decoding.sampling import Sampler, SamplingParams
from dstool.serve.export.repository import cache_shapes

GRAPHS = {"exported": "dstool_lm_decoder/1/model.onnx", "fused": "dstool_lm_llm/1/fused/model.onnx"}
NGRAM = Speculation(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
# input-grounded: the answer repeats what the prompt holds (the tiny model's greedy text loops, too)
PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
           "ROMEO:\nBut soft, what light", "KING RICHARD:\nNow is the winter of our discontent", "JULIET:\n"]


@pytest.fixture(scope="module", params=list(GRAPHS))
def setup(repo, trained, request):
    """The engine's graph: the exported decoder (Engine), or the fused-attention one NAME_llm runs (FusedEngine)."""
    import onnxruntime as ort
    from transformers import AutoTokenizer

    session = ort.InferenceSession(str(repo / GRAPHS[request.param]), providers=["CPUExecutionProvider"])
    return session, cache_shapes(repo / "dstool_lm_generate" / "config.pbtxt"), AutoTokenizer.from_pretrained(trained)


def _run(engine: Engine, sequences: list[Sequence]) -> dict[str, list[int]]:
    """Each sequence's tokens as the engine's steps made them (every token once, in order)."""
    for s in sequences:
        engine.add(s)
    out: dict[str, list[int]] = {}
    while engine.busy:
        for s, token in engine.step():
            assert token is not None, s.error
            out.setdefault(s.id, []).append(token)
    for s in sequences:
        assert out[s.id] == s.output
    return out


def _both(setup, make, max_batch: int = 4) -> tuple[dict, dict, Engine]:
    """(tokens without speculation, tokens with it, the speculating engine): `make()` gives fresh sequences."""
    session, shapes, _ = setup
    plain = _run(engine_for(session, shapes, max_batch=max_batch), make())
    engine = engine_for(session, shapes, max_batch=max_batch, speculation=NGRAM)
    return plain, _run(engine, make()), engine


def _sequences(tokenizer, params: dict | None = None, new_tokens: int = 40, grammars=None, spec=None,
               speculative: int | None = None, eos: bool = True) -> list[Sequence]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        sampler = Sampler(SamplingParams.from_parameters(params or {}),
                          constraint=grammars.constraint(spec) if grammars else None)
        out.append(Sequence(str(i), tokenizer(prompt)["input_ids"], new_tokens, sampler.next,
                            {tokenizer.eos_token_id} if eos else set(), speculative=speculative))
    return out


def _sane(counts: SpecCounts) -> None:
    assert counts.drafts > 0 and 0 < counts.accepted <= counts.draft_tokens <= 4 * counts.drafts
    at = counts.accepted_at
    assert sum(at) == counts.accepted and at == sorted(at, reverse=True) and at[0] <= counts.drafts


def test_greedy_output_is_identical_and_drafts_are_accepted(setup):
    _, _, tokenizer = setup
    for one in range(len(PROMPTS)):  # alone, each: the engine drafts for a lone sequence
        plain, fast, engine = _both(setup, lambda one=one: _sequences(tokenizer)[one:one + 1])
        assert fast == plain
        _sane(engine.spec_counts)
    plain, fast, engine = _both(setup, lambda: _sequences(tokenizer))  # a batch, then the last one alone
    assert fast == plain


def test_seeded_sampling_gives_the_same_tokens(setup):
    _, _, tokenizer = setup
    for params in ({"temperature": 0.5, "seed": 7}, {"temperature": 1.0, "top_p": 0.9, "seed": 3,
                                                     "repetition_penalty": 1.1, "frequency_penalty": 0.2}):
        plain, fast, engine = _both(setup, lambda params=params: _sequences(tokenizer, params, eos=False)[:1])
        assert fast == plain
        assert engine.spec_counts.drafts > 0


def test_a_grammar_constrained_answer_is_identical(setup):
    _, _, tokenizer = setup
    grammars = Grammars(tokenizer, {tokenizer.eos_token_id})
    spec = {"regex": "(the (king|queen) is (dead|here)\\. ){3,12}"}
    plain, fast, engine = _both(setup, lambda: _sequences(tokenizer, grammars=grammars, spec=spec, new_tokens=80)[:1])
    assert fast == plain
    _sane(engine.spec_counts)


def test_it_drafts_only_for_a_lone_sequence_and_as_each_asks(setup):
    session, shapes, tokenizer = setup
    engine = engine_for(session, shapes, max_batch=4, speculation=NGRAM)
    for s in _sequences(tokenizer, new_tokens=12):
        engine.add(s)
    while engine.busy:
        before, alone = engine.spec_counts.drafts, len(engine.running) == 1 and not engine.waiting
        engine.step()
        assert engine.spec_counts.drafts == before or alone
    engine = engine_for(session, shapes, speculation=NGRAM)
    engine.add(_sequences(tokenizer, {"temperature": 1.0, "seed": 1}, new_tokens=60, eos=False)[0])
    failed = False
    while engine.busy:  # a draft none of which was accepted: the next step does not draft (the backoff)
        before = engine.spec_counts.copy()
        engine.step()
        drafted = engine.spec_counts.drafts > before.drafts
        assert not (failed and drafted)
        failed = drafted and engine.spec_counts.accepted == before.accepted
    for speculative, drafted in ((0, 0), (1, 1)):  # off; one draft token per step
        engine = engine_for(session, shapes, speculation=NGRAM)
        _run(engine, _sequences(tokenizer, speculative=speculative)[:1])
        assert engine.spec_counts.draft_tokens == drafted * engine.spec_counts.drafts
        assert bool(engine.spec_counts.drafts) == bool(drafted)


def test_max_new_tokens_and_stop_ids_end_it_exactly_where_plain_decoding_does(setup):
    _, _, tokenizer = setup
    for new_tokens in (1, 2, 5, 17):
        plain, fast, _ = _both(setup, lambda new_tokens=new_tokens: _sequences(tokenizer, new_tokens=new_tokens)[:1])
        assert fast == plain and len(fast["0"]) == new_tokens
    stop = _both(setup, lambda: _sequences(tokenizer)[:1])[0]["0"][9]  # a token it makes, a stop id now

    def stopping():
        s = _sequences(tokenizer)[:1]
        s[0].stop_ids.add(stop)
        return s

    plain, fast, _ = _both(setup, stopping)
    assert fast == plain and fast["0"][-1] == stop and stop not in fast["0"][:-1]


def test_a_choice_failing_at_a_draft_ends_its_sequence_after_the_tokens_before_it(setup):
    session, shapes, tokenizer = setup
    plain = _both(setup, lambda: _sequences(tokenizer)[:1])[0]["0"]
    engine = engine_for(session, shapes, speculation=NGRAM)
    s = _sequences(tokenizer)[0]
    calls, choose = [0], s.choose

    def failing(logits, prompt, output):
        calls[0] += 1
        if calls[0] == 12:
            raise RuntimeError("no choice")
        return choose(logits, prompt, output)

    s.choose = failing
    engine.add(s)
    made: list[int | None] = []
    while engine.busy:
        made += [token for _, token in engine.step()]
    assert made == [*plain[:11], None] and s.error == "RuntimeError: no choice" and engine.spec_counts.drafts


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    ngram = Speculation(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    assert ngram.draft([1, 2, 3, 9, 8, 7, 6, 1, 2, 3], 3) == [9, 8, 7]
    assert ngram.draft([5, 1, 2, 4, 1, 2, 7, 7, 1, 2], 2) == [7, 7]  # the most recent of two matches
    assert ngram.draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram.draft([1, 2, 3, 4, 5, 3], 3) == []  # one token recurs: shorter than prompt_lookup_min
    assert ngram.draft([4, 4, 4], 3) == [4]


@pytest.mark.parametrize("value, needle", [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "draft_model": "x"}', "draft_model"),
    ("ngram", "JSON")])
def test_a_bad_speculative_config_is_refused_by_name(value, needle):
    with pytest.raises(ValueError, match=needle):
        Speculation.parse(value)
    assert Speculation.parse('{"method": "ngram", "num_speculative_tokens": 3}') == Speculation(3, 5, 5)
    assert Speculation.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}) == \
        Speculation(3, 4, 4)


def test_export_refuses_a_bad_speculative_config_in_one_line(trained, tmp_path):
    from conftest import cli, one_line_usage_error

    for value, needle in (('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
                          ('{"method": "draft_model", "num_speculative_tokens": 2}', "method must be"),
                          ("ngram", "must be the JSON text")):
        one_line_usage_error(cli("export", str(trained), "--repository", str(tmp_path / "r"), "--speculative-config",
                                 value), f"speculative_config: {needle}")
    assert not (tmp_path / "r").exists()


SPEC_LLM, PLAIN_LLM = "dstool_lm_llm", "plain_llm"  # the same model, exported with speculation; and without it


@pytest.fixture(scope="module")
def spec_server(trained, session_tmp, tmp_path_factory, worker_id):
    """A real Triton serving `trained` exported with --speculative-config (NAME_llm only), and the same model
    without it as plain_llm."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    from conftest import EXPORT_CODE, built_once, dstool

    args = (str(trained), "--instances", "1", "--speculative-config", NGRAM.text())
    exported = built_once(tmp_path_factory, worker_id, "speculative_repository",
                          lambda out: dstool("export", "--repository", str(out), *args), EXPORT_CODE, args)
    repo = session_tmp / "speculative_repository"
    shutil.copytree(exported / SPEC_LLM, repo / SPEC_LLM)
    shutil.copytree(exported / SPEC_LLM, repo / PLAIN_LLM)
    config = text_format.Parse((repo / PLAIN_LLM / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = PLAIN_LLM
    del config.parameters["speculative_config"]
    (repo / PLAIN_LLM / "config.pbtxt").write_text(text_format.MessageToString(config))
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "speculative-triton.log")
    yield srv, repo
    assert srv.stop() == 0, srv.log_tail(30)


def _counters(srv, served: str = "dstool_lm") -> dict[str, float]:
    """The spec_decode counters of `served` on Triton's /metrics, by name (per position: name[position])."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'(vllm:spec_decode_\w+|dstool_llm_spec_decode_\w+)\{(.*)\} (\S+)$', line)
        if m and (f'model_name="{served}"' in m[2] or f'model="{served}_llm"' in m[2]):
            position = re.search(r'position="(\d+)"', m[2])
            out[m[1] + (f"[{position[1]}]" if position else "")] = float(m[3])
    return out


def _settled(srv) -> dict[str, float]:
    """The counters once they stop moving (NAME_llm publishes a step's figures after its responses)."""
    import time

    last = _counters(srv)
    for _ in range(50):
        time.sleep(0.3)
        now = _counters(srv)
        if now == last:
            return now
        last = now
    raise AssertionError("the spec_decode counters kept moving")


def _generate(srv, body: dict, model: str = SPEC_LLM) -> tuple[int, dict]:
    from llmlib import post

    status, _, raw = post(srv.http_port, f"/v2/models/{model}/generate", body)
    return status, json.loads(raw)


def test_triton_serves_it_counts_it_and_a_request_turns_it_off(spec_server):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from llmlib import post, sse_events

    srv, repo = spec_server
    config = text_format.Parse((repo / SPEC_LLM / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert json.loads(config.parameters["speculative_config"].string_value) == json.loads(NGRAM.text())
    body = {"text_input": PROMPTS[0], "max_new_tokens": 40}
    before = _settled(srv)
    status, on = _generate(srv, body)
    assert status == 200, on
    counts = _settled(srv)
    drafts = counts["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0)
    accepted = counts["vllm:spec_decode_num_accepted_tokens_total"] - \
        before.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    assert drafts > 0 and accepted > 0
    assert counts["vllm:spec_decode_num_draft_tokens_total"] >= counts["vllm:spec_decode_num_accepted_tokens_total"]
    assert sum(v for k, v in counts.items() if "per_pos" in k) == counts["vllm:spec_decode_num_accepted_tokens_total"]
    for ours, theirs in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                         ("accepted_tokens", "num_accepted_tokens")):
        assert counts[f"dstool_llm_spec_decode_{ours}_total"] == counts[f"vllm:spec_decode_{theirs}_total"]
    status, off = _generate(srv, {**body, "parameters": {"num_speculative_tokens": 0}})
    assert status == 200 and off["text_output"] == on["text_output"]
    assert _settled(srv)["vllm:spec_decode_num_drafts_total"] == counts["vllm:spec_decode_num_drafts_total"]
    status, plain = _generate(srv, body, PLAIN_LLM)
    assert status == 200 and plain["text_output"] == on["text_output"] and not _counters(srv, "plain")
    text = on["text_output"]
    for n in range(5, 10):  # stop strings found at several places of a step's tokens: the same cut either way
        stop = text[len(text) // 2:len(text) // 2 + n]
        cut = [_generate(srv, {**body, "parameters": {"stop": stop, **p}})[1]["text_output"]
               for p in ({}, {"num_speculative_tokens": 0})]
        assert cut[0] == cut[1] and stop in cut[0] and len(cut[0]) < len(text)
    status, _, raw = post(srv.http_port, f"/v2/models/{SPEC_LLM}/generate_stream", {**body, "stream": True})
    events = sse_events(raw)
    assert status == 200 and "".join(e["text_output"] for e in events) == text
    ids = [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]
    assert ids == on["output_ids"]


@pytest.mark.parametrize("model, value, needle", [
    (SPEC_LLM, 5, "from 0 to 4"), (SPEC_LLM, -1, "from 0 to 4"), (SPEC_LLM, "2", "from 0 to 4"),
    (SPEC_LLM, True, "from 0 to 4"), (PLAIN_LLM, 1, "does not speculate")])
def test_a_bad_num_speculative_tokens_is_a_400_naming_it(spec_server, model, value, needle):
    status, answer = _generate(spec_server[0], {"text_input": "JULIET:", "max_new_tokens": 3,
                                                "parameters": {"num_speculative_tokens": value}}, model)
    assert status == 400 and "num_speculative_tokens" in answer["error"] and needle in answer["error"], answer
    assert _generate(spec_server[0], {"text_input": "JULIET:", "max_new_tokens": 3,
                                      "parameters": {"num_speculative_tokens": 0}}, model)[0] == 200
