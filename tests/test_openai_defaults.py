"""The OpenAI routes as the ecosystem's clients call them by default (issue 41): no max_tokens means the answer runs
to the model's end or the context's (at most --max-tokens-limit), `tools: []` is no tools, an answer's message fed
back as `model_dump()` is a message, nulls are fields left out, fields that cannot change this model's answer are
taken, and vLLM's and OpenAI's sampling fields (logit_bias, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens) are served — on the real Triton, through the official `openai` client where it sends them."""

from __future__ import annotations

import json

import pytest

from gatewaylib import GatewayProcess
from llmlib import post

TOKEN = "sk-dstool-defaults"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ASK = [{"role": "user", "content": "Who comes here?"}]


@pytest.fixture(scope="module")
def api(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-openai-defaults.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory", "token": TOKEN})
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def capped(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-openai-capped.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory", "token": TOKEN, "max_tokens_limit": 40})
    yield gw
    gw.stop()


def _client(gw):
    import openai

    return openai.OpenAI(base_url=f"http://{gw.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=300)


def _chat(gw, **fields) -> tuple[int, dict]:
    status, _, body = post(gw.http_port, "/v1/chat/completions",
                           {"model": "dstool_lm", "messages": ASK, "temperature": 0, **fields}, AUTH)
    return status, json.loads(body)


def test_no_max_tokens_runs_to_the_models_end_or_the_contexts(api, capped, trained):
    """The client sends no max_tokens (none of the popular libraries does): not 16 tokens, but until the model
    ends or the context (1,024 positions here) is full; --max-tokens-limit caps it and refuses more by name."""
    answer = _client(api).chat.completions.create(model="dstool_lm", messages=ASK, temperature=0)
    usage, finish = answer.usage, answer.choices[0].finish_reason
    assert usage.completion_tokens > 16, usage
    # the tiny model rarely ends by itself: either it did (stop) or the context is full (length)
    assert (finish == "length") == (usage.prompt_tokens + usage.completion_tokens == 1024), (finish, usage)
    streamed = list(_client(api).chat.completions.create(model="dstool_lm", messages=ASK, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens == usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content
    # the legacy completions default stays 16 tokens
    status, body = post(api.http_port, "/v1/completions", {"model": "dstool_lm", "prompt": "ROMEO:\n",
                                                          "temperature": 0}, AUTH)[0::2]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] <= 16

    capped_answer = _client(capped).chat.completions.create(model="dstool_lm", messages=ASK, temperature=0)
    assert capped_answer.usage.completion_tokens == 40 and capped_answer.choices[0].finish_reason == "length"
    assert capped_answer.choices[0].message.content == answer.choices[0].message.content[
        :len(capped_answer.choices[0].message.content)]
    status, error = _chat(capped, max_tokens=41)
    assert status == 400 and error["error"]["param"] == "max_tokens" and "40" in error["error"]["message"], error
    # a whole context's prompt leaves no room: OpenAI's context_length_exceeded, not a 500
    status, error = _chat(api, messages=[{"role": "user", "content": "What say you? " * 400}])
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error


def test_what_clients_send_by_default_is_taken(api):
    """openai-agents' `tools: []`, the tutorials' `message.model_dump()` fed back, nulls for unset fields, and the
    routing and bookkeeping fields (litellm's reasoning_effort, prompt_cache_key, ...) are taken; the answer is
    the same as without them."""
    client = _client(api)
    plain = client.chat.completions.create(model="dstool_lm", messages=ASK, temperature=0, max_tokens=8)
    text = plain.choices[0].message.content
    fed_back = [*ASK, plain.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    assert set(fed_back[1]) >= {"refusal", "annotations", "audio", "function_call", "tool_calls"}
    again = client.chat.completions.create(model="dstool_lm", messages=fed_back, temperature=0, max_tokens=8)
    assert again.choices[0].message.content
    for extra in ({"tools": []}, {"tools": [], "tool_choice": "auto"}, {"n": None, "stream": None, "stop": None},
                  {"reasoning_effort": "low", "verbosity": "low", "prompt_cache_key": "k1", "safety_identifier": "u1",
                   "prediction": {"type": "content", "content": "x"}, "skip_special_tokens": True, "min_tokens": 0,
                   "logit_bias": {}, "chat_template_kwargs": {}, "include_stop_str_in_output": False,
                   "store": False, "metadata": {"a": "b"}, "user": "u", "service_tier": "auto"}):
        status, answer = _chat(api, max_tokens=8, **extra)
        assert status == 200 and answer["choices"][0]["message"]["content"] == text, (extra, answer)
    responses = client.responses.create(model="dstool_lm", input="Who comes here?", tools=[], temperature=0,
                                        max_output_tokens=8, store=False)
    assert responses.output_text == text
    # text.verbosity alone (openai-agents' ModelSettings(verbosity=...)) is taken as chat's verbosity; a bad level
    # is refused in the Responses' names
    tuned = client.responses.create(model="dstool_lm", input="Who comes here?", text={"verbosity": "low"},
                                    temperature=0, max_output_tokens=8, store=False)
    assert tuned.output_text == text
    status, _, body = post(api.http_port, "/v1/responses", {"model": "dstool_lm", "input": "x", "store": False,
                                                           "text": {"verbosity": "loud"}}, AUTH)
    assert status == 400 and json.loads(body)["error"]["param"] == "text.verbosity", body
    # reasoning.effort (openai-agents' ModelSettings(reasoning=...)) is taken as chat's reasoning_effort; a summary of
    # the thinking is not served, and is refused by name
    thought = client.responses.create(model="dstool_lm", input="Who comes here?", reasoning={"effort": "low"},
                                      temperature=0, max_output_tokens=8, store=False)
    assert thought.output_text == text
    for reasoning, param in (({"effort": "extreme"}, "reasoning.effort"), ({"summary": "auto"}, "reasoning.summary"),
                             ("high", "reasoning")):
        status, _, body = post(api.http_port, "/v1/responses", {"model": "dstool_lm", "input": "x", "store": False,
                                                               "reasoning": reasoning}, AUTH)
        assert status == 400 and json.loads(body)["error"]["param"] == param, body
    for extra, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                         ({"chat_template_kwargs": {"a": [1]}}, "chat_template_kwargs"),
                         ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a1"}}]},
                          "messages[0].audio"),
                         ({"tools": [], "tool_choice": "required"}, "tool_choice"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids"),
                         ({"min_tokens": 9, "max_tokens": 8}, "min_tokens")):
        status, error = _chat(api, **{"max_tokens": 8, **extra})
        assert status == 400 and error["error"]["param"] == param, (extra, error)


def test_sampling_fields_of_vllm_and_openai_are_served(api, trained):
    """logit_bias moves the greedy choice, stop_token_ids ends at a token, min_tokens holds the stop off,
    include_stop_str_in_output keeps the stop string; a token id outside the vocabulary is the client's 400."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained)
    prompt = {"model": "dstool_lm", "prompt": "ROMEO:\nBut soft, what light", "max_tokens": 8, "temperature": 0}

    def complete(**fields) -> dict:
        status, _, body = post(api.http_port, "/v1/completions", {**prompt, **fields}, AUTH)
        assert status == 200, body
        return json.loads(body)

    greedy = complete()
    ids = tokenizer(greedy["choices"][0]["text"], add_special_tokens=False)["input_ids"]
    first = ids[0]
    banned = complete(logit_bias={str(first): -100})
    assert tokenizer(banned["choices"][0]["text"], add_special_tokens=False)["input_ids"][0] != first
    forced = complete(logit_bias={str(first): 100})
    assert set(tokenizer(forced["choices"][0]["text"], add_special_tokens=False)["input_ids"]) == {first}
    stopped = complete(stop_token_ids=[first])
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = complete(stop_token_ids=[first], min_tokens=3, logit_bias={str(first): 100})
    assert held["usage"]["completion_tokens"] == 4, held  # three others first, then the forced stop token
    word = greedy["choices"][0]["text"].split()[1]
    kept = complete(stop=[word], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"].endswith(word) and kept["choices"][0]["finish_reason"] == "stop"
    assert complete(stop=[word])["choices"][0]["text"] == kept["choices"][0]["text"][:-len(word)]
    status, _, body = post(api.http_port, "/v1/completions", {**prompt, "logit_bias": {str(len(tokenizer)): 5}},
                           AUTH)
    assert status == 400 and b"logit_bias" in body, body
    # skip_special_tokens: false keeps a special token in the text (true, the default, leaves it out)
    eos = tokenizer.eos_token_id
    special = {"ignore_eos": True, "logit_bias": {str(eos): 100}, "max_tokens": 3}
    assert complete(**special, skip_special_tokens=False)["choices"][0]["text"] == tokenizer.eos_token * 3
    assert complete(**special)["choices"][0]["text"] == ""


def test_a_named_tool_call_and_a_text_format_go_together(api):
    """instructor's RESPONSES_TOOLS mode (and OpenAI) send a named tool_choice with text.format: the answer is the
    call, under the tool's schema."""
    tool = {"type": "function", "name": "answer", "parameters": {"type": "object", "properties": {
        "who": {"type": "string", "maxLength": 8}}, "required": ["who"], "additionalProperties": False}}
    status, _, body = post(api.http_port, "/v1/responses", {
        "model": "dstool_lm", "input": "Who comes here?", "tools": [tool], "max_output_tokens": 40,
        "tool_choice": {"type": "function", "name": "answer"}, "store": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, AUTH)
    answer = json.loads(body)
    assert status == 200, answer
    call = next(item for item in answer["output"] if item["type"] == "function_call")
    assert call["name"] == "answer" and set(json.loads(call["arguments"])) == {"who"}


def test_tool_schemas_with_defs_work_under_every_tool_choice(api):
    """pydantic's nested models ($defs/$ref), as openai's pydantic_function_tool writes them: under `required` each
    tool's definitions resolve in its own schema, so two tools may both define `A` differently."""
    import openai
    import pydantic

    class Inner(pydantic.BaseModel):
        n: int = pydantic.Field(ge=0, le=99)  # the tiny model would write digits to the limit

    class Outer(pydantic.BaseModel):
        inner: Inner

    first = openai.pydantic_function_tool(Outer, name="outer")
    assert "$defs" in first["function"]["parameters"]
    second = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"v": {"$ref": "#/$defs/Inner"}}, "required": ["v"],
        "$defs": {"Inner": {"type": "string", "maxLength": 6}}}}}
    client = _client(api)
    for choice in ("required", {"type": "function", "function": {"name": "outer"}}):
        answer = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=[first, second],
                                                tool_choice=choice, max_tokens=120, temperature=0,
                                                parallel_tool_calls=False)
        call = answer.choices[0].message.tool_calls[0].function
        assert answer.choices[0].finish_reason in ("tool_calls", "stop"), answer
        arguments = json.loads(call.arguments)
        if call.name == "outer":
            Outer.model_validate(arguments)
        else:
            assert isinstance(arguments["v"], str) and len(arguments["v"]) <= 6


