"""Anthropic's Messages API on the gateway (POST /v1/messages), served by dstool_lm_llm on a real Triton, checked with
the official `anthropic` client (whole, `messages.stream(...)`, a tool loop as Claude Code runs one) and raw HTTP:
the answers are the chat route's own (same text, same usage), tenants' keys come as `x-api-key` and are admitted,
metered and cache-scoped as on the OpenAI routes, and every refusal is Anthropic's error object."""

from __future__ import annotations

import http.client
import json
import secrets

import jsonschema
import pytest
from test_tenants import keys_gateway, new_key, usage_of

from gatewaylib import GatewayProcess, RedisServer, eventually
from llmlib import llm_requests, post

TOKEN = "sk-dstool-anthropic"
ADMIN = "admin-t0ken"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"]}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]
# The 2.x client no longer has temperature, top_p or top_k among its arguments (Anthropic's newest models take none);
# older clients and Claude Code send them, and this server serves them: sent as the body's fields
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def api(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-anthropic.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory", "token": TOKEN})
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def keyed(server, session_tmp):
    redis = RedisServer(session_tmp / "redis-anthropic")
    gw = keys_gateway(server, redis.url, session_tmp / "gateway-anthropic-keys.log", redis_timeout=2.0, token=ADMIN)
    yield gw, redis
    gw.stop()
    redis.stop()


def _client(gw, key: str = TOKEN):
    import anthropic

    return anthropic.Anthropic(base_url=f"http://{gw.http_url}", api_key=key, max_retries=0, timeout=120)


def _openai(gw, key: str = TOKEN):
    import openai

    return openai.OpenAI(base_url=f"http://{gw.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_message_is_the_chat_routes_answer(api):
    """The same conversation through /v1/messages and /v1/chat/completions: the same text, the same tokens; the
    Message's shape as Anthropic writes it."""
    system = "You are Juliet."
    question = "Where art thou, Romeo?"
    chat = _openai(api).chat.completions.create(
        model="dstool_lm", max_tokens=10, temperature=0, extra_headers={"Cache-Control": "no-cache"},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    message = _client(api).messages.create(model="dstool_lm", max_tokens=10, extra_body=GREEDY, system=system,
                                           messages=[{"role": "user", "content": question}])
    assert message.type == "message" and message.role == "assistant" and message.model == "dstool_lm"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    u = message.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_sequence is None
    assert [m.id for m in _client(api).models.list().data] == ["dstool_lm"]  # Anthropic's list shape
    assert _client(api).models.retrieve("dstool_lm").id == "dstool_lm"


def test_fields_that_change_nothing_are_taken(api):
    """cache_control on every block and at the top, metadata, service_tier, speed, inference_geo, effort, thinking
    disabled, nulls, system as blocks: the same answer as without them."""
    plain = _client(api).messages.create(model="dstool_lm", max_tokens=8, extra_body=GREEDY, system="Be brief.",
                                         messages=[{"role": "user", "content": "Speak of the king."}])
    ephemeral = {"type": "ephemeral", "ttl": "1h"}
    dressed = _client(api).messages.create(
        model="dstool_lm", max_tokens=8, metadata={"user_id": "u-1"}, service_tier="auto", speed="standard",
        inference_geo="us", cache_control={"type": "ephemeral"}, output_config={"effort": "low"},
        thinking={"type": "disabled"}, system=[{"type": "text", "text": "Be brief.", "cache_control": ephemeral}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Speak of the king.",
                                                "cache_control": ephemeral}]}],
        extra_body={**GREEDY, "top_k": None, "stop_sequences": None},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert dressed.content == plain.content and dressed.usage.output_tokens == plain.usage.output_tokens


def test_output_config_format_is_a_json_schema_answer(api):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "act": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["name", "act"], "additionalProperties": False}
    for seed in range(2):
        m = _client(api).messages.create(model="dstool_lm", max_tokens=60, messages=ASK,
                                         output_config={"format": {"type": "json_schema", "schema": schema}},
                                         extra_body={"temperature": 1.0, "top_k": 40 + seed})
        assert m.stop_reason == "end_turn", m
        jsonschema.validate(json.loads(m.content[0].text), schema)


