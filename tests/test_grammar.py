"""Structured outputs in the sampler (llguidance on the trained tokenizer, random logits: the grammar alone makes the
answer valid) and tool calls read back from a model's text, piece by piece as a stream gives it."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from dstool.decoding.grammar import GrammarError, Grammars, closed, grammar_of
from dstool.decoding.sampling import Sampler, SamplingError, SamplingParams, request_choices
from dstool.serve.gateway.openai.protocol import ChatCompletionRequest, parse
from dstool.serve.gateway.openai.routes import Choice, Reply
from dstool.serve.gateway.openai.tools import Calls, Tool, ToolError, grammar, read_tools

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


def _unique(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key repeats: {keys}"
    return dict(pairs)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "boolean"}}, "minProperties": 2},
    {"type": "object", "patternProperties": {"^x[0-2]$": {"type": "boolean"}}, "minProperties": 3},
    {"type": "array", "maxItems": 3, "items": {"type": "object", "minProperties": 3,
                                               "patternProperties": {"^(a|ab|b)$": {"type": "null"}}}},
    {"type": "object", "properties": {"id": {"enum": [1, 2]}}, "required": ["id"], "maxProperties": 4,
     "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
])
def test_keys_never_repeat_where_a_pattern_or_additional_properties_lets_them_in(grammars, schema):
    """llguidance lets a key matched by a pattern come twice (`{"x3":true,"x3":true}`: one key to a JSON reader,
    under minProperties 2); the sampler rules out a token that repeats one, or leads into a key that could only end
    as one held (`"x` once x0-x9 are all there)."""
    ended = 0
    for seed in range(16):
        text, done = _generate(grammars, {"json": schema}, seed, limit=200)
        if done:
            jsonschema.validate(json.loads(text, object_pairs_hook=_unique), schema)
            ended += 1
    assert ended >= 8


def test_a_schema_whose_keys_run_out_is_an_error_not_a_repeated_key(grammars):
    schema = {"type": "object", "patternProperties": {"^x$": {"type": "boolean"}}, "minProperties": 2}
    with pytest.raises(GrammarError, match="every key the schema allows here is in the object already: bound"):
        _generate(grammars, {"json": schema}, 0)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
AGED = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["age"]}


def test_an_allof_of_object_schemas_is_closed_as_a_whole(grammars):
    """Closed one by one, `allOf: [{name}, {age}]` could hold no object with both (each member's
    additionalProperties false refuses the other's key): the members stay open and the whole allows their keys."""
    assert closed({"allOf": [PERSON, AGED]}) == {"allOf": [PERSON, AGED], "properties": {"name": True, "age": True},
                                                 "additionalProperties": False}
    schema = {"$defs": {"Person": PERSON, "Employee": {"allOf": [{"$ref": "#/$defs/Person"}, AGED]}},
              "type": "object", "properties": {"boss": {"$ref": "#/$defs/Employee"},
                                               "client": {"$ref": "#/$defs/Person"}},
              "required": ["boss", "client"]}
    for seed in range(6):
        text, done = _generate(grammars, {"json": schema}, seed)
        assert done, text
        answer = json.loads(text)
        jsonschema.validate(answer, closed(schema))  # no other keys, either
        assert set(answer["boss"]) == {"name", "age"} and set(answer["client"]) == {"name"}
    # members that say which other keys they allow keep their word; so does the whole
    assert closed({"allOf": [PERSON, {**AGED, "additionalProperties": True}]})["allOf"][0] == PERSON
    assert "properties" not in closed({"allOf": [PERSON], "additionalProperties": True})


def test_a_tool_of_no_parameters_is_called_with_an_empty_object(grammars):
    """`"parameters": {}` is any JSON to JSON Schema (a named call of it came back `false`), OpenAI's function of no
    arguments: an empty object, as when parameters are left out. A schema of something else is refused."""
    for given in ({"name": "ping", "parameters": {}}, {"name": "ping"}):
        tools = read_tools([{"type": "function", "function": given}])
        assert tools[0].parameters == {"type": "object", "properties": {}}
        for choice in ("ping", "required"):
            for seed in range(4):
                text, done = _generate(grammars, grammar(tools, choice, False), seed)
                assert done and text == ("{}" if choice == "ping" else '[{"name":"ping","arguments":{}}]'), text
    untyped = read_tools([{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}])
    assert untyped[0].parameters["type"] == "object"
    for bad in ({"type": "string"}, {"type": ["object", "null"]}, [], False):
        with pytest.raises(ToolError, match=r"tools\[0\].function.parameters' must be a JSON schema of an object"):
            read_tools([{"type": "function", "function": {"name": "f", "parameters": bad}}])


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_auto_takes_a_call_only_with_an_object_of_arguments(piece):
    """What a model writes in <tool_call> that is no call of a known tool with a JSON object of arguments stays text,
    as vLLM's Hermes parser leaves it; arguments as the JSON text of an object (OpenAI's form) are taken."""
    bad = ['{"name": "add", "arguments": "1"}', '{"name": "add", "arguments": [1]}', '{"name": "add", "arguments": '
           'false}', '{"name": "add"}', '{"name": ["add"], "arguments": {}}', '["add"]', '{"name": "add", '
           '"arguments": {"a": 1}']
    text = "".join(f"<tool_call>{b}</tool_call>" for b in bad)
    content, found = _fed(Calls(TOOLS, "auto"), text + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}'
                          '</tool_call>', piece)
    assert content == text and [(c.name, json.loads(c.arguments)) for c in found] == [("add", {"a": 2})]


