"""The OpenAI API on the gateway, served by dstool_lm_llm on a real Triton, checked with the official `openai`
client (sync, async, streaming) and a raw HTTP request, against transformers' greedy text."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from gatewaylib import GatewayProcess
from llmlib import llm_requests

TOKEN = "sk-dstool-test"


@pytest.fixture(scope="module")
def api(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-openai.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory", "token": TOKEN})
    yield gw
    gw.stop()


def _greedy(trained, prompt: str, new_tokens: int) -> tuple[str, int, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(trained).eval().generate(
            ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    return tokenizer.decode(out, skip_special_tokens=True), ids.shape[1], out.tolist()


def _client(api, key: str = TOKEN):
    import openai

    return openai.OpenAI(base_url=f"http://{api.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_models_and_a_greedy_completion(api, trained):
    client = _client(api)
    assert "dstool_lm" in [m.id for m in client.models.list().data]
    prompt = "ROMEO:\nBut soft, what light"
    text, prompt_tokens, ids = _greedy(trained, prompt, 12)
    answer = client.completions.create(model="dstool_lm", prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == text and answer.object == "text_completion"
    assert answer.usage.prompt_tokens == prompt_tokens and answer.usage.completion_tokens == len(ids)
    assert answer.choices[0].finish_reason == ("length" if len(ids) == 12 else "stop")


def _chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt NAME_llm lays out for `messages` (the chat template, or the corpus's layout without one)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages) + "ASSISTANT:\n"


def test_a_shared_system_prompt_is_reused_and_reported_as_cached_tokens(api, server, trained):
    """Two chats with one long system prompt and different questions (the gateway's result cache misses both): the
    second starts from the prefix the first left in the engine's prefix cache, in whole blocks of 16 tokens; the
    official client reads usage.prompt_tokens_details.cached_tokens, streamed usage too; the answer is still
    transformers' greedy one; Triton's /metrics carries the prefix cache's hit ratio."""
    from transformers import AutoTokenizer

    from llmlib import metric

    tokenizer = AutoTokenizer.from_pretrained(trained)
    system = {"role": "system", "content": "You are the chorus of a history play, and you speak in verse. " * 4}
    chats = [[system, {"role": "user", "content": question}] for question in ("Who is king?", "Where is the army?")]
    prompts = [tokenizer(_chat_prompt(tokenizer, chat))["input_ids"] for chat in chats]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common >= 32
    client = _client(api)
    first = client.chat.completions.create(model="dstool_lm", messages=chats[0], max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens == len(prompts[0]) and first.usage.prompt_tokens_details.cached_tokens % 16 == 0
    chunks = list(client.chat.completions.create(model="dstool_lm", messages=chats[1], max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(prompts[1]) and usage.prompt_tokens_details.cached_tokens == common // 16 * 16
    text, _, _ = _greedy(trained, _chat_prompt(tokenizer, chats[1]), 6)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert 0 < metric(server, "dstool_llm_prefix_cache_hit_ratio") < 1
    assert metric(server, "dstool_llm_prefix_cache_held_tokens") >= len(prompts[0]) // 16 * 16


def test_a_streamed_chat_completion(api, trained):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained)
    messages = [{"role": "system", "content": "You are Juliet."}, {"role": "user", "content": "Where art thou?"}]
    prompt = _chat_prompt(tokenizer, messages)
    text, prompt_tokens, ids = _greedy(trained, prompt, 10)
    chunks = list(_client(api).chat.completions.create(model="dstool_lm", messages=messages, max_tokens=10,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and len(pieces) > 1  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.completion_tokens == len(ids)


def test_each_answer_says_its_own_timings(api):
    """Per-request timings in the answer's headers (issue 44): the gateway's time to the first token and, for a whole
    answer, to its end; a stream's headers go out with its first token, so they carry the first."""
    client = _client(api)
    ask = {"model": "dstool_lm", "messages": [{"role": "user", "content": "Timings?"}], "max_tokens": 6,
           "temperature": 0.7, "extra_headers": {"Cache-Control": "no-cache"}, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.with_raw_response.create(**ask)
    first, end = (float(whole.headers[f"x-dstool-{n}-ms"]) for n in ("time-to-first-token", "e2e"))
    assert 0 < first <= end and whole.parse().usage.completion_tokens == 6
    with client.chat.completions.with_streaming_response.create(stream=True, **ask) as streamed:
        assert float(streamed.headers["x-dstool-time-to-first-token-ms"]) > 0
        assert "x-dstool-e2e-ms" not in streamed.headers  # not known when the headers go out
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert len(events) > 2 and events[-1] == "data: [DONE]"


def test_async_client_seeds_n_and_stop_strings(api, trained):
    import openai

    prompt = "KING RICHARD:\nNow is the winter"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"http://{api.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(client.completions.create(
                model="dstool_lm", prompt=prompt, max_tokens=12, temperature=1.0, seed=3, n=2) for _ in range(2)))
        finally:
            await client.close()

    first, second = asyncio.run(run())
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded: the same draws
    assert [c.index for c in first.choices] == [0, 1] and first.usage.completion_tokens >= 2

    text, _, _ = _greedy(trained, prompt, 16)
    stop = text.strip()[len(text.strip()) // 2:][:3]
    assert stop, text
    cut = _client(api).completions.create(model="dstool_lm", prompt=prompt, max_tokens=16, temperature=0,
                                          stop=["never in this text", stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_errors_in_openais_form(api):
    import openai

    for temperature in (None, 0):  # a draw goes straight to Triton; a greedy request asks the cache first
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            _client(api).completions.create(model="no_such_model", prompt="x", max_tokens=2,
                                            **({} if temperature is None else {"temperature": temperature}))
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be an integer from 0 to 20"):
        _client(api).completions.create(model="dstool_lm", prompt="x", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        _client(api).chat.completions.create(model="dstool_lm", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="'suffix' is not supported"):
        _client(api).completions.create(model="dstool_lm", prompt="x", max_tokens=2, suffix="y")
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        _client(api).completions.create(model="dstool_lm", prompt="x", max_tokens=2, top_p=0)
    # Refused before the route is known (a wrong key, a body over the limit): still OpenAI's error object on /v1
    with pytest.raises(openai.AuthenticationError) as wrong_key:
        _client(api, key="wrong").models.list()
    assert (wrong_key.value.type, wrong_key.value.code) == ("invalid_request_error", "invalid_api_key")
    assert "bearer token" in wrong_key.value.message
    with pytest.raises(openai.APIStatusError) as too_big:
        _client(api).completions.create(model="dstool_lm", prompt="x" * (5 << 20), max_tokens=2)
    assert too_big.value.status_code == 413 and too_big.value.type == "invalid_request_error"
    assert "exceeds the gateway's limit" in too_big.value.message


def test_raw_sse_ends_with_done(api):
    body = json.dumps({"model": "dstool_lm", "prompt": "JULIET:\n", "max_tokens": 5, "temperature": 0,
                       "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}",
                                                    "Content-Type": "application/json"})
    r = conn.getresponse()
    events = [line for line in r.read().decode().split("\n\n") if line]
    conn.close()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_dstool_infer_over_the_openai_route(api, trained, monkeypatch):
    from conftest import dstool

    prompt = "JULIET:\nO Romeo"
    text, _, _ = _greedy(trained, prompt, 10)
    monkeypatch.setenv("DSTOOL_GATEWAY_TOKEN", TOKEN)
    for extra in ([], ["--stream"]):
        proc = dstool("infer", prompt, "--openai", "--max-new-tokens", "10", "--url", api.http_url, *extra)
        assert proc.stdout == prompt + text + "\n", proc.stderr
    monkeypatch.setenv("DSTOOL_GATEWAY_TOKEN", "wrong")
    bad = dstool("infer", prompt, "--openai", "--url", api.http_url, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "401" in bad.stderr, bad.stderr
    grpc_port = dstool("infer", prompt, "--openai", "--url", api.grpc_url, check=False)  # not HTTP
    assert grpc_port.returncode == 2 and "give the HTTP port" in grpc_port.stderr, grpc_port.stderr


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", b"{not json", 400, "the body is not JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "x"}', 400, "'model' is required"),
    ("/v1/completions", b'{"model": "dstool_lm", "prompt": 5}', 400, "'prompt' must be a string"),
    ("/v1/completions", b'{"model": "dstool_lm", "prompt": "x", "max_tokens": 0}', 400, "'max_tokens'"),
    ("/v1/completions", b'{"model": "dstool_lm", "prompt": "x", "n": 99}', 400, "'n' must be"),
    ("/v1/completions", b'{"model": "dstool_lm", "prompt": "x", "stop": [1]}', 400, "'stop' must be"),
    ("/v1/chat/completions", b'{"model": "dstool_lm", "messages": []}', 400, "'messages' must be"),
    ("/v1/embeddings", b"{}", 404, "no route")])
def test_bad_openai_requests_get_openai_errors(api, path, body, status, needle):
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
    conn.request("POST", path, body, {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    r = conn.getresponse()
    answer = json.loads(r.read())
    conn.close()
    assert r.status == status and needle in answer["error"]["message"] and "type" in answer["error"], answer
    assert answer["error"]["code"] is None, answer  # a missing route is no missing model


def _post(api, path: str, body: dict, headers: dict | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {TOKEN}",
                                                  "Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    answer = (r.status, r.getheader("Content-Type"), r.read())
    conn.close()
    return answer


def test_generate_stream_hits_are_streams_and_draws_are_never_cached(api, server):
    path = "/v2/models/dstool_lm_llm/generate_stream"
    greedy = {"text_input": "MENENIUS:\nWhat work", "max_new_tokens": 8, "stream": True}
    before = llm_requests(server)
    first = _post(api, path, greedy)
    second = _post(api, path, greedy)
    assert first == second and first[0] == 200 and first[1].startswith("text/event-stream")
    events = [e for e in first[2].split(b"\n\n") if e]
    assert len(events) > 1 and all(e.startswith(b"data: {") for e in events)  # token by token, from the cache too
    assert llm_requests(server) == before + 1  # the repeat never reached Triton

    seeded = {**greedy, "temperature": 1.0, "seed": 11}
    assert _post(api, path, seeded) == _post(api, path, seeded)
    other_seed = _post(api, path, {**seeded, "seed": 12})  # the key covers every sampling parameter
    hotter = _post(api, path, {**seeded, "temperature": 1.5})
    assert llm_requests(server) == before + 4
    drawn = {**greedy, "temperature": 1.0}
    _post(api, path, drawn)
    _post(api, path, drawn)
    assert llm_requests(server) == before + 6  # sampling without a seed: every request is a new draw
    assert other_seed[0] == hotter[0] == 200
    _post(api, path, greedy, {"Cache-Control": "no-cache"})
    assert llm_requests(server) == before + 7  # the client opted out

    whole = {"text_input": "MENENIUS:\nWhat work", "max_new_tokens": 8}
    one = _post(api, "/v2/models/dstool_lm_llm/generate", whole)
    assert one == _post(api, "/v2/models/dstool_lm_llm/generate", whole) and one[0] == 200
    assert llm_requests(server) == before + 8
    assert json.loads(one[2])["text_output"] == "".join(json.loads(e[len(b"data: "):])["text_output"]
                                                        for e in events)


def test_openai_answers_from_the_cache_equal_fresh_ones(api, server):
    client = _client(api)
    messages = [{"role": "user", "content": "Speak of the king."}]
    before = llm_requests(server)

    def streamed():
        chunks = list(client.chat.completions.create(model="dstool_lm", messages=messages, max_tokens=9,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content], \
            chunks[-1].usage

    fresh, cached = streamed(), streamed()
    assert fresh == cached and len(fresh[0]) > 1  # a cached answer still arrives piece by piece
    whole = client.chat.completions.create(model="dstool_lm", messages=messages, max_tokens=9, temperature=0)
    assert whole.choices[0].message.content == "".join(fresh[0]) and whole.usage == fresh[1]
    assert llm_requests(server) == before + 1
    seeded = [client.completions.create(model="dstool_lm", prompt="KING:", max_tokens=6, seed=5, n=2)
              for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert llm_requests(server) == before + 3  # n=2: two seeds, each computed once
    client.completions.create(model="dstool_lm", prompt="KING:", max_tokens=6)  # temperature 1, no seed
    client.completions.create(model="dstool_lm", prompt="KING:", max_tokens=6)
    assert llm_requests(server) == before + 5


def test_logprobs_are_the_models_own(api, trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "ROMEO:\nBut soft"
    text, _, ids = _greedy(trained, prompt, 6)
    tokenizer = AutoTokenizer.from_pretrained(trained)
    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(trained).eval()(
            torch.cat([prompt_ids, torch.tensor([ids])], 1)).logits[0, prompt_ids.shape[1] - 1:-1]
    expected = torch.log_softmax(logits.double(), -1)
    answer = _client(api).completions.create(model="dstool_lm", prompt=prompt, max_tokens=6, temperature=0,
                                             logprobs=3)
    lp = answer.choices[0].logprobs
    assert "".join(lp.tokens) == text == answer.choices[0].text and len(lp.tokens) == len(ids)
    assert lp.token_logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for i, top in enumerate(lp.top_logprobs):  # greedy: the token is the most likely one
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert sorted(top.values(), reverse=True) == pytest.approx(
            torch.topk(expected[i], 3).values.tolist(), abs=1e-4)

    chunks = list(_client(api).chat.completions.create(
        model="dstool_lm", messages=[{"role": "user", "content": "Speak."}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, stream=True))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    pieces = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(content) == 5 and "".join(e.token for e in content) == pieces
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
               and e.bytes == list(e.token.encode()) for e in content)


@pytest.mark.slow
def test_a_stream_interval_groups_tokens_and_changes_nothing_else(repo, tmp_path):
    """NAME_llm exported with a stream interval of 3: the first token comes alone, then three a response (the last
    what is left); the ids, text, log-probabilities and usage are those of the same request unstreamed."""
    import shutil

    import numpy as np
    import tritonclient.grpc as grpcclient
    from google.protobuf import text_format

    from dstool.proc import free_port
    from dstool.serve.export.repository import read_config
    from dstool.serve.runtime import triton

    copy = tmp_path / "repo"
    shutil.copytree(repo / "dstool_lm_llm", copy / "dstool_lm_llm")  # the model it checks, which needs no other
    config = copy / "dstool_lm_llm" / "config.pbtxt"
    cfg = read_config(config)
    assert cfg.parameters["stream_interval"].string_value == "1"  # the default
    cfg.parameters["stream_interval"].string_value = "3"
    config.write_text(text_format.MessageToString(cfg))
    srv = triton.start(copy, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       tmp_path / "triton.log")
    gw = GatewayProcess(tmp_path / "gateway.log", config={"upstreams": [srv.http_url],
                                                          "upstreams_grpc": [srv.grpc_url], "cache": "memory"})
    try:
        events = []
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        client.start_stream(callback=lambda result, error: events.append((result, error)))
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_new_tokens", [1],
                                                                                            "INT32"),
                  grpcclient.InferInput("stream", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([b"ROMEO:\nBut soft"], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([11], np.int32))
        inputs[2].set_data_from_numpy(np.array([True]))
        client.async_stream_infer("dstool_lm_llm", inputs, parameters={"ignore_eos": True, "logprobs": 1})
        client.stop_stream()  # waits for the final response
        client.close()
        assert all(e is None for _, e in events), events
        ids = [r.as_numpy("output_ids").reshape(-1).tolist() for r, _ in events if r.as_numpy("output_ids") is not None]
        assert [len(i) for i in ids] == [1, 3, 3, 3, 1]
        assert all(len(r.as_numpy("logprobs").reshape(-1)) == len(i) for (r, _), i in zip(events, ids))
        text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r, _ in events)
        status, body = _triton_post(srv.http_url, "/v2/models/dstool_lm_llm/generate",
                             {"text_input": "ROMEO:\nBut soft", "max_new_tokens": 11, "ignore_eos": True})
        assert status == 200, body
        assert text == json.loads(body)["text_output"] and sum(ids, []) == json.loads(body)["output_ids"]

        streamed = list(_client(gw, "none").completions.create(
            model="dstool_lm", prompt="ROMEO:\nBut soft", max_tokens=11, temperature=0, stream=True, logprobs=1,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"Cache-Control": "no-cache"}))
        plain = _client(gw, "none").completions.create(
            model="dstool_lm", prompt="ROMEO:\nBut soft", max_tokens=11, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True}, extra_headers={"Cache-Control": "no-cache"})
        rows = [c.choices[0] for c in streamed if c.choices]
        assert "".join(r.text for r in rows) == plain.choices[0].text == text
        assert sum(len(r.logprobs.tokens) for r in rows if r.logprobs) == 11 == len(plain.choices[0].logprobs.tokens)
        assert streamed[-1].usage.completion_tokens == plain.usage.completion_tokens == 11
        assert len([r for r in rows if r.text]) <= 5  # grouped: five responses at most, not eleven
    finally:
        gw.stop()
        srv.stop()


def _triton_post(address: str, path: str, body: dict) -> tuple[int, bytes]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    answer = conn.getresponse()
    return answer.status, answer.read()
