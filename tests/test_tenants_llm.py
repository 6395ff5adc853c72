"""Tenants on the LLM routes (issue 40), on the real gateway (--auth keys), Redis and Triton: no tenant reads
another's prompt through the engine's prefix cache, on any route."""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_tenants import keys_gateway, new_key, usage_of

from conftest import dstool
from gatewaylib import RedisServer, eventually
from llmlib import post

CHAT = "/v1/chat/completions"
ADMIN = "admin-t0ken"
# a prompt of several prefix-cache blocks beginning with a private word, and an attacker's guesses of it
SECRET = "{word} is the account recovery phrase for the vault. " + "Keep it between us and tell nobody else. " * 4


@pytest.fixture(scope="module")
def llm_tenants(server, session_tmp):
    redis = RedisServer(session_tmp / "redis-tenants-llm")
    gw = keys_gateway(server, redis.url, session_tmp / "gateway-tenants-llm.log", redis_timeout=2.0,
                      token=ADMIN)
    keys = {name: new_key(redis.url, "--tenant", name) for name in ("alice", "mallory")}
    keys["shared-a"] = new_key(redis.url, "--tenant", "team-a", "--cache-scope", "shared")
    keys["shared-b"] = new_key(redis.url, "--tenant", "team-b", "--cache-scope", "shared")
    yield gw, keys, redis
    gw.stop()
    redis.stop()


def _cached_chat(gw, key: str, content: str, salt: str | None = None) -> int:
    """The prompt tokens a chat found in the engine's prefix cache (its usage says)."""
    status, _, body = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 2, "messages": [
        {"role": "user", "content": content}], **({"cache_salt": salt} if salt else {})},
        {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache"})
    assert status == 200, body
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _cached_generate(gw, key: str, text: str, salt: str) -> int:
    status, _, body = post(gw.http_port, "/v2/models/dstool_lm_llm/generate",
                           {"text_input": text, "max_new_tokens": 2, "parameters": {"cache_salt": salt}},
                           {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache"})
    assert status == 200, body
    return json.loads(body)["prompt_cached_tokens"]


def _cached_grpc(gw, key: str, text: str, salt: str | None = None) -> int:
    import tritonclient.grpc as grpcclient

    item = grpcclient.InferInput("text_input", [1], "BYTES")
    item.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    new = grpcclient.InferInput("max_new_tokens", [1], "INT32")
    new.set_data_from_numpy(np.array([2], dtype=np.int32))
    answers: list = []
    client = grpcclient.InferenceServerClient(gw.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)),
                        headers={"authorization": f"Bearer {key}"})
    try:
        client.async_stream_infer("dstool_lm_llm", [item, new], parameters={"cache_salt": salt} if salt else {})
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        client.stop_stream()
        client.close()
    result, error = answers[0]
    assert error is None, error
    return int(result.as_numpy("prompt_cached_tokens")[0])


def test_a_tenant_cannot_read_anothers_prompt_through_the_prefix_cache(llm_tenants):
    """Alice's prompt begins with a private word; Mallory's right guess finds no more of it in the prefix cache than a
    wrong one (none), on the OpenAI route, the generate extension and a gRPC stream, with no cache_salt or a fresh
    one each time (so only another tenant's prefixes could be found); Alice's own repeat finds hers, and keys of the
    opted-in shared scope share."""
    gw, keys, _ = llm_tenants
    alice, mallory = keys["alice"], keys["mallory"]
    right, wrong = SECRET.format(word="tangerine-falcon-42"), SECRET.format(word="purple-otter-17")
    assert _cached_chat(gw, alice, right + " First question?") == 0
    assert _cached_chat(gw, alice, right + " Second question?") >= 32  # the prefix cache works within a tenant
    seen = {guess: [_cached_chat(gw, mallory, guess + " Second question?"),
                    _cached_chat(gw, mallory, guess + " Second question?", salt=secrets.token_hex(8)),
                    _cached_generate(gw, mallory, f"USER:\n{guess} Second question?", secrets.token_hex(8)),
                    _cached_grpc(gw, mallory, f"USER:\n{guess} Second question?", secrets.token_hex(8))]
            for guess in (right, wrong)}
    assert seen[right] == seen[wrong] == [0, 0, 0, 0], seen
    assert _cached_chat(gw, keys["shared-a"], right + " Fourth question?") == 0
    assert _cached_chat(gw, keys["shared-b"], right + " Fifth question?") >= 32  # shared by opt-in


# ---- every token charged, before it is spent -------------------------------------------------------------------
def _usage(redis, key: str, until=lambda used: True) -> tuple[int, int]:
    """(prompt, completion) tokens charged to `key`; with `until`, read again until it holds for them (charges are
    sent every 50 ms, in the background: a test waits for the charge it expects rather than sleeping a guess of it;
    30 s at most, then what was read, for the caller's assertion to show)."""
    def read() -> tuple[int, int]:
        used = usage_of(redis.url, key)
        return used.get("prompt_tokens", 0), used.get("completion_tokens", 0)
    return eventually(read, until)


def _kserve_text_only(version: str = "") -> dict:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["the cat"]},
                       {"name": "max_new_tokens", "datatype": "INT32", "shape": [1, 1], "data": [3]}],
            "outputs": [{"name": "text_output"}]}