def _choice(body: dict, text: str, max_tokens: int = 100) -> dict:
    """The whole answer of a chat request whose model wrote `text` (in 2-character pieces, up to a stop string)."""
    request = parse(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **body}).encode(),
                    ChatCompletionRequest)
    calls = Calls(request.tool_list, request.tool_mode) if request.tool_mode != "none" else None
    choice = Choice(0, request.stop, calls=calls)
    for at in range(0, len(text), 2):
        choice.add(text[at:at + 2])
        choice.tokens += 1
        if choice.finish_reason:
            break
    return Reply(True, "m", [choice], max_tokens, False).whole()["choices"][0]


def test_a_stop_string_that_cuts_an_answer_under_a_grammar_ends_it_as_length():
    """A stop string that comes in a grammar's answer cuts it short (`{"city":"` was sent as finish_reason stop, and
    as a complete tool call): its finish reason is `length`, as max_tokens's would be, and a call cut short comes
    back as far as it got (as OpenAI returns a call max_tokens cut), never as complete. Text without a grammar stops as
    before."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    named = _choice({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                     "stop": "Ve"}, '{"city":"Verona"}')
    assert named["finish_reason"] == "length" and [c["function"]["arguments"] for c in named["message"][
        "tool_calls"]] == ['{"city":"'], named
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": weather["function"]["parameters"]}}
    shaped = _choice({"response_format": schema, "stop": ["Ve"]}, '{"city":"Verona"}')
    assert shaped["finish_reason"] == "length" and shaped["message"]["content"] == '{"city":"'
    required = _choice({"tools": [weather], "tool_choice": "required", "stop": "Ro"},
                       '[{"name":"get_weather","arguments":{"city":"Verona"}},{"name":"get_weather","arguments":'
                       '{"city":"Rome"}}]')
    assert required["finish_reason"] == "length" and [c["function"]["arguments"] for c in required["message"][
        "tool_calls"]] == ['{"city":"Verona"}', '{"city":"']  # the call complete before the cut, and the cut one
    whole = _choice({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                     "stop": "Rome"}, '{"city":"Verona"}')
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"][0]["function"][
        "arguments"] == '{"city":"Verona"}'
    plain = _choice({"stop": "Ve"}, "Go to Verona")
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "Go to "
    cut = _choice({"response_format": schema}, '{"city":"Ver', max_tokens=6)
    assert cut["finish_reason"] == "length"


def test_json_object_is_any_object_not_only_the_empty_one(grammars):
    """`{"json_object": true}` (OpenAI's JSON mode) lets keys come: it once closed the object and allowed only {}."""
    texts = [text for text, done in (_generate(grammars, {"json_object": True}, seed) for seed in range(12)) if done]
    assert texts and all(isinstance(json.loads(t), dict) for t in texts)
    assert any(json.loads(t) for t in texts), texts
