"""Structured outputs and tool calls on the OpenAI route, served by dstool_lm_llm on a real Triton (llguidance in its
sampler) behind the gateway, checked with clients nobody here wrote: the official `openai` client
(`chat.completions.parse`, streamed tool calls) and LangChain's `langchain-openai`. The model has near-random
weights, so everything it writes under a grammar must still parse and validate: the grammar alone makes it so."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field, constr

from gatewaylib import GatewayProcess
from llmlib import llm_requests, post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999},
                                                                   "b": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}},
                                  "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    titles: list[constr(max_length=8)] = Field(max_length=2)  # type: ignore[valid-type]


@pytest.fixture(scope="module")
def api(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-structured.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory"})
    yield gw
    gw.stop()


def _client(api):
    import openai

    return openai.OpenAI(base_url=f"http://{api.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def _schema(tool: dict) -> dict:
    return tool["function"]["parameters"]


def test_parse_with_a_pydantic_model_always_validates(api):
    client = _client(api)
    schema = Person.model_json_schema()
    for seed in range(4):
        r = client.chat.completions.parse(model="dstool_lm", messages=ASK, response_format=Person, max_tokens=200,
                                          temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="dstool_lm", messages=ASK, max_tokens=200, temperature=1.0, seed=9, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}}))
    jsonschema.validate(json.loads(streamed), schema)


def test_json_object_choice_regex_and_grammar(api):
    client = _client(api)
    r = client.chat.completions.create(model="dstool_lm", messages=ASK, max_tokens=300, temperature=0.7, seed=1, n=3,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":  # an object's keys are free text: one may run past max_tokens
            assert isinstance(json.loads(c.message.content), dict), c.message.content
    assert any(c.finish_reason == "stop" for c in r.choices)
    # vLLM's extra fields, on completions too
    choice = client.completions.create(model="dstool_lm", prompt="ROMEO:", max_tokens=20, temperature=1.0, seed=2,
                                       n=4, extra_body={"guided_choice": ["yes", "no", "perhaps not"]})
    assert {c.text for c in choice.choices} <= {"yes", "no", "perhaps not"}
    regex = client.completions.create(model="dstool_lm", prompt="ROMEO:", max_tokens=20, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", regex.choices[0].text), regex.choices[0].text
    lark = client.completions.create(model="dstool_lm", prompt="ROMEO:", max_tokens=30, temperature=1.0, seed=4,
                                     extra_body={"structured_outputs": {"grammar": 'start: "ay" ("," "ay")*'}})
    assert re.fullmatch(r"ay(,ay)*", lark.choices[0].text) or lark.choices[0].finish_reason == "length"


def test_named_and_required_tool_calls_follow_their_schemas_whole_and_streamed(api):
    client = _client(api)
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        r = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=60, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _schema(ADD))
        r = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        tool = {"add": ADD, "get_weather": WEATHER}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), _schema(tool))

    for choice in (named, "required"):
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                    parallel_tool_calls=False, max_tokens=80, temperature=1.0,
                                                    seed=5, stream=True):
            for d in chunk.choices:
                finish = d.finish_reason or finish
                for delta in d.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
        whole = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=5)
        assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_")
        assert [(calls[0]["name"], calls[0]["arguments"])] == [
            (t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]


def test_a_stop_string_in_a_grammars_answer_leaves_it_unfinished_and_a_tool_of_no_parameters_takes_none(api):
    """A stop string that comes in an answer under a grammar cuts it short: finish_reason `length` (it was `stop`
    with `{"name`, and `tool_calls` with a call of arguments `{"city`), so `parse` raises what it raises for a cut
    answer, and a call cut short comes back as far as it got (never complete). A tool of `"parameters": {}` is
    called with `{}`."""
    import openai

    client = _client(api)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="dstool_lm", messages=ASK, response_format=Person, max_tokens=200,
                                      temperature=1.0, seed=1, stop=['":"'])
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice=named,
                                       max_tokens=60, temperature=1.0, seed=1, stop=['":"'])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls, r
    with pytest.raises(json.JSONDecodeError):  # cut short: not a whole JSON object
        json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    finishes = [c.choices[0].finish_reason for c in client.chat.completions.create(
        model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=1.0,
        seed=1, stop=['":"'], stream=True) if c.choices]
    assert finishes[-1] == "length" and "tool_calls" not in finishes
    ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    for seed in range(3):
        r = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=[ping], max_tokens=20,
                                           tool_choice={"type": "function", "function": {"name": "ping"}},
                                           temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.arguments \
            == "{}", r


def test_a_conversation_with_tool_results_and_auto(api, server):
    client = _client(api)
    first = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    answer = client.chat.completions.create(model="dstool_lm", messages=conversation, tools=TOOLS, max_tokens=12,
                                            temperature=0)
    c = answer.choices[0]
    assert c.finish_reason in ("stop", "length") and (c.message.content or c.message.tool_calls)
    # the tool's answer is part of the prompt the model read
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 5
    before = llm_requests(server)  # a cached tool call replays as a tool call, whole and streamed
    again = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    streamed = list(client.chat.completions.create(model="dstool_lm", messages=ASK, tools=TOOLS, stream=True,
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                                   temperature=0))
    assert llm_requests(server) == before
    assert again.choices[0].message.tool_calls[0].function == call.function
    assert again.choices[0].finish_reason == "tool_calls" == streamed[-1].choices[0].finish_reason
    deltas = [d for c in streamed for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name,
                                                                          call.function.arguments)]


@pytest.mark.parametrize(("field", "value", "says"), [
    ("guided_regex", 5, "Input should be a valid string, got 5"),
    ("guided_grammar", ["x"], "Input should be a valid string, got ['x']"),
    ("guided_choice", "yes", "Input should be a valid list"),
    ("guided_json", 4, "Input should be a valid dictionary, got 4"),
    ("response_format", "json", "Input should be a valid dictionary, got 'json'"),
    ("structured_outputs", ["x"], "Input should be a valid dictionary"),
    ("stop", 3, "'stop' must be a string or a list of up to 4 strings"),
    ("tools", "x", "Input should be a valid list, got 'x'"),
    ("tool_choice", 5, "Input should be 'none', 'auto' or 'required', got 5"),
])
def test_a_typed_chat_field_of_the_wrong_type_is_a_400_naming_it(field, value, says):
    """The typed structured-output and tool fields (and stop) of a chat request, refused in OpenAI's shape before
    anything is compiled or sent."""
    from dstool.serve.gateway.openai.protocol import ChatCompletionRequest, OpenAIError, parse

    with pytest.raises(OpenAIError) as e:
        parse(json.dumps({"model": "m", "messages": ASK, field: value}).encode(), ChatCompletionRequest)
    assert e.value.status == 400 and e.value.param == field and says in e.value.message, e.value.message


def test_refused_structured_requests_name_the_field(api):
    chat = {"model": "dstool_lm", "messages": ASK, "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(", "messages": ASK}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]},
         "tools[0].function.parameters"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"guided_json": {"type": "object", "uniqueItems": True, "not": {}}}, "guided_json"),
    ]
    for extra, param in cases:
        status, _, body = post(api.http_port, "/v1/chat/completions", {**chat, **extra})
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (extra, body)
    # a request longer than the model's positions, as OpenAI words it, in each route's own names
    for path, body, param in (("/v1/chat/completions", {**chat, "max_tokens": 100000}, "messages"),
                              ("/v1/completions", {"model": "dstool_lm", "prompt": "x", "max_tokens": 100000},
                               "prompt"),
                              ("/v1/responses", {"model": "dstool_lm", "input": "x", "max_output_tokens": 100000},
                               "input")):
        status, _, answer = post(api.http_port, path, body)
        error = json.loads(answer)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, answer
        assert "maximum context length is 1024 tokens" in error["message"] and "100000 in the completion" in \
            error["message"]
    # the engine's own check, on Triton's generate extension
    status, _, body = post(api.http_port, "/v2/models/dstool_lm_llm/generate",
                           {"text_input": "x", "ignore_eos": True, "structured_outputs": '{"json_object": true}'})
    assert status == 400 and b"ignore_eos" in body
    status, _, body = post(api.http_port, "/v2/models/dstool_lm_generate/generate",
                           {"text_input": "x", "structured_outputs": '{"json_object": true}'})
    assert status == 400 and b"structured_outputs" in body


def test_langchain_bind_tools_and_with_structured_output(api):
    from langchain_openai import ChatOpenAI

    class Add(BaseModel):
        """Add two numbers."""

        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    llm = ChatOpenAI(model="dstool_lm", base_url=f"http://{api.http_url}/v1", api_key="none", temperature=1.0,
                     seed=3, max_tokens=80, max_retries=0)
    message = llm.bind_tools([Add], tool_choice="Add").invoke("What is 2 + 3?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "Add"
    Add.model_validate(message.tool_calls[0]["args"])
    person = llm.with_structured_output(Person, method="json_schema").invoke("Who goes there?")
    assert isinstance(person, Person)


def test_the_responses_api_with_the_official_client(api):
    client = _client(api)
    plain = client.responses.create(model="dstool_lm", input="Who goes there?", instructions="Answer as a guard.",
                                    max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="dstool_lm", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer as a guard."}, {"role": "user", "content": "Who goes there?"}])
    assert plain.output_text == chat.choices[0].message.content and plain.object == "response"
    assert plain.usage.input_tokens == chat.usage.prompt_tokens and plain.usage.output_tokens <= 12
    assert plain.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    flat = [{"type": "function", **ADD["function"]}]
    called = client.responses.create(model="dstool_lm", input="2 + 3?", tools=flat, max_output_tokens=60,
                                     tool_choice={"type": "function", "name": "add"}, temperature=1.0)
    call = called.output[0]
    assert called.status == "completed" and call.type == "function_call" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), _schema(ADD))
    answered = client.responses.create(model="dstool_lm", tools=flat, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "2 + 3?"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert answered.usage.input_tokens > called.usage.input_tokens

    schema = Person.model_json_schema()
    shaped = client.responses.create(model="dstool_lm", input="Who?", max_output_tokens=200, temperature=1.0, text={
        "format": {"type": "json_schema", "name": "Person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), schema)

    with client.responses.stream(model="dstool_lm", input="2 + 3?", tools=flat, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80, temperature=1.0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    jsonschema.validate(json.loads(final.output[0].arguments), _schema(ADD))

    import openai

    with pytest.raises(openai.NotFoundError) as unknown:  # stored responses: tests/test_responses_store.py
        client.responses.create(model="dstool_lm", input="Hi", previous_response_id="resp_1")
    assert unknown.value.param == "previous_response_id"
    for extra, param in (({"store": "yes"}, "store"), ({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0]"),
                         ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "integr"}}}},
                          "text.format.schema")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="dstool_lm", input="Hi", **extra)
        assert refused.value.param == param, (extra, refused.value.body)


def test_dstool_infer_json_schema_on_triton_and_the_openai_route(api, server, tmp_path):
    from conftest import cli, dstool, one_line_usage_error

    schema = Person.model_json_schema()
    (tmp_path / "person.json").write_text(json.dumps(schema))
    for url, extra in ((server.http_url, ()), (server.grpc_url, ("--protocol", "grpc")), (api.http_url, ("--openai",))):
        out = dstool("infer", "Who goes there?", "--url", url, "--json-schema", str(tmp_path / "person.json"),
                     "--max-new-tokens", "200", "--temperature", "1", "--seed", "6", *extra)
        jsonschema.validate(json.loads(out.stdout), schema)
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"type": "strin"}}}')
    one_line_usage_error(cli("infer", "x", "--json-schema", str(tmp_path / "bad.json")), "strin")