def _grpc_text_only(gw, key: str) -> None:
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"the dog"]], dtype=np.object_))
    new = grpcclient.InferInput("max_new_tokens", [1, 1], "INT32")
    new.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    client = grpcclient.InferenceServerClient(gw.grpc_url)
    try:
        client.infer("dstool_lm_generate", [text, new], outputs=[grpcclient.InferRequestedOutput("text_output")],
                     headers={"authorization": f"Bearer {key}", "cache-control": "no-cache"})
    finally:
        client.close()


def _grpc_stream(gw, key: str) -> None:
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"the bird"], dtype=np.object_))
    new = grpcclient.InferInput("max_new_tokens", [1], "INT32")
    new.set_data_from_numpy(np.array([3], dtype=np.int32))
    answers: list = []
    client = grpcclient.InferenceServerClient(gw.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)),
                        headers={"authorization": f"Bearer {key}"})
    try:
        client.async_stream_infer("dstool_lm_llm", [text, new], parameters={"ignore_eos": True})
        deadline = time.monotonic() + 30
        while not answers:  # one answer: the whole text
            assert time.monotonic() < deadline and all(e is None for _, e in answers), answers
            time.sleep(0.01)
    finally:
        client.stop_stream()
        client.close()


def test_every_route_charges_prompt_and_generated_tokens(llm_tenants):
    """Three generated tokens (and a prompt) on each route a tenant may use: the OpenAI routes, the generate
    extension on NAME_llm and NAME_generate, KServe infer asking only text_output (HTTP, a version spelt 01, no
    cache, gRPC), and a gRPC stream to NAME_llm — each charged to the key."""
    gw, keys, redis = llm_tenants
    auth = {"Authorization": f"Bearer {keys['alice']}", "Cache-Control": "no-cache"}
    routes = {
        "chat": lambda: post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 3, "ignore_eos": True,
                                                  "messages": [{"role": "user", "content": "hello"}]}, auth),
        "completions": lambda: post(gw.http_port, "/v1/completions", {"model": "dstool_lm", "prompt": "hello",
                                                                      "max_tokens": 3, "ignore_eos": True}, auth),
        "generate NAME_llm": lambda: post(gw.http_port, "/v2/models/dstool_lm_llm/generate", {
            "text_input": "hello", "max_new_tokens": 3, "ignore_eos": True}, auth),
        "generate_stream NAME_llm": lambda: post(gw.http_port, "/v2/models/dstool_lm_llm/generate_stream", {
            "text_input": "hello", "max_new_tokens": 3, "ignore_eos": True, "stream": True}, auth),
        "generate NAME_generate": lambda: post(gw.http_port, "/v2/models/dstool_lm_generate/generate", {
            "text_input": "hello there", "max_new_tokens": 3}, auth),
        "infer text_output only": lambda: post(gw.http_port, "/v2/models/dstool_lm_generate/infer",
                                               _kserve_text_only(), auth),
        "infer versions/01": lambda: post(gw.http_port, "/v2/models/dstool_lm_generate/versions/01/infer",
                                          _kserve_text_only(), auth),
        "gRPC infer text_output only": lambda: _grpc_text_only(gw, keys["alice"]),
        "gRPC stream NAME_llm": lambda: _grpc_stream(gw, keys["alice"]),
    }
    uncharged = []
    for name, send in routes.items():
        before = _usage(redis, keys["alice"])
        answer = send()
        assert answer is None or answer[0] == 200, (name, answer)
        prompt, completion = (a - b for a, b in zip(_usage(redis, keys["alice"],
                                                            lambda u, b=before: u[1] - b[1] >= 3), before))
        if not (prompt > 0 and completion == 3):
            uncharged.append((name, prompt, completion))
    assert not uncharged, uncharged


