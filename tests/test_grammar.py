"""Structured outputs in the sampler (llguidance on the trained tokenizer, random logits: the grammar alone makes the
answer valid) and tool calls read back from a model's text, piece by piece as a stream gives it."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from dstool.serve.gateway.tools import Calls, Tool, grammar
from dstool.serve.triton_models.grammar import GrammarError, Grammars, closed, grammar_of
from dstool.serve.triton_models.sampling import Sampler, SamplingError, SamplingParams, request_choices

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "kind": {"enum": ["a", "b c", "d\"e"]},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["name", "scores", "kind", "inner"]}


@pytest.fixture(scope="module")
def grammars(trained):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained)
    return Grammars(tokenizer, {tokenizer.eos_token_id}), tokenizer


def _generate(grammars, spec, seed: int, params=None, limit: int = 400) -> tuple[str, bool]:
    """(text, ended) of random logits sampled under `spec`."""
    g, tokenizer = grammars
    sampler = Sampler(SamplingParams.from_parameters(params or {"temperature": 1.0, "seed": seed}),
                      constraint=g.constraint(spec))
    rng, out = np.random.default_rng(seed), []
    for _ in range(limit):
        token = sampler.next(rng.standard_normal(len(tokenizer)).astype(np.float32) * 3, [1], out)
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(out), True
        out.append(token)
    return tokenizer.decode(out), False


def test_every_answer_under_a_schema_validates(grammars):
    ended = 0
    for seed in range(12):
        text, done = _generate(grammars, {"json": SCHEMA}, seed)
        if done:
            jsonschema.validate(json.loads(text), closed(SCHEMA))
            assert not re.search(r"\s", re.sub(r'"(?:\\.|[^"\\])*"', "", text))  # compact: no space between tokens
            ended += 1
    assert ended >= 10
    text, done = _generate(grammars, '{"choice": ["yes", "no"]}', 1, {"temperature": 0})  # greedy, spec as text
    assert done and text in ("yes", "no")
    text, done = _generate(grammars, {"regex": "[a-c]{2}[0-9]{1,3}"}, 2)
    assert done and re.fullmatch("[a-c]{2}[0-9]{1,3}", text)


def test_schemas_default_to_no_other_keys():
    assert closed({"type": "object", "properties": {"type": {"type": "object"}}}) == {
        "type": "object", "properties": {"type": {"type": "object", "additionalProperties": False}},
        "additionalProperties": False}
    assert closed({"type": "object", "additionalProperties": True}) == {"type": "object",
                                                                         "additionalProperties": True}
    assert closed({"anyOf": [{"properties": {}}], "$defs": {"A": {"type": "object"}}}) == {
        "anyOf": [{"properties": {}, "additionalProperties": False}],
        "$defs": {"A": {"type": "object", "additionalProperties": False}}}


DEEP: dict = {"type": "array"}
for _ in range(5000):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize("spec, needle", [
    ({"json": {"type": "integr"}}, "integr"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "("}, "regex"),
    ({"grammar": "start: missing"}, "missing"),
    ({"choice": []}, "choice"),
    ({"json": [1]}, "schema"),
    ({"json": 1, "regex": "a"}, "one of"),
    ("{not json", "JSON object"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}, "none"),
    ({"json": DEEP}, "deep"),
])
def test_grammars_the_engine_cannot_use_are_named(spec, needle):
    with pytest.raises(GrammarError, match=re.escape(needle)):
        grammar_of(spec)


def test_request_choices_takes_a_grammar_only_where_one_can_be_enforced(grammars):
    spec = json.dumps({"structured_outputs": '{"json_object": true}'})
    _, sampler, _ = request_choices(spec, 3, None, 8, 64, None, {0}, grammars[0])
    assert sampler.constraint is not None
    with pytest.raises(SamplingError, match="does not enforce grammars"):
        request_choices(spec, 3, None, 8, 64, None, {0})
    with pytest.raises(SamplingError, match="ignore_eos"):
        request_choices(json.dumps({"structured_outputs": '{"json_object": true}', "ignore_eos": True}), 3, None, 8,
                        64, None, {0}, grammars[0])
    with pytest.raises(SamplingError, match="integr"):
        request_choices(json.dumps({"structured_outputs": '{"json": {"type": "integr"}}'}), 3, None, 8, 64, None,
                        {0}, grammars[0])


TOOLS = [Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}),
         Tool("add", None, {"type": "object", "properties": {"a": {"type": "integer"}}})]


def _fed(calls: Calls, text: str, piece: int) -> tuple[str, list]:
    content, found = "", []
    for at in range(0, len(text), piece):
        c, f, _ = calls.feed(text[at:at + piece])
        content += c
        found += f
    return content + calls.end(), found


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_auto_reads_hermes_tool_calls_from_text_in_any_pieces(piece):
    text = ('Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Verona"}}</tool_call>'
            '<tool_call>{"name": "fly", "arguments": {}}</tool_call> and <tool_call>{"name": "add", "arguments": '
            '{"a": 1}}</tool_call><tool')
    content, found = _fed(Calls(TOOLS, "auto"), text, piece)
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": "Verona"}),
                                                                   ("add", {"a": 1})]
    # an unknown tool's call and an unfinished tag stay text
    assert content == 'Let me see. <tool_call>{"name": "fly", "arguments": {}}</tool_call> and <tool'
    content, found = _fed(Calls(TOOLS, "auto", parallel=False), text, piece)  # parallel_tool_calls false: one
    assert [c.name for c in found] == ["get_weather"] and content.endswith(
        'and <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool')


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_required_reads_each_call_of_the_array_when_it_closes(piece):
    text = ('[{"name":"get_weather","arguments":{"city":"a\\"}]{,"}},'
            '{"name":"add","arguments":{"a":3}}]')
    calls = Calls(TOOLS, "required")
    _, found = _fed(calls, text, piece)
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": 'a"}]{,'}),
                                                                   ("add", {"a": 3})]
    assert len({c.id for c in found}) == 2


def test_the_grammar_for_each_tool_choice():
    assert grammar(TOOLS, "auto", True) is None and grammar(TOOLS, "none", True) is None
    assert grammar(TOOLS, "add", True) == {"json": TOOLS[1].parameters}
    one = grammar(TOOLS, "required", False)["json"]
    assert one["maxItems"] == 1 and one["minItems"] == 1 and len(one["items"]["anyOf"]) == 2
    assert "maxItems" not in grammar(TOOLS, "required", True)["json"]
    named = Calls(TOOLS, "add")
    assert named.feed('{"a":')[2] == '{"a":' and named.feed("1}")[2] == "1}"
    assert named.calls[0].name == "add" and named.calls[0].arguments == '{"a":1}'