def test_a_call_cut_by_max_tokens_comes_back_partial(api):
    """As OpenAI: a forced call that max_tokens cuts is in tool_calls as far as it got, finish_reason length —
    whole and streamed."""
    tool = {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"words": {"type": "string"}}, "required": ["words"]}}}
    client = _client(api)
    for choice in ("required", {"type": "function", "function": {"name": "say"}}):
        answer = client.chat.completions.create(model="dstool_lm", messages=ASK, tools=[tool], tool_choice=choice,
                                                max_tokens=12, temperature=0)
        assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.tool_calls, answer
        call = answer.choices[0].message.tool_calls[0]
        arguments = call.function.arguments  # as far as it got: nothing yet, or the object begun
        assert call.function.name == "say" and (arguments.startswith('{"words":') or '{"words":'.startswith(
            arguments)), call
        streamed = list(client.chat.completions.create(model="dstool_lm", messages=ASK, tools=[tool],
                                                       tool_choice=choice, max_tokens=12, temperature=0,
                                                       stream=True))
        deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].function.name == "say", streamed
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert streamed[-1].choices[0].finish_reason == "length"


def test_a_call_cut_by_max_output_tokens_comes_back_partial_on_responses(api):
    """The Responses form of the same: an incomplete response whose last item, the call as far as it got, is
    marked incomplete (not an empty message item marked completed) — whole and streamed."""
    tool = {"type": "function", "name": "say", "parameters": {
        "type": "object", "properties": {"words": {"type": "string"}}, "required": ["words"]}}
    client = _client(api)
    ask = {"model": "dstool_lm", "input": "Who comes here?", "tools": [tool], "tool_choice": "required",
           "max_output_tokens": 12, "temperature": 0, "store": False}
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens", whole
    assert [item.type for item in whole.output] == ["function_call"], whole.output
    call = whole.output[0]
    assert call.name == "say" and call.status == "incomplete", call
    assert call.arguments.startswith('{"words":') or '{"words":'.startswith(call.arguments), call
    events = list(client.responses.create(**ask, stream=True))
    final = events[-1]
    assert final.type == "response.incomplete" and [i.type for i in final.response.output] == ["function_call"]
    assert (final.response.output[0].arguments, final.response.output[0].status) == (call.arguments, "incomplete")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("function_call", "incomplete")], done
    # a cut text answer: its message item is incomplete too
    text = client.responses.create(model="dstool_lm", input="Who comes here?", max_output_tokens=3, temperature=0,
                                   store=False)
    assert text.status == "incomplete" and [(i.type, i.status) for i in text.output] == [("message", "incomplete")]


def test_a_connection_triton_closes_under_an_abandoned_request_leaves_no_loop_warning():
    """A long client session printed "Future exception was never retrieved ... Triton closed the connection": the
    answer's head failed after its waiter had gone. The failure is now marked seen where it is set."""
    import asyncio
    import gc

    from dstool.serve.gateway.upstream import _Connection

    seen: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))

        class Transport:
            def write(self, data):
                pass

            def close(self):
                pass

        conn = _Connection()
        conn.connection_made(Transport())
        conn.send(b"GET / HTTP/1.1\r\n\r\n", b"")  # nobody awaits its head: the client went
        conn.connection_lost(None)
        conn.head = None
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert not [c for c in seen if "never retrieved" in c.get("message", "")], seen