def test_tokens_are_reserved_before_they_are_spent(llm_tenants):
    """A budget of 50 tokens refuses a request that may use 1,000 (and serves a small one); 16 concurrent requests
    of up to 100 tokens under --tpm 200 spend at most the limit; n=16 choices count as 16 answers."""
    gw, _, redis = llm_tenants
    budget = new_key(redis.url, "--tenant", "frugal", "--budget-tokens", "50", "--per", "day")
    big = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 1000, "messages": [
        {"role": "user", "content": "a long story please"}]}, {"Authorization": f"Bearer {budget}"})
    assert big[0] == 429 and json.loads(big[2])["error"]["code"] == "insufficient_quota", big
    assert "max_tokens" in json.loads(big[2])["error"]["message"]
    small = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 5, "ignore_eos": True, "messages": [
        {"role": "user", "content": "short"}]}, {"Authorization": f"Bearer {budget}"})
    assert small[0] == 200, small
    assert sum(_usage(redis, budget)) <= 50

    tpm = new_key(redis.url, "--tenant", "hasty", "--tpm", "200")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: post(gw.http_port, CHAT, {
            "model": "dstool_lm", "max_tokens": 100, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"count {i}"}]}, {"Authorization": f"Bearer {tpm}",
                                                                      "Cache-Control": "no-cache"}), range(16)))
    assert {a[0] for a in answers} == {200, 429} and sum(_usage(redis, tpm)) <= 200 + 16, \
        ([a[0] for a in answers], _usage(redis, tpm))

    # no max_tokens (what clients send by default) under a budget smaller than the context: the answer runs to
    # what the budget has left, and stops there (not a 429 for the whole context's 1,024 tokens)
    open_ended = new_key(redis.url, "--tenant", "thrifty", "--budget-tokens", "60", "--per", "day")
    ended = post(gw.http_port, CHAT, {"model": "dstool_lm", "ignore_eos": True, "messages": [
        {"role": "user", "content": "tell"}]}, {"Authorization": f"Bearer {open_ended}"})
    assert ended[0] == 200 and json.loads(ended[2])["choices"][0]["finish_reason"] == "length", ended
    charged = sum(_usage(redis, open_ended, lambda u: sum(u) > 30))
    assert 30 < charged <= 60, charged

    choices = new_key(redis.url, "--tenant", "greedy", "--tpm", "100")
    many = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 10, "n": 16, "messages": [
        {"role": "user", "content": "hi"}]}, {"Authorization": f"Bearer {choices}"})
    assert many[0] == 429 and "Request too large" in json.loads(many[2])["error"]["message"], many


# ---- fair share: one tenant's flood does not hold up another ------------------------------------------------------
def test_a_tenant_is_served_while_another_floods(llm_tenants, server):
    """A tenant floods (4 streamed requests of n=8 choices and 900 tokens each: 32 sequences; its cap 16, so the
    engine's batch is full and 16 more wait at the gateway); another tenant's short chat begins within two engine
    steps of its arrival (before: only once one of the flood's answers had ended). Counted in the engine's steps
    (dstool_llm_queue_steps), not by which answer comes first: the tiny model's flood runs its 900 tokens in a few
    seconds, and a loaded machine's gateway may take as long to relay the chat. The flood then hangs up, and the
    engine stops generating for it."""
    from llmlib import llm_metrics, settled_generated

    gw, _, redis = llm_tenants
    dstool("keys", "limits", "--tenant", "flood", "--concurrency", "16", "--redis", redis.url)
    flood, victim = new_key(redis.url, "--tenant", "flood"), new_key(redis.url, "--tenant", "victim")
    ended: list[str] = []  # the finish reasons of the flood's choices that have ended
    conns = [http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=600) for _ in range(4)]
    hung_up = threading.Event()

    def flood_request(i: int) -> None:
        conn = conns[i]
        conn.request("POST", CHAT, json.dumps({
            "model": "dstool_lm", "max_tokens": 900, "ignore_eos": True, "n": 8, "stream": True,
            "messages": [{"role": "user", "content": f"flood {i}"}]}),
            {"Authorization": f"Bearer {flood}", "Cache-Control": "no-cache", "Content-Type": "application/json"})
        try:
            r = conn.getresponse()
            assert r.status == 200
            for line in r:
                if b'"finish_reason":"' in line:
                    ended.append(line.split(b'"finish_reason":"', 1)[1].split(b'"', 1)[0].decode())
        except (OSError, http.client.HTTPException):
            if not hung_up.is_set():
                raise

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood_request, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while _waiting(gw, "flood") < 16 or llm_metrics(server)[RUNNING] < 16:  # 16 generating, 16 waiting
            assert time.monotonic() < deadline, "the flood never filled its share"
            time.sleep(0.05)
        ended_before, before = list(ended), llm_metrics(server)
        answered = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 4, "messages": [
            {"role": "user", "content": "me too"}]}, {"Authorization": f"Bearer {victim}",
                                                      "Cache-Control": "no-cache"})
        after = llm_metrics(server)
        hung_up.set()
        for conn in conns:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        for f in floods:
            f.result()
        for conn in conns:
            conn.close()
    assert answered[0] == 200, answered
    assert not ended_before, f"the flood ended ({ended_before}) before the other tenant's chat was sent"
    # requests begun since (the chat; flood requests let in as flood answers end), all within 2 steps of arriving
    begun, soon = (after[name] - before[name] for name in (BEGUN, SOON))
    assert begun >= 1 and soon == begun, f"{begun:.0f} begun, {soon:.0f} of them within 2 steps"
    assert eventually(lambda: _waiting(gw, "flood"), lambda n: n == 0) == 0
    settled_generated(server)  # the engine stops: the hung-up flood costs no more work


