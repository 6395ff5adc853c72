"""The eight classes of attack on the LLM surface (issue 23), each on the real Triton + gateway + Redis: sampling
values that used to kill the engine, request smuggling through a model name, random answers and errors in the
cache, work for clients that are gone, memory held for slow readers, work before limits, client mistakes answered
as 5xx or wrapped silently, and parameters that change the answer but were ignored."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

from gatewaylib import eventually
from llmlib import (
    cancelled,
    error_of,
    executions,
    generated,
    metric,
    post,
    raw_request,
    sequences_left,
    settled_generated,
    sse_events,
    stub_process,
    timed_chat,
)

CHAT = "/v1/chat/completions"
LLM = "/v2/models/dstool_lm_llm"
GEN = "/v2/models/dstool_lm_generate"


@pytest.fixture(scope="module")
def stack(llm_gateway):
    return llm_gateway


def _chat(content: str = "hi", **fields) -> dict:
    return {"model": "dstool_lm", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def _serves_as_before(stack, server) -> None:
    """The engine was left as it was: nothing of the work before is left in it (a sequence left running would slow
    every request after it, however fast the machine), and a chat is answered (within a net against a hang, not a
    measure of speed: a loaded machine takes what it takes)."""
    assert sequences_left(server) == 0, "sequences were left in the engine"
    assert timed_chat(stack.http_port) < 60


def _long_stream(port: int, out: dict) -> threading.Thread:
    """A 600-token stream through the gateway, in the background: out["events"] and out["status"] at its end."""
    def run():
        status, _, body = post(port, LLM + "/generate_stream",
                               {"text_input": "ROMEO:", "max_new_tokens": 600, "ignore_eos": True, "stream": True},
                               {"Cache-Control": "no-cache"})
        out["status"], out["events"] = status, sse_events(body)

    t = threading.Thread(target=run)
    t.start()
    return t


# ---- 1. one request cannot stop the engine -----------------------------------------------------------------------
EXTREME_SAMPLING = [
    ("chat", {"temperature": 5e-324}), ("chat", {"temperature": 1e-300, "top_p": 5e-324}),
    ("chat", {"temperature": 100, "top_k": 1}), ("chat", {"temperature": 1e-30, "min_p": 1.0}),
    ("chat", {"temperature": 2, "presence_penalty": 2, "frequency_penalty": 2, "seed": 3}),
    ("chat", {"temperature": 1e-300, "repetition_penalty": 100, "seed": 1}),
    ("llm", {"temperature": 1, "repetition_penalty": 1e-300, "seed": 1}),
    ("llm", {"parameters": {"temperature": 1, "repetition_penalty": 1e-300, "seed": 2}}),
    ("llm", {"temperature": 5e-324, "seed": 9}), ("llm", {"temperature": 1e-320, "top_k": 1, "seed": 9}),
    ("generate", {"temperature": 5e-324, "seed": 4}), ("generate", {"repetition_penalty": 1e-300, "seed": 4}),
]


def test_sampling_at_the_edges_never_stops_the_engine(stack, server):
    """Every accepted extreme value samples a real token (or is refused), the stream running beside them ends
    whole, and the engine serves afterwards at once."""
    beside: dict = {}
    t = _long_stream(stack.http_port, beside)
    in_engine = eventually(lambda: metric(server, "dstool_llm_sequences"), lambda n: n >= 1 or not t.is_alive(), 60)
    assert in_engine >= 1, "the stream never reached the engine"  # running beside what follows
    wrong = []
    for route, fields in EXTREME_SAMPLING * 2:
        if route == "chat":
            status, _, body = post(stack.http_port, CHAT, _chat(**fields), {"Cache-Control": "no-cache"})
            ok = status == 200 and isinstance(json.loads(body)["choices"][0]["message"]["content"], str)
        else:
            path = (LLM if route == "llm" else GEN) + "/generate"
            status, _, body = post(stack.http_port, path, {"text_input": "ROMEO:", "max_new_tokens": 8, **fields},
                                   {"Cache-Control": "no-cache"})
            ok = status == 200 and all(0 <= i < 4096 for i in np.ravel(json.loads(body)["output_ids"]))
        if not (ok or 400 <= status < 500):
            wrong.append((route, fields, status, body[:200]))
    t.join(120)
    assert not wrong, wrong
    events = beside["events"]
    assert beside["status"] == 200 and len(events) == 600 and not any("error" in e for e in events), events[-2:]
    _serves_as_before(stack, server)
    for path in ("/v2/health/ready", LLM + "/ready"):
        assert urllib.request.urlopen(f"http://{stack.http_url}{path}", timeout=10).status == 200


# ---- 2. no request smuggled through a name; a response always belongs to its request ------------------------------
def test_a_model_name_cannot_smuggle_a_request(stack, server):
    inner = json.dumps({"text_input": "KING:", "max_new_tokens": 600, "ignore_eos": True})
    smuggled = (f"dstool_lm_llm/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(inner)}\r\n\r\n{inner}"
                f"POST /v2/models/dstool_lm")
    innocent = {"text_input": "JULIET:\nO Romeo", "max_new_tokens": 6}
    truth = post(server.http_port, LLM + "/generate", innocent)[2]
    before = executions(server, "dstool_lm_llm")
    for name in (smuggled, "dstool_lm\r\nX-Evil: 1", "dstool lm", "dstool_lm?x=1", "dstool_lm#x", "../dstool_lm",
                 "dstool_lm%2Fx", "dstool_lm/versions/1", "\x00", "x" * 300):
        status, _, body = post(stack.http_port, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 600,
                                                                    "temperature": 0})
        assert 400 <= status < 500, (name, status, body)
        answers = [json.loads(post(stack.http_port, LLM + "/generate", innocent)[2]) for _ in range(3)]
        assert all(a["text_output"] == json.loads(truth)["text_output"] for a in answers), (name, answers)
    # once the engine has stopped generating (a smuggled 600-token request is counted when it ends, not before), a
    # count read again for 2 s in case one more comes: the innocent request once (then cached); no smuggled one
    settled_generated(server)
    assert executions(server, "dstool_lm_llm", before + 2) <= before + 1


# ---- 3. only deterministic answers are cached; errors never -------------------------------------------------------
@pytest.mark.parametrize("model", ["dstool_lm_llm", "dstool_lm_generate"])
def test_random_draws_and_errors_are_never_cached(stack, server, model):
    path = f"/v2/models/{model}/generate"
    for fields in ({"parameters": {"temperature": 1.0}}, {"parameters": {"top_p": 0.9}},
                   {"top_k": 5}, {"parameters": {"min_p": 0.1, "temperature": 0.7}}):
        body = {"text_input": f"BRUTUS {time.time_ns()}:", "max_new_tokens": 4, **fields}
        before = executions(server, model)
        assert post(stack.http_port, path, body)[0] == 200 and post(stack.http_port, path, body)[0] == 200
        assert executions(server, model, before + 2) == before + 2, fields  # a new draw each time
    seeded = {"text_input": f"BRUTUS {time.time_ns()}:", "max_new_tokens": 4,
              "parameters": {"temperature": 1.0, "seed": 3}}
    before = executions(server, model)
    assert post(stack.http_port, path, seeded)[2] == post(stack.http_port, path, seeded)[2]
    assert executions(server, model, before + 2) == before + 1  # a seeded draw is a function of the request: cached

    if model == "dstool_lm_llm":  # `stream` on generate: Triton answers 200 with an error body
        erring = {"text_input": f"CASCA {time.time_ns()}:", "max_new_tokens": 4, "stream": True}
        first, second = post(stack.http_port, path, erring), post(stack.http_port, path, erring)
        assert "error" in json.loads(first[2]) and "error" in json.loads(second[2])
        before = executions(server, model)
        post(stack.http_port, path, erring)
        assert executions(server, model, before + 1) == before + 1  # the error was not kept


# ---- 4. a client that hangs up costs no more work -------------------------------------------------------------------
def test_a_client_that_hangs_up_costs_no_more_work(stack, server):
    settled_generated(server)
    before = cancelled(server)
    s = raw_request(stack.http_port, CHAT, _chat(max_tokens=900, n=16, ignore_eos=True, temperature=0))
    deadline = time.monotonic() + 30
    while metric(server, "dstool_llm_sequences") < 16:  # every choice in the engine: each must be cancelled there
        assert time.monotonic() < deadline, "the chat's 16 choices never all reached the engine"
        time.sleep(0.02)
    s.close()
    # each choice is counted as it leaves the engine, cancelled: waited for, not read once the engine looks quiet (a
    # loaded machine stalls it for longer than any quiet spell); a choice that went on is never counted
    stopped = eventually(lambda: cancelled(server) - before, lambda n: n >= 16)
    settled_generated(server)
    assert stopped == 16, f"the unstreamed chat's choices went on after its client left ({stopped} of 16 cancelled)"
    _serves_as_before(stack, server)

    # Clients that hang up 1-3 ms after sending, while the gateway is still in the cache lookup or just sending on
    # to Triton: none of their requests may run on (a cancellation lost there made all 900 tokens a choice, 1 try in
    # 15). Each try must stop short of its end; how soon is load-dependent (under -n auto one ran on 427 tokens before
    # the engine saw the cancel), so only the median is bounded, and by half the 900 tokens, not by a latency: the
    # engine and the cancel share the cores, so a loaded machine slows both.
    ran_on, made_per_try = [], []
    for i in range(18):
        settled_generated(server, quiet=0.3)
        at_send = generated(server)
        if i % 2:
            s = raw_request(stack.http_port, CHAT, _chat(f"gone {i}", max_tokens=900, n=4, ignore_eos=True,
                                                         temperature=0))
        else:
            s = raw_request(stack.http_port, LLM + "/generate_stream",
                            {"text_input": f"GONE {i}:", "max_new_tokens": 900, "ignore_eos": True, "stream": True})
        time.sleep(0.001 * (1 + i % 3))
        s.close()
        made = settled_generated(server, quiet=0.3) - at_send
        made_per_try.append(made / (4 if i % 2 else 1))
        if made >= 900 * (4 if i % 2 else 1):  # ran to its end: the cancellation was lost
            ran_on.append((i, made))
    assert not ran_on, ran_on
    assert statistics.median(made_per_try) < 450, made_per_try

    # Streams closed after their first chunk, on every route that streams: each choice is cancelled in the engine
    # (a missed cancellation runs on to 900 tokens a choice and is not counted), and what the engine makes after the
    # close is counted. Noticed late (the gateway waits for a core while ONNX Runtime's threads spin: up to ~0.15 s
    # here, docs/export-serve.md) it makes tens, under the suite's load hundreds; the median share of what a choice
    # had left is bounded (below half), not each try and not a token count, so that whatever else the machine runs
    # does not fail the suite. A try whose choices had all ended before the client closed (on a loaded machine the
    # first chunk can reach the client after the engine made all 900 tokens) had nothing to cancel: it shows nothing
    # and is left out; most tries must have had something to cancel.
    spent_per_choice, missed, ended = [], [], []
    for i in range(24):
        at_start = settled_generated(server, quiet=0.3)
        before = cancelled(server)
        route, n = i % 3, 4 if i % 3 == 1 else 1
        if route == 0:
            s = raw_request(stack.http_port, LLM + "/generate_stream",
                            {"text_input": f"HAMLET {i}:", "max_new_tokens": 900, "ignore_eos": True, "stream": True})
        elif route == 1:
            s = raw_request(stack.http_port, CHAT, _chat(f"x{i}", max_tokens=900, ignore_eos=True, stream=True, n=n,
                                                         temperature=0))
        else:
            s = raw_request(stack.http_port, "/v1/completions",
                            {"model": "dstool_lm", "prompt": f"x{i}", "max_tokens": 900, "ignore_eos": True,
                             "stream": True, "temperature": 0})
        s.recv(200)
        at_close = generated(server)
        s.close()
        if at_close - at_start >= 900 * n:  # every choice had ended before the close
            ended.append(i)
            continue
        stopped = eventually(lambda before=before, n=n: cancelled(server) - before,  # (as above: waited for)
                             lambda got, n=n: got >= n)
        spent = settled_generated(server, quiet=0.3) - at_close
        spent_per_choice.append(spent / (900 * n - (at_close - at_start)))
        if stopped != n:  # (tokens made before the close and after it: a choice that ran on makes up to 900)
            missed.append((i, route, stopped, at_close - at_start, spent))
    assert not missed, missed
    assert len(ended) <= 12, f"tries {ended} had ended before their client closed: too few showed a cancellation"
    assert statistics.median(spent_per_choice) < 0.5, spent_per_choice


def test_a_grpc_stream_cancelled_through_the_gateway_stops(stack, server):
    import tritonclient.grpc as grpcclient

    spent, missed, ended = [], [], []
    for i in range(8):  # each is cancelled in the engine; its share of what it had left made after the cancel is
        # bounded (as for HTTP)
        at_start = settled_generated(server, quiet=0.3)
        before = cancelled(server)
        client = grpcclient.InferenceServerClient(stack.grpc_url)
        got = threading.Event()
        client.start_stream(callback=lambda result, error, got=got: got.set())
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([f"OTHELLO {i}:".encode()], dtype=np.object_))
        n = grpcclient.InferInput("max_new_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([900], np.int32))
        flag = grpcclient.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        client.async_stream_infer("dstool_lm_llm", [text, n, flag], parameters={"ignore_eos": True})
        assert got.wait(30)
        at_cancel = generated(server)
        client.stop_stream(cancel_requests=True)
        client.close()
        if at_cancel - at_start >= 900:  # it had ended before its cancel (as for HTTP: left out)
            ended.append(i)
            continue
        stopped = eventually(lambda before=before: cancelled(server) - before, lambda got: got >= 1)  # waited for
        spent.append((settled_generated(server, quiet=0.3) - at_cancel) / (900 - (at_cancel - at_start)))
        if stopped != 1:
            missed.append((i, stopped))
    assert not missed, missed
    assert len(ended) <= 4, f"tries {ended} had ended before their cancel: too few showed a cancellation"
    assert statistics.median(spent) < 0.5, spent


# ---- 5. a slow reader holds bounded memory ------------------------------------------------------------------------
def test_slow_readers_hold_bounded_memory(stack, server):
    """What the gateway holds for a stream it cannot deliver: bounded by its read-ahead and event queue, not by how
    fast the engine makes tokens. Uncached here: a cacheable stream also keeps what it relayed, for its cache entry
    (bounded by --max-entry-bytes a request), which grows with the engine's speed until the client's socket fills."""
    gateway = psutil.Process(stack.proc.pid)
    timed_chat(stack.http_port)
    baseline = gateway.memory_info().rss
    readers = []
    for i in range(4):
        body = _chat(f"slow {i}", stream=True, n=16, logprobs=True, top_logprobs=20, max_tokens=500, temperature=0,
                     ignore_eos=True)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", stack.http_port))
        data = json.dumps(body).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        readers.append(s)
    peak = baseline
    for _ in range(20):  # 10 s of reading 1 byte a second
        time.sleep(0.5)
        for s in readers:
            s.setblocking(False)
            try:
                s.recv(1)
            except BlockingIOError:
                pass
        peak = max(peak, gateway.memory_info().rss)
    assert peak - baseline < 24 << 20, f"the gateway grew by {(peak - baseline) >> 20} MB for four slow readers"
    for s in readers:
        s.close()
    settled_generated(server)
    grown = eventually(lambda: gateway.memory_info().rss - baseline, lambda grown: grown < 16 << 20)  # given back
    assert grown < 16 << 20, f"the gateway still holds {grown >> 20} MB more after the readers left"  # (in its time)
    _serves_as_before(stack, server)


# ---- 6. limits before work --------------------------------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_it_is_tokenized(stack, server):
    llm = stub_process(server, "dstool_lm_llm")
    rss = llm.memory_info().rss
    huge = "To be or not to be. " * ((8 << 20) // 20)
    result: dict = {}

    def send(port, path, body):
        started = time.monotonic()
        result[path, port] = (post(port, path, body), time.monotonic() - started)

    senders = [threading.Thread(target=send, args=(stack.http_port, "/v1/completions",
                                                   {"model": "dstool_lm", "prompt": huge, "max_tokens": 4})),
               threading.Thread(target=send, args=(server.http_port, LLM + "/generate",
                                                   {"text_input": huge, "max_new_tokens": 4}))]
    for t in senders:
        t.start()
    time.sleep(0.2)
    beside = timed_chat(stack.http_port)
    for t in senders:
        t.join(60)
    # refused by its size, unread (what the message says: the gateway's body limit at its Content-Length, NAME_llm's
    # byte check before any tokenizing), not by what tokenizing it found; the time is a net against a hang, not a
    # measure of speed
    refusal = {"/v1/completions": "request body exceeds the gateway's limit", LLM + "/generate": "positions can hold"}
    for (path, _), ((status, _, body), seconds) in result.items():
        assert 400 <= status < 500 and refusal[path] in error_of(body) and seconds < 60, \
            (path, status, error_of(body)[:200], seconds)
    assert beside < 60, f"a chat beside the huge prompts took {beside:.2f} s"  # answered, not held up for good
    assert llm.memory_info().rss - rss < 64 << 20  # nothing of the 8 MB prompts was made into tokens


# ---- 7. every client mistake is a 4xx naming the field ----------------------------------------------------------
MISTAKES = [
    ("/v1/completions", {"model": "dstool_lm", "prompt": "x", "max_tokens": 4294967300}, "max_tokens"),
    ("/v1/completions", {"model": "dstool_lm", "prompt": "x", "max_tokens": 2**63}, "max_tokens"),
    ("/v1/completions", {"model": "dstool_lm", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (CHAT, _chat(stream=True, stream_options="x"), "stream_options"),
    (CHAT, json.dumps(_chat()).encode()[:-1] + b', "top_p": ' + b"[" * 1000 + b"]" * 1000 + b"}", "top_p"),
    (CHAT, _chat(temperature="hot"), "temperature"),
    (CHAT, _chat(seed=-1), "seed"),
    (CHAT, _chat(n=True), "n"),
    (CHAT, _chat(stop={"a": 1}), "stop"),
    (LLM + "/generate_stream", {"text_input": "x", "max_new_tokens": "abc"}, "max_new_tokens"),
    (LLM + "/generate_stream", {"text_input": "x", "max_new_tokens": 4.7}, "max_new_tokens"),
    (LLM + "/generate_stream", {"text_input": "x", "max_new_tokens": 4294967300}, "max_new_tokens"),
    (LLM + "/generate", {"text_input": "x", "stop_token_ids": "13"}, "stop_token_ids"),
    (LLM + "/generate_stream", {"text_input": "x", "stream": "yes"}, "stream"),
    (LLM + "/generate", {"text_input": 5}, "text_input"),
    (GEN + "/generate", {"text_input": "x", "max_new_tokens": 2**40}, "max_new_tokens"),
    (LLM + "/generate_stream", b"not json", "JSON"),
    (LLM + "/generate", b"[1, 2]", "JSON object"),
    (GEN + "/generate", b"[]", "JSON object"),
]


@pytest.mark.parametrize("path, body, field", MISTAKES, ids=[f"{p.rsplit('/', 1)[1]}-{f}-{i}" for i, (p, _, f)
                                                             in enumerate(MISTAKES)])
def test_client_mistakes_are_4xx_naming_the_field(stack, path, body, field):
    status, _, answer = post(stack.http_port, path, body)
    assert 400 <= status < 500 and field in error_of(answer), (status, answer[:300])


def test_a_seed_near_the_top_of_its_range_serves_every_choice(stack):
    status, _, body = post(stack.http_port, "/v1/completions",
                           {"model": "dstool_lm", "prompt": "x", "max_tokens": 3, "n": 2, "seed": 2**63 - 1})
    assert status == 200 and len(json.loads(body)["choices"]) == 2, body


# ---- 8. a parameter that changes the answer is served or refused, never ignored -----------------------------------
REFUSED = [
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}),
     "response_format"),
    (_chat(response_format="nonsense"), "response_format"),
    (_chat(tool_choice="auto"), "tool_choice"),
    (_chat(modalities=["text", "audio"]), "modalities"),
    (_chat(logit_bias={"99999999": 100}), "logit_bias"),  # served, but not for an id outside the vocabulary
    (_chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (_chat(no_such_field=1), "no_such_field"),
    ({**_chat(), "messages": [{"role": "user", "content": "hi", "weight": 2}]}, "weight"),
    ({**_chat(), "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content"),
]


@pytest.mark.parametrize("body, field", REFUSED, ids=[f for _, f in REFUSED])
def test_parameters_not_served_are_refused_by_name(stack, body, field):
    status, _, answer = post(stack.http_port, CHAT, body)
    assert status == 400 and field in error_of(answer), answer


def test_a_message_name_is_served(stack):
    """Without a chat template a message's name is its speaker's label, as the corpus lays out a play."""
    named = {**_chat(temperature=0), "messages": [{"role": "user", "name": "ROMEO", "content": "Juliet!"}]}
    plain = {**_chat(temperature=0), "messages": [{"role": "user", "content": "Juliet!"}]}
    a, b = post(stack.http_port, CHAT, named), post(stack.http_port, CHAT, plain)
    assert a[0] == b[0] == 200
    usage = json.loads(a[2])["usage"]["prompt_tokens"], json.loads(b[2])["usage"]["prompt_tokens"]
    assert usage[0] != usage[1], usage  # "ROMEO:" is not "USER:"
