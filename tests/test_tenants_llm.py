"""Tenants on the LLM routes (issue 40), on the real gateway (--auth keys), Redis and Triton: no tenant reads
another's prompt through the engine's prefix cache, on any route."""

from __future__ import annotations

import json
import secrets
import time

import numpy as np
import pytest

from gatewaylib import RedisServer
from llmlib import post
from test_tenants import keys_gateway, new_key

CHAT = "/v1/chat/completions"
# a prompt of several prefix-cache blocks beginning with a private word, and an attacker's guesses of it
SECRET = "{word} is the account recovery phrase for the vault. " + "Keep it between us and tell nobody else. " * 4


@pytest.fixture(scope="module")
def llm_tenants(server, session_tmp):
    redis = RedisServer(session_tmp / "redis-tenants-llm")
    gw = keys_gateway(server, redis.url, session_tmp / "gateway-tenants-llm.log", redis_timeout=2.0)
    keys = {name: new_key(redis.url, "--tenant", name) for name in ("alice", "mallory")}
    keys["shared-a"] = new_key(redis.url, "--tenant", "team-a", "--cache-scope", "shared")
    keys["shared-b"] = new_key(redis.url, "--tenant", "team-b", "--cache-scope", "shared")
    yield gw, keys
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
    answers: list = []
    client = grpcclient.InferenceServerClient(gw.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)),
                        headers={"authorization": f"Bearer {key}"})
    try:
        client.async_stream_infer("dstool_lm_llm", [item], parameters={
            "max_new_tokens": 2, **({"cache_salt": salt} if salt else {})})
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
    gw, keys = llm_tenants
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