def test_streamed_with_the_sdks_helper(api):
    """messages.stream(...): text as it comes (token by token), get_final_message() the whole answer's; the raw
    events in Anthropic's order, each `event:` line naming its data's type."""
    ask = {"model": "dstool_lm", "max_tokens": 12, "messages": [{"role": "user", "content": "Tell me of Verona."}]}
    whole = _client(api).messages.create(**ask, extra_body=GREEDY, extra_headers={"Cache-Control": "no-cache"})
    with _client(api).messages.stream(**ask, extra_body=GREEDY, extra_headers={"Cache-Control": "no-cache"}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text and len(pieces) > 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    status, headers, body = post(api.http_port, "/v1/messages", {**ask, **GREEDY, "stream": True},
                                 {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = []
    for part in body.decode().split("\n\n"):
        if part:
            kind, data = part.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            assert json.loads(data[6:])["type"] == kind[7:]
            events.append(kind[7:])
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(api):
    """The stop sequence that stopped the answer is its stop_sequence, left out of the text (whole and streamed)."""
    ask = {"model": "dstool_lm", "max_tokens": 24, "extra_body": GREEDY,
           "messages": [{"role": "user", "content": "Now is the winter of our discontent."}]}
    text = _client(api).messages.create(**ask).content[0].text
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text.find(text[i:i + 3]) > 0 and
                text[i:i + 3].strip())  # from the middle of the text, first found past its start
    cut = _client(api).messages.create(**ask, stop_sequences=["never in this text", stop])
    assert [b.type for b in cut.content] == ["text"] and cut.content[0].text == text[:text.find(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    with _client(api).messages.stream(**ask, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [cut.content[0].text]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_loop_as_claude_code_runs_it(api):
    """tool_choice any: a tool_use whose input follows its schema (stop_reason tool_use); its tool_result sent back
    (the assistant's content as the client got it); the answer reads it (its prompt is longer). Streamed, the same
    call comes as input_json_delta and get_final_message() has it; disable_parallel_tool_use makes one call."""
    client = _client(api)
    tools = [WEATHER, ADD]
    first = client.messages.create(model="dstool_lm", max_tokens=80, extra_body=GREEDY, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=ASK)
    assert first.stop_reason == "tool_use", first
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, {"get_weather": WEATHER, "add": ADD}[calls[0].name]["input_schema"])
    conversation = [*ASK, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": [{"type": "text", "text": "Sunny, 21 degrees."}]}]}]
    answer = client.messages.create(model="dstool_lm", max_tokens=12, extra_body=GREEDY, tools=tools,
                                    messages=conversation)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + 5
    failed = client.messages.create(model="dstool_lm", max_tokens=12, extra_body=GREEDY, tools=tools, messages=[
        *conversation[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                         "content": "Sunny, 21 degrees.", "is_error": True}]}])
    assert failed.usage.input_tokens + failed.usage.cache_read_input_tokens > \
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens  # "Error: " is in the prompt

    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "add"}):
        ask = {"model": "dstool_lm", "max_tokens": 80, "extra_body": GREEDY, "tools": tools, "tool_choice": choice,
               "messages": ASK}
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == whole.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]
        if choice["type"] == "tool":
            assert [b.name for b in whole.content] == ["add"]
            jsonschema.validate(whole.content[0].input, ADD["input_schema"])


