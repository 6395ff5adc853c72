"""The stateful Responses API on Redis, across gateway processes (docs/responses.md): `store`, `previous_response_id`
with a function-call round trip continued on a second gateway, GET/DELETE/input_items, background responses polled
and cancelled from another gateway, tenants' scopes, Redis down, hostile ids — the official `openai` client against
two real gateways sharing one real Redis in front of a real Triton serving dstool_lm_llm."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dstool.serve.export.repository import ENGINE_MAX_BATCH

from conftest import dstool
from gatewaylib import GatewayProcess, RedisServer, eventually
from llmlib import cancelled, metric

TOKEN = "sk-responses-test"
ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}
# an answer that must be long (a grammar of 200 numbers): a background response still running when it is cancelled
LONG = {"format": {"type": "json_schema", "name": "numbers", "schema": {
    "type": "array", "items": {"type": "integer", "minimum": 100000, "maximum": 999999}, "minItems": 200}}}


def _gateway(server, redis_url: str, log, **config) -> GatewayProcess:
    return GatewayProcess(log, config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                       "cache": redis_url, "responses_ttl": 600, **config})


@pytest.fixture(scope="module")
def store_redis(session_tmp):
    r = RedisServer(session_tmp / "redis-responses")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def pair(server, store_redis, session_tmp):
    """Two gateway processes on one Redis: a conversation begun on one goes on on the other."""
    a = _gateway(server, store_redis.url, session_tmp / "gateway-responses-a.log", token=TOKEN)
    b = _gateway(server, store_redis.url, session_tmp / "gateway-responses-b.log", token=TOKEN)
    yield a, b
    a.stop()
    b.stop()


def _client(gw: GatewayProcess, key: str = TOKEN):
    import openai

    return openai.OpenAI(base_url=f"http://{gw.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def _raw(gw: GatewayProcess, method: str, path: str, body: dict | None = None, key: str = TOKEN):
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=60)
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


def _stored_keys(redis: RedisServer) -> list[str]:
    return sorted(k.decode() for k in redis.client().scan_iter("dstool:responses:*"))


def test_a_function_call_round_trip_continues_on_a_second_gateway(pair, store_redis):
    a, b = pair
    first = _client(a).responses.create(model="dstool_lm", input="2 + 3?", tools=[ADD], max_output_tokens=60,
                                        tool_choice={"type": "function", "name": "add"}, temperature=0)
    call = first.output[0]
    assert first.store is True and first.status == "completed" and call.type == "function_call", first
    assert first.id.startswith("resp_") and len(first.id) == 5 + 48
    key = f"dstool:responses:-:{first.id}"
    assert key in _stored_keys(store_redis) and 0 < store_redis.client().ttl(key) <= 600  # --responses-ttl

    # the second turn on the OTHER gateway: the call's output, after the stored conversation
    second = _client(b).responses.create(model="dstool_lm", previous_response_id=first.id, tools=[ADD],
                                         max_output_tokens=8, temperature=0, input=[
                                             {"type": "function_call_output", "call_id": call.call_id,
                                              "output": "5"}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the same conversation sent whole to a stateless request: the same prompt, so the same greedy answer
    whole = _client(a).responses.create(model="dstool_lm", store=False, tools=[ADD], max_output_tokens=8,
                                        temperature=0, input=[
                                            {"role": "user", "content": "2 + 3?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": "add",
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "5"}])
    assert whole.store is False and whole.id not in "".join(_stored_keys(store_redis))
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text

    # read back on either gateway: the stored object
    for gw in (a, b):
        got = _client(gw).responses.retrieve(second.id)
        assert (got.id, got.status, got.output_text, got.usage, got.previous_response_id) == (
            second.id, second.status, second.output_text, second.usage, first.id)
    items = _client(a).responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]
    assert items.data[1].call_id == call.call_id and items.data[1].arguments == call.arguments
    newest = _client(b).responses.input_items.list(second.id, limit=1)  # OpenAI's default order: newest first
    assert [i.type for i in newest.data] == ["function_call_output"] and newest.has_more

    # a third turn, streamed, on the first gateway: the stored response is in Redis before response.completed
    with _client(a).responses.stream(model="dstool_lm", previous_response_id=second.id, input="And 4 + 4?",
                                     max_output_tokens=6, temperature=0) as stream:
        ends = []
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens cut it
                ends.append(event.response)
                seen = _client(b).responses.retrieve(event.response.id)
                assert seen.status == event.response.status and seen.output_text == event.response.output_text
    assert len(ends) == 1
    third = ends[0]
    history = [{"role": "user", "content": "2 + 3?"},
               {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
               *[{"role": "assistant", "content": item.content[0].text} if item.type == "message" else
                 {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
                 for item in second.output],
               {"role": "user", "content": "And 4 + 4?"}]
    replay = _client(b).responses.create(model="dstool_lm", store=False, input=history, max_output_tokens=6,
                                         temperature=0)
    assert third.usage.input_tokens == replay.usage.input_tokens and third.output_text == replay.output_text


def test_store_false_keeps_nothing_and_delete_removes(pair, store_redis):
    import openai

    a, b = pair
    before = _stored_keys(store_redis)
    kept = _client(a).responses.create(model="dstool_lm", input="Who goes there?", max_output_tokens=4,
                                       temperature=0)
    not_kept = _client(a).responses.create(model="dstool_lm", input="Who goes there?", max_output_tokens=4,
                                           temperature=0, store=False)
    assert set(_stored_keys(store_redis)) - set(before) == {f"dstool:responses:-:{kept.id}"}
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{not_kept.id}' not found"):
        _client(b).responses.retrieve(not_kept.id)

    status, deleted = _raw(b, "DELETE", f"/v1/responses/{kept.id}")
    assert (status, deleted) == (200, {"id": kept.id, "object": "response", "deleted": True})
    assert f"dstool:responses:-:{kept.id}" not in _stored_keys(store_redis)
    for gw in (a, b):
        with pytest.raises(openai.NotFoundError):
            _client(gw).responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            _client(gw).responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError) as gone:
        _client(a).responses.create(model="dstool_lm", input="Again?", previous_response_id=kept.id,
                                    max_output_tokens=2)
    assert gone.value.param == "previous_response_id"
    assert gone.value.body["message"] == f"Previous response with id '{kept.id}' not found."
    with pytest.raises(openai.BadRequestError) as refused:
        _client(a).responses.create(model="dstool_lm", input="x", background=True, store=False)
    assert refused.value.param == "background"


def _poll(client, ident: str, until, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while True:
        r = client.responses.retrieve(ident)
        if until(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_background_responses_are_polled_and_cancelled_from_another_gateway(pair, server):
    import openai

    a, b = pair
    queued = _client(a).responses.create(model="dstool_lm", input="Speak, Juliet.", max_output_tokens=12,
                                         temperature=0, background=True)
    # answered before its answer was made (what the status says, on the store's word), however long either took
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    done = _poll(_client(b), queued.id, lambda r: r.status not in ("queued", "in_progress"))
    plain = _client(b).responses.create(model="dstool_lm", input="Speak, Juliet.", max_output_tokens=12,
                                        temperature=0, store=False)
    assert done.status == plain.status and done.output_text == plain.output_text and done.usage == plain.usage

    # two long answers on A while the engine's batch (ENGINE_MAX_BATCH rows) is full with as many others, so both
    # wait in the engine and neither can end before its cancel: one cancelled on A, the other on B — A learns of it
    # at its next heartbeat. The engine is told to stop both (its cancelled counter), and no outcome overwrites the
    # status. (With fewer loads than the batch holds, the two generated beside them and could end first.)
    def load(i: int) -> int:  # straight to Triton: 1000 tokens whatever is sampled, no client timeout to end it
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600)
        conn.request("POST", "/v2/models/dstool_lm_llm/generate_stream", json.dumps(
            {"text_input": f"Load {i}.", "max_new_tokens": 1000, "ignore_eos": True, "stream": True}))
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status

    # LONG compiled on A first (B compiles it for the loads), so A's two reach the engine at once
    _client(a).responses.create(model="dstool_lm", input="Warm.", max_output_tokens=2, text=LONG, store=False)
    # the engine idle first: a sequence left running by an earlier test would pass for one of these in its count
    idle = eventually(lambda: metric(server, "dstool_llm_sequences"), lambda n: n == 0, 180)
    assert idle == 0, ("the engine never went idle", idle)
    before = cancelled(server)
    with ThreadPoolExecutor(ENGINE_MAX_BATCH) as pool:
        busy = [pool.submit(load, i) for i in range(ENGINE_MAX_BATCH)]
        in_engine = eventually(lambda: metric(server, "dstool_llm_sequences"), lambda n: n >= ENGINE_MAX_BATCH, 180)
        assert in_engine >= ENGINE_MAX_BATCH, "the loads never reached the engine"
        longs = [_client(a).responses.create(model="dstool_lm", input=f"Count to {i}.", max_output_tokens=900,
                                             temperature=1.0, text=LONG, background=True) for i in range(2)]
        # both in the engine, waiting, before their cancel (one cancelled while still queued in the gateway never
        # reaches it: nothing to stop); the nets are against a hang, on a machine that may be loaded
        in_engine = eventually(lambda: metric(server, "dstool_llm_sequences"), lambda n: n >= ENGINE_MAX_BATCH + 2,
                               180)
        assert in_engine >= ENGINE_MAX_BATCH + 2, ("the two background responses never reached the engine", in_engine,
                                                   [(r.status, r.error) for r in
                                                    (_client(a).responses.retrieve(x.id) for x in longs)])
        stopped = [_client(gw).responses.cancel(r.id) for gw, r in zip((a, b), longs)]
        assert [r.status for r in stopped] == ["cancelled"] * 2, [(r.status, r.usage) for r in stopped]
        # (a net against a hang: B's cancel reaches A at its next heartbeat, on a machine that may be loaded; one
        # that kept generating never adds to the counter, its 900 tokens end as `completed`)
        deadline = time.monotonic() + 180
        while cancelled(server) < before + 2:
            assert time.monotonic() < deadline, ("a cancelled response kept generating", cancelled(server) - before,
                                                 metric(server, "dstool_llm_sequences"), longs,
                                                 a.log.read_text()[-3000:], b.log.read_text()[-3000:])
            time.sleep(0.1)
        assert [f.result() for f in busy] == [200] * ENGINE_MAX_BATCH  # the others ran to their end
    for r in longs:
        after = _client(a).responses.retrieve(r.id)
        assert after.status == "cancelled" and after.output == []  # never overwritten by the work it stopped
    assert _client(a).responses.cancel(longs[1].id).status == "cancelled"  # again: as it is
    foreground = _client(a).responses.create(model="dstool_lm", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Only responses created with background"):
        _client(a).responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError) as unfinished:  # a conversation continues from a finished response
        _client(a).responses.create(model="dstool_lm", input="more", previous_response_id=longs[0].id,
                                    max_output_tokens=2)
    assert unfinished.value.param == "previous_response_id" and "cancelled" in unfinished.value.message


def test_tenants_never_reach_each_others_responses(server, pair, store_redis, session_tmp):
    import openai

    gw = _gateway(server, store_redis.url, session_tmp / "gateway-responses-keys.log", auth="keys",
                  redis_timeout=2.0)
    try:
        keys = {t: dstool("keys", "create", "--redis", store_redis.url, "--tenant", t).stdout.strip()
                for t in ("resp-a", "resp-b")}
        mine = _client(gw, keys["resp-a"]).responses.create(model="dstool_lm", input="Whose?", max_output_tokens=3,
                                                            temperature=0)
        assert f"dstool:responses:t=resp-a:{mine.id}" in _stored_keys(store_redis)
        other = _client(gw, keys["resp-b"])
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError) as continued:
            other.responses.create(model="dstool_lm", input="Mine now?", previous_response_id=mine.id,
                                   max_output_tokens=2)
        assert continued.value.param == "previous_response_id"
        assert _client(gw, keys["resp-a"]).responses.retrieve(mine.id).output_text == mine.output_text
        with pytest.raises(openai.NotFoundError):  # nor in token mode's scope, on the same Redis
            _client(pair[0]).responses.retrieve(mine.id)
    finally:
        gw.stop()


def test_redis_down_is_a_clear_503_and_stateless_requests_still_answer(server, session_tmp):
    import openai

    redis = RedisServer(session_tmp / "redis-responses-down")
    gw = _gateway(server, redis.url, session_tmp / "gateway-responses-down.log", token=TOKEN,
                  responses_redis_timeout=0.5)
    try:
        client = _client(gw)
        kept = client.responses.create(model="dstool_lm", input="Before.", max_output_tokens=3, temperature=0)
        redis.kill()
        needs_store = (lambda: client.responses.retrieve(kept.id),
                       lambda: client.responses.delete(kept.id),
                       lambda: client.responses.create(model="dstool_lm", input="x", max_output_tokens=2),
                       lambda: client.responses.create(model="dstool_lm", input="x", max_output_tokens=2,
                                                       store=False, previous_response_id=kept.id),
                       lambda: client.responses.create(model="dstool_lm", input="x", max_output_tokens=2,
                                                       background=True),
                       lambda: list(client.responses.create(model="dstool_lm", input="x", max_output_tokens=2,
                                                            stream=True)))
        for ask in needs_store:
            t = time.monotonic()
            with pytest.raises(openai.InternalServerError) as down:
                ask()
            assert down.value.status_code == 503 and down.value.code == "store_unavailable", down.value.body
            assert "response store is unavailable" in down.value.message and "store: false" in down.value.message
            assert time.monotonic() - t < 30  # a net against a hang (the store's calls are bounded by 0.5 s each)
        alone = client.responses.create(model="dstool_lm", input="Still here?", max_output_tokens=3, temperature=0,
                                        store=False)
        assert alone.status in ("completed", "incomplete") and alone.store is False
        redis.start()  # back, empty: the store answers again once its back-off ends

        def looked_up() -> str:
            try:
                client.responses.retrieve(kept.id)
            except openai.NotFoundError:
                return "not found"
            except openai.InternalServerError as e:
                return f"unavailable ({e.status_code})"
            return "found"

        found = eventually(looked_up, lambda found: not found.startswith("unavailable"))
        assert found == "not found", found  # the store answers, and what it held is gone with it
        again = client.responses.create(model="dstool_lm", input="After.", max_output_tokens=3, temperature=0)
        assert client.responses.retrieve(again.id).output_text == again.output_text
    finally:
        gw.stop()
        redis.stop()
    assert "Traceback" not in (session_tmp / "gateway-responses-down.log").read_text()


def test_hostile_ids_never_reach_redis_and_never_fail_the_gateway(pair, store_redis):
    a, _ = pair
    before = _stored_keys(store_redis)
    real = _client(a).responses.create(model="dstool_lm", input="x", max_output_tokens=2, temperature=0)
    for path in ("/v1/responses/../../etc/passwd", "/v1/responses/%2e%2e%2fetc", "/v1/responses/resp_" + "0" * 31,
                 "/v1/responses/resp_" + "g" * 32, "/v1/responses/resp_" + "0" * 65, "/v1/responses/*",
                 "/v1/responses/resp_*", "/v1/responses/" + real.id.upper(), "/v1/responses/" + real.id + "%00",
                 "/v1/responses/" + real.id + "/../" + real.id, "/v1/responses/" + "a" * 7000,
                 "/v1/responses/dstool:responses:-:" + real.id, "/v1/responses/", "/v1/responses//cancel"):
        for method in ("GET", "DELETE"):
            status, body = _raw(a, method, path)
            assert status in (404, 414), (path, method, status, body)
            assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error", (path, body)
    for path, method in (("/v1/responses/" + real.id + "/cancel/now", "POST"), ("/v1/responses/" + real.id, "PUT"),
                         ("/v1/responses/" + real.id + "/cancel", "GET"), ("/v1/responses", "GET")):
        status, body = _raw(a, method, path)
        assert status in (404, 405) and "error" in body, (path, method, status, body)
    for previous, status in (("../" + real.id, 404), ("x" * 100_000, 404), (7, 400), ({"$ne": 1}, 400),
                             ([real.id], 400), ("resp_" + "0" * 48, 404)):
        got, body = _raw(a, "POST", "/v1/responses", {"model": "dstool_lm", "input": "x", "max_output_tokens": 2,
                                                      "previous_response_id": previous})
        assert got == status and body["error"]["param"] == "previous_response_id", (previous, got, body)
        assert len(body["error"]["message"]) < 300
    assert _raw(a, "GET", "/v1/responses/" + real.id)[0] == 200  # still there, untouched
    assert set(_stored_keys(store_redis)) - set(before) == {f"dstool:responses:-:{real.id}"}


def test_a_conversation_too_large_to_store_is_refused_unless_store_false(server, store_redis, session_tmp):
    import openai

    gw = _gateway(server, store_redis.url, session_tmp / "gateway-responses-small.log", token=TOKEN,
                  max_response_bytes=2048)
    try:
        client = _client(gw)
        with pytest.raises(openai.BadRequestError) as big:
            client.responses.create(model="dstool_lm", input="word " * 500, max_output_tokens=2)
        assert big.value.param == "input" and "--max-response-bytes" in big.value.message
        fine = client.responses.create(model="dstool_lm", input="word " * 500, max_output_tokens=2, store=False)
        assert fine.status in ("completed", "incomplete")
        small = client.responses.create(model="dstool_lm", input="Hi", max_output_tokens=2, temperature=0)
        assert client.responses.retrieve(small.id).id == small.id
    finally:
        gw.stop()


def test_a_background_response_whose_gateway_died_reads_as_failed(pair, server, store_redis, session_tmp):
    """Acknowledged as queued, then its gateway is killed (SIGKILL: no word to Redis): another gateway reads it as
    failed once its heartbeats stop, never in_progress for ever."""
    import signal

    a, _ = pair
    doomed = _gateway(server, store_redis.url, session_tmp / "gateway-responses-doomed.log", token=TOKEN)
    try:
        r = _client(doomed).responses.create(model="dstool_lm", input="Count.", max_output_tokens=900,
                                             temperature=1.0, text=LONG, background=True)
        doomed.stop(signal.SIGKILL)
        assert _client(a).responses.retrieve(r.id).status in ("queued", "in_progress")
        started = time.monotonic()
        failed = _poll(_client(a), r.id, lambda x: x.status == "failed", seconds=40)
        assert failed.status == "failed" and failed.error.code == "server_error", failed
        assert "stopped before it finished" in failed.error.message and time.monotonic() - started < 30
    finally:
        doomed.stop()


@pytest.mark.parametrize(("field", "value", "param", "says"), [
    ("temperature", "hot", "temperature", "Input should be a valid number, got 'hot'"),
    ("max_output_tokens", True, "max_output_tokens", "Input should be a valid integer, got True"),
    ("parallel_tool_calls", "yes", "parallel_tool_calls", "Input should be a valid boolean, got 'yes'"),
    ("truncation", "bogus", "truncation", "Input should be 'auto' or 'disabled', got 'bogus'"),
    ("include", "reasoning", "include", "Input should be a valid list"),
    ("store", 1, "store", "Input should be a valid boolean, got 1"),
    # the right type, a value not served
    ("top_logprobs", 2, "top_logprobs", "'top_logprobs' is not supported by this server (got 2)"),
    ("truncation", "auto", "truncation", "'truncation' is not supported by this server (got 'auto')"),
    ("max_tool_calls", 3, "max_tool_calls", "'max_tool_calls' is not supported by this server (got 3): leave it out"),
    # objects of their own types, input text or a list of objects: a mistake is named by its path
    ("reasoning", "high", "reasoning", "Input should be a valid dictionary"),
    ("reasoning", {"effort": "low", "mode": 1}, "reasoning.mode", "Unrecognized request argument"),
    ("reasoning", {"summary": "auto"}, "reasoning.summary", "'reasoning.summary' 'auto': reasoning summaries are not"),
    ("reasoning", {"generate_summary": "concise"}, "reasoning.generate_summary", "'reasoning.generate_summary' 'co"),
    ("text", {"format": "json"}, "text.format", "Input should be a valid dictionary, got 'json'"),
    ("text", {"verbosity": 3}, "text.verbosity", "Input should be a valid string, got 3"),
    ("model", 5, "model", "Input should be a valid string, got 5"),
    ("input", 5, "input", "'input' must be text or a non-empty list of input items, got 5"),
    ("input", ["x"], "input[0]", "Input should be a valid dictionary, got 'x'"),
])
def test_a_wrong_responses_field_is_a_400_naming_it(field, value, param, says):
    """Each typed field of a Responses request refused in OpenAI's error shape, naming where the client sent the
    mistake."""
    from dstool.serve.gateway.openai.protocol import OpenAIError, parse
    from dstool.serve.gateway.openai.responses import ResponsesRequest

    with pytest.raises(OpenAIError) as e:
        parse(json.dumps({"model": "m", "input": "hi", field: value}).encode(), ResponsesRequest).chat()
    assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message


def test_responses_reasoning_and_text_become_the_chat_fields():
    from dstool.serve.gateway.openai.protocol import parse
    from dstool.serve.gateway.openai.responses import ResponsesRequest

    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    chat = parse(json.dumps({"model": "m", "input": "hi", "reasoning": {"effort": "low", "summary": None},
                             "text": {"format": schema, "verbosity": "low"}}).encode(), ResponsesRequest).chat()
    assert chat["reasoning_effort"] == "low" and chat["verbosity"] == "low"
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}
    plain = parse(json.dumps({"model": "m", "input": "hi", "text": {"format": {"type": "text"}}}).encode(),
                  ResponsesRequest).chat()
    assert plain["response_format"] == {"type": "text"} and "reasoning_effort" not in plain