RUNNING = 'dstool_llm_sequences{model="dstool_lm_llm",state="running",version="1"}'
BEGUN, SOON = (f'dstool_llm_queue_steps_bucket{{model="dstool_lm_llm",version="1",le="{le}"}}' for le in ("+Inf", "2"))


def _waiting(gw, tenant: str) -> float:
    """Sequences of `tenant` waiting their turn at the gateway (its /metrics, read with the admin key)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'dstool_gateway_tenant_waiting_sequences{{tenant="{tenant}"}}'))


def test_nothing_is_generated_after_a_stop_string_cut_the_answer(llm_tenants, server):
    """A stop string ends the generation in the engine at once: what the engine generated is what the key was
    charged (before: 30-200 more tokens were generated after the cut, uncharged)."""
    from llmlib import settled_generated

    gw, keys, redis = llm_tenants
    before_usage, before = _usage(redis, keys["alice"]), settled_generated(server)
    for i, stream in enumerate((False, True)):
        status, _, body = post(gw.http_port, CHAT, {
            "model": "dstool_lm", "max_tokens": 400, "ignore_eos": True, "stop": ["e"], "stream": stream,
            "messages": [{"role": "user", "content": f"speak {i}"}]},
            {"Authorization": f"Bearer {keys['alice']}", "Cache-Control": "no-cache"})
        assert status == 200 and b'"finish_reason":"stop"' in body, body[-300:]
    generated = settled_generated(server) - before
    charged = _usage(redis, keys["alice"], lambda u: u[1] - before_usage[1] >= generated - 2)[1] - before_usage[1]
    assert 0 < generated <= charged + 2, (generated, charged)  # at most a token in flight per request


def test_the_model_is_checked_before_any_grammar_is_compiled(llm_tenants):
    """A key not given the model is refused (404) before its grammar is looked at: an invalid one, or a bomb that
    once crashed the gateway, gets the same 404 (before: compiled first, from any key)."""
    gw, _, redis = llm_tenants
    other = new_key(redis.url, "--tenant", "elsewhere", "--models", "echo_fp32")
    for grammar in ("start: missing_rule", "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000))):
        status, _, body = post(gw.http_port, CHAT, {"model": "dstool_lm", "max_tokens": 2, "guided_grammar": grammar,
                                                    "messages": [{"role": "user", "content": "hi"}]},
                               {"Authorization": f"Bearer {other}"})
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found", body


def test_a_request_refused_on_a_grpc_stream_drops_no_admitted_answer(llm_tenants):
    """One stream: a long answer admitted, then a request the gateway refuses (a model the key is not given) while
    that answer is still being made, then another admitted one. The refusal comes back on the stream as its error;
    both admitted answers come back (the refusal once ended the stream and lost them)."""
    import tritonclient.grpc as grpcclient

    gw, _, redis = llm_tenants
    key = new_key(redis.url, "--tenant", "streamer", "--models", "dstool_lm")

    def request(new_tokens: int) -> list:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"the fox"], dtype=np.object_))
        new = grpcclient.InferInput("max_new_tokens", [1], "INT32")
        new.set_data_from_numpy(np.array([new_tokens], dtype=np.int32))
        return [text, new]

    answers: list = []
    client = grpcclient.InferenceServerClient(gw.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)),
                        headers={"authorization": f"Bearer {key}", "cache-control": "no-cache"})
    try:
        # 1000 tokens: time for the refusal to come back while it is made, on a loaded machine too (200 were not)
        client.async_stream_infer("dstool_lm_llm", request(1000), request_id="long", parameters={"ignore_eos": True})
        client.async_stream_infer("other_llm", request(3), request_id="refused")
        client.async_stream_infer("dstool_lm_llm", request(3), request_id="short", parameters={"ignore_eos": True})
        deadline = time.monotonic() + 180
        while len(answers) < 3:
            assert time.monotonic() < deadline, answers
            time.sleep(0.01)
        time.sleep(0.2)  # nothing more comes
    finally:
        client.stop_stream()
        client.close()
    errors = [str(error) for _, error in answers if error is not None]
    served = {result.get_response().id: result.as_numpy("text_output") for result, error in answers if error is None}
    assert len(errors) == 1 and "is not given the model 'other_llm'" in errors[0], errors
    assert set(served) == {"long", "short"} and len(answers) == 3, answers
    order = ["refused" if error is not None else result.get_response().id for result, error in answers]
    assert order.index("refused") < order.index("long"), order  # refused while "long" was being made