def test_a_wrong_key_is_refused_in_anthropics_shape(api):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as wrong:
        _client(api, key="wrong").messages.create(model="dstool_lm", max_tokens=2, messages=ASK)
    assert wrong.value.status_code == 401
    assert wrong.value.body["type"] == "error" and wrong.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        _client(api).messages.create(model="no_such_model", max_tokens=2, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    # the bearer form works too (the client's auth_token)
    import anthropic as sdk

    bearer = sdk.Anthropic(base_url=f"http://{api.http_url}", auth_token=TOKEN, max_retries=0, timeout=120)
    assert bearer.messages.create(model="dstool_lm", max_tokens=2, messages=ASK).usage.output_tokens


def test_tenant_keys_as_x_api_key(keyed, server):
    """--auth keys: a tenant's key as x-api-key is admitted, its usage counted token for token as the answers report
    it, its answers cached in its tenant's scope (another tenant's identical request is computed again); a wrong
    key is 401 and a key not given the model 404, in Anthropic's shape."""
    import anthropic

    gw, redis = keyed
    a, b = new_key(redis.url, "--tenant", "claude-a", "--tpm", "100000"), new_key(redis.url, "--tenant", "claude-b")
    ask = {"model": "dstool_lm", "max_tokens": 6, "extra_body": GREEDY,
           "messages": [{"role": "user", "content": f"tenant {secrets.token_hex(3)}"}]}
    before = llm_requests(server)
    raw = _client(gw, a).messages.with_raw_response.create(**ask)
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    first = raw.parse()
    again = _client(gw, a).messages.create(**ask)  # a hit
    with _client(gw, a).messages.stream(**{**ask, "extra_body": {"temperature": 0.9}}) as stream:
        streamed = stream.get_final_message()
    other = _client(gw, b).messages.create(**ask)
    assert first.content == again.content == other.content
    assert llm_requests(server) == before + 3  # a once, its stream, b once: b computed for itself
    received = [first, again, streamed]
    used = eventually(lambda: usage_of(redis.url, a),  # charges are sent every 50 ms, in the background
                      lambda u: u.get("requests") == 3 and u.get("completion_tokens") == sum(m.usage.output_tokens
                                                                                             for m in received))
    assert used["prompt_tokens"] == sum(m.usage.input_tokens + m.usage.cache_read_input_tokens for m in received)
    assert used["completion_tokens"] == sum(m.usage.output_tokens for m in received)
    assert used["requests"] == 3 and used["cache_hits"] == 1

    with pytest.raises(anthropic.AuthenticationError) as wrong:
        _client(gw, "dsk-000000000000-" + "x" * 43).messages.create(**ask)
    assert wrong.value.body["error"]["type"] == "authentication_error"
    status, _, body = post(gw.http_port, "/v1/messages", {"model": "dstool_lm", "max_tokens": 2, "messages": ASK},
                           {"x-api-key": "not a key"})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    narrow = new_key(redis.url, "--tenant", "claude-c", "--models", "other_lm")
    with pytest.raises(anthropic.NotFoundError) as not_given:
        _client(gw, narrow).messages.create(**ask)
    assert not_given.value.body["error"]["type"] == "not_found_error"
    assert _client(gw, narrow).models.list().data == []


LONG = "x" * 300
HOSTILE = [
    (b"{not json", 400, "not JSON"),
    (b"[1]", 400, "JSON object"),
    ({"model": "dstool_lm", "messages": ASK}, 400, "max_tokens: Field required"),
    ({"model": "dstool_lm", "max_tokens": "5", "messages": ASK}, 400, "max_tokens: Input should be a valid integer"),
    ({"model": "dstool_lm", "max_tokens": True, "messages": ASK}, 400, "max_tokens"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": []}, 400, "messages: Input should be a non-empty list"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": "hi"}, 400, "messages: Input should be"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [5]}, 400, "messages.0: Input should be an object"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "messages.0.role"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content: Input should be"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": ""}]}, 400, "non-empty"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x", "name": "n"}]}, 400,
     "messages.0.name: Extra inputs are not permitted"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400,
     "messages.0.content.0: image blocks are not supported"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, 400,
     "messages.0.content.0: Input should be a block of type"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [[1, 2]]}]}, 400,
     "messages.0.content.0"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "extra": 1}]}]}, 400, "messages.0.content.0.extra: Extra inputs"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 7}]}]}, 400, "messages.0.content.0.text: Input should be a valid string"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, 400, "unexpected `tool_use_id`"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]}, {"role": "user", "content": "go"}]},
     400, "without `tool_result` blocks"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": "1"}]}]}, 400,
     "messages.1.content.0.input: Input should be an object"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     400, "messages.2.content.0.content.0: document blocks are not supported"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": "yes"}]}]}, 400, "is_error"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "Well,"}]}, 400,
     "prefill"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled",
                                                                             "budget_tokens": 1024}}, 400,
     "thinking: "),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "temperature": 1.5}, 400, "temperature: range: 0..1"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "top_k": -1}, 400, "top_k"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "stream": "yes"}, 400, "stream"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [
        {"name": "f", "input_schema": {"type": "string"}}]}, 400, "tools.0.input_schema"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [{"name": "a b", "input_schema": {}}]},
     400, "tools.0.name"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [{"name": "f"}]}, 400,
     "tools.0.input_schema: Field required"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "fly"}}, 400, "tool_choice.name"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "tool_choice: any needs 'tools'"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tool_choice": "auto"}, 400, "tool_choice"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, 400,
     "'stop_sequences'"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "stop_sequences": [LONG]}, 400, "'stop_sequences'"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "metadata": {"user_id": "u", "x": 1}}, 400,
     "metadata.x"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "mcp_servers": [{"type": "url"}]}, 400,
     "mcp_servers"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "xml"}}}, 400,
     "output_config.format"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "integr"}}}}, 400, "'output_config.format.schema'"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "cache_control": {"type": "forever"}}, 400,
     "cache_control.type: Input should be 'ephemeral'"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "tools": [
        {"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}]}, 400, "tools.0.defer_loading"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "frobnicate": 1}, 400,
     "frobnicate: Extra inputs are not permitted"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": ASK, "system": [{"type": "image"}]}, 400, "system.0"),
    ({"model": "a b", "max_tokens": 4, "messages": ASK}, 400, "'model'"),
    ({"model": "dstool_lm", "max_tokens": 2**40, "messages": ASK}, 400, "max_tokens"),
    (b'{"model": "dstool_lm", "max_tokens": 4, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "not JSON"),
    ({"model": "dstool_lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}, 413,
     "exceeds the gateway's limit"),
]


@pytest.mark.parametrize("body, status, needle", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_requests_get_one_line_anthropic_errors(api, body, status, needle):
    code, headers, raw = post(api.http_port, "/v1/messages", body,
                              {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"})
    answer = json.loads(raw)
    assert code == status and answer["type"] == "error", answer
    error = answer["error"]
    assert error["type"] == ("request_too_large" if status == 413 else "invalid_request_error")
    assert needle in error["message"] and "\n" not in error["message"] and len(error["message"]) < 600, error


def test_routes_and_methods(api):
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/count_tokens", 404),
                                 ("POST", "/v1/messages/batches", 404)):
        conn.request(method, path, b"{}" if method == "POST" else None, {"x-api-key": TOKEN})
        r = conn.getresponse()
        answer = json.loads(r.read())
        assert r.status == status and answer["type"] == "error", (path, answer)
    conn.close()


def test_a_tool_loop_becomes_the_chat_request_it_asks_for():
    """In-process: Anthropic's turns as the chat's messages (text before a tool result stays before it, an error
    result says so, earlier thinking is dropped), the tool's schema as a function's parameters, disable_parallel
    tool use as parallel_tool_calls false; the fields that change nothing are taken and leave no trace."""
    from dstool.serve.gateway.anthropic.protocol import MessagesRequest

    body = {"model": "dstool_lm", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "tools": [
        {**WEATHER, "cache_control": {"type": "ephemeral"}}], "tool_choice": {"type": "auto",
                                                                             "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"}, "service_tier": "auto", "top_k": 0,
        "messages": [*ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Verona"}}]},
            {"role": "user", "content": [{"type": "text", "text": "Here:"}, {"type": "tool_result",
                                                                             "tool_use_id": "toolu_1",
                                                                             "content": "no data", "is_error": True}]}]}
    assert MessagesRequest.parse(body).chat() == {
        "model": "dstool_lm", "max_tokens": 5, "stream": False, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city":"Verona"}'}}]},
            {"role": "user", "content": [{"type": "text", "text": "Here:"}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no data"}],
        "tools": [{"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"],
                                                    "description": WEATHER["description"]}}],
        "tool_choice": "auto", "parallel_tool_calls": False}


@pytest.mark.parametrize("extra, refused", [
    ({"tools": [{**ADD, "allowed_callers": ["direct"]}]}, None),
    ({"tools": [{**ADD, "allowed_callers": []}]}, "tools.0.allowed_callers"),
    ({"tools": [{**ADD, "defer_loading": False}]}, None),
    ({"tools": [{**ADD, "defer_loading": 0}]}, "tools.0.defer_loading"),
    ({"tools": [{**ADD, "toolset_name": []}]}, "tools.0.toolset_name"),
    ({"mcp_servers": []}, None),
    ({"mcp_servers": {}}, "mcp_servers"),
    ({"container": {}}, "container"),
])
def test_a_field_served_at_one_value_refuses_every_other(extra, refused):
    """In-process: a field this server serves at its default value only (or left out) takes that value, and refuses
    any other, an empty one of another type included, naming it."""
    from dstool.serve.gateway.anthropic.protocol import AnthropicError, MessagesRequest

    body = {"model": "dstool_lm", "max_tokens": 5, "messages": ASK, **extra}
    if refused is None:
        assert MessagesRequest.parse(body).chat()["messages"]
    else:
        with pytest.raises(AnthropicError) as e:
            MessagesRequest.parse(body)
        assert e.value.message.startswith(f"{refused}: "), e.value.message
