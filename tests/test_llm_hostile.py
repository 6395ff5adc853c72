"""Hostile and careless requests on the LLM routes — the OpenAI API, Triton's generate extension on NAME_llm and
NAME_generate, and gRPC stream and unary calls to NAME_llm — several hundred kinds, through the gateway on the real
Triton and Redis: each answer is a 4xx naming the problem or a well-formed result, never a 5xx or a hang; memory
stays bounded; and afterwards the engine serves a normal chat at its normal latency."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import psutil
import pytest

from llmlib import cpu_seconds, error_of, post, sequences_left, settled_generated, sse_events, stub_process, timed_chat

VOCAB = 4096
ODD = [None, True, False, 0, -1, 1.5, 2**31, 2**63, 2**64 + 1, 1e308, 5e-324, -1e-300, "", "x", "1", [], [1],
       [[[]]], {}, {"a": 1}]
# how NAME_llm words its own faults (a client's mistake is named otherwise)
SERVER_FAULTS = ("generation failed", "could not read the request", "the engine failed", "Traceback")
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "seed"]


@pytest.fixture(scope="module")
def stack(llm_gateway):
    return llm_gateway


def _openai_kinds() -> list[tuple[str, str, dict | bytes]]:
    completion = {"model": "dstool_lm", "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
    chat = {"model": "dstool_lm", "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 3}
    kinds = []
    fields = ["model", "max_tokens", "n", "stop", "stream", "stream_options", "logprobs", "ignore_eos", "user",
              "logit_bias", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", *SAMPLING]
    for path, base, own in (("/v1/completions", completion, ["prompt", "echo", "suffix", "best_of"]),
                            ("/v1/chat/completions", chat,
                             ["messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                              "modalities", "parallel_tool_calls"])):
        for field in fields + own:
            for value in ODD:
                kinds.append((f"{path} {field}={value!r:.30}", path, {**base, field: value}))
        for message in ({"role": "user"}, {"content": "x"}, {"role": "user", "content": None},
                        {"role": "user", "content": "x", "name": 5}, {"role": "robot", "content": "x"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}, "x", [],
                        {"role": "user", "content": "\ud800" if False else "\x00\x01\x7f"}):
            kinds.append((f"message {message!r:.40}", "/v1/chat/completions",
                          {**chat, "messages": [message]}))
    for body in (b"", b"{", b"[]", b"null", b"5", b'"x"', b"{}", b'{"model": "dstool_lm"}', b"\xff\xfe",
                 b'{"model": "dstool_lm", "prompt": "x", "max_tokens": 1e400}', b"{" * 2000 + b"}" * 2000,
                 b'{"model": "dstool_lm", "prompt": "x", "temperature": NaN}'):
        kinds.append((f"body {body[:20]!r}", "/v1/completions", body))
    return kinds


def _generate_kinds() -> list[tuple[str, str, dict | bytes]]:
    kinds = []
    for model in ("dstool_lm_llm", "dstool_lm_generate"):
        for route in ("generate", "generate_stream"):
            path = f"/v2/models/{model}/{route}"
            base = {"text_input": "JULIET:", "max_new_tokens": 3}
            inputs = ["text_input", "max_new_tokens", "stop_token_ids", "stream", "id", "parameters", "input_ids"]
            for field in inputs + (SAMPLING + ["logprobs", "ignore_eos", "structured_outputs", "tools"]
                                   if route == "generate_stream" else []):
                for value in ODD:
                    kinds.append((f"{path} {field}={value!r:.30}", path, {**base, field: value}))
            if route == "generate":
                for name in SAMPLING:
                    for value in (5e-324, 1e-300, 1e308, -0.0, 2**63 - 1):
                        kinds.append((f"{path} parameters.{name}={value!r}", path,
                                      {**base, "parameters": {name: value}}))
    return kinds


def _error_shape(path: str, body: bytes) -> bool:
    """The error body the route's protocol defines: OpenAI's {"error": {"message", "type", "param", "code"}} (message
    and type strings naming something, param and code a string or null) on /v1/, KServe's {"error": "..."} else —
    on generate_stream framed as Triton frames it, one server-sent event `data: {"error": "..."}`."""
    if path.endswith("/generate_stream") and body.startswith(b"data: "):
        body = body[len(b"data: "):].rstrip(b"\n")
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    if not isinstance(answer, dict) or set(answer) != {"error"}:
        return False
    error = answer["error"]
    if path.startswith("/v1/"):
        return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error) and \
            isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str) and \
            all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))
    return isinstance(error, str) and bool(error)


def _well_formed(path: str, sent, status: int, headers: dict, body: bytes) -> bool:
    """A 4xx naming something in the protocol's error shape, or a 200 that is a result of the route's shape (token
    ids inside the vocabulary), never an error: a stream may end in one error event (the status was sent), a whole
    answer not."""
    if 400 <= status < 500:
        return _error_shape(path, body) and bool(error_of(body))
    if status != 200:
        return False
    streamed = isinstance(sent, dict) and sent.get("stream") is True
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(body)
        if path.startswith("/v1/"):
            return streamed and events[-1] == "[DONE]" and all(isinstance(e, dict) and "choices" in e
                                                               for e in events[:-1])
        return bool(events) and all(isinstance(e, dict) and "text_output" in e and "error" not in e
                                    for e in events[:-1]) and isinstance(events[-1], dict) and \
            ("text_output" in events[-1] or set(events[-1]) == {"error"} and isinstance(events[-1]["error"], str))
    answer = json.loads(body)
    if "error" in answer:
        return False
    if path.startswith("/v1/"):
        n = (sent.get("n") or 1) if isinstance(sent, dict) else 1  # null: the field left out
        return not streamed and len(answer["choices"]) == n and answer["usage"]["completion_tokens"] >= 0
    ids = np.ravel(answer["output_ids"])
    return isinstance(answer["text_output"], str) and all(0 <= i < VOCAB for i in ids)


def _grpc_cases():
    """(name, parameters, inputs as (name, numpy array, datatype)) for NAME_llm over gRPC."""
    good = [("text_input", np.array([b"KING:"], dtype=np.object_), "BYTES"),
            ("max_new_tokens", np.array([3], np.int32), "INT32")]
    cases = []
    for name in [*SAMPLING, "logprobs", "ignore_eos", "stream", "structured_outputs", "tools"]:
        for value in (True, -1, 0, 1.5, 2**62, 1e308, 5e-324, "", "x", "1e309"):
            cases.append((f"{name}={value!r}", {name: value}, good))
    odd_inputs = [
        [("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
        [("text_input", np.array([b"\xff\xfe"], dtype=np.object_), "BYTES")],
        [("text_input", np.array([b""], dtype=np.object_), "BYTES")],
        [("text_input", np.array([b"x" * 300_000], dtype=np.object_), "BYTES")],
        [*good[:1], ("max_new_tokens", np.array([-5], np.int32), "INT32")],
        [*good[:1], ("max_new_tokens", np.array([2**31 - 1], np.int32), "INT32")],
        [*good[:1], ("max_new_tokens", np.array([], np.int32), "INT32")],
        [*good, ("stop_token_ids", np.array([-1, 2**62], np.int64), "INT64")],
        [*good, ("stream", np.array([], bool), "BOOL")],
        [("messages", np.array([b'[{"role": "user"}]'], dtype=np.object_), "BYTES")],
        [("messages", np.array([b'{"a": 1}'], dtype=np.object_), "BYTES")],
        [("messages", np.array([b"[" * 5000], dtype=np.object_), "BYTES")],
        [*good, ("messages", np.array([b"[]"], dtype=np.object_), "BYTES")],
        [*good, ("input_ids", np.array([1, 2], np.int64), "INT64")],
        [("input_ids", np.array([-1], np.int64), "INT64")],
        [("input_ids", np.array([2**62], np.int64), "INT64")],
        [("input_ids", np.array([], np.int64), "INT64")],
        [("input_ids", np.zeros(100_000, np.int64), "INT64")],
        [],
    ]
    for i, inputs in enumerate(odd_inputs):
        cases.append((f"inputs {i}", {}, inputs))
    return cases


def test_hundreds_of_hostile_llm_requests(stack, server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    kinds = _openai_kinds() + _generate_kinds()
    grpc_cases = _grpc_cases()
    assert len(kinds) + 2 * len(grpc_cases) >= 200
    gateway, llm = psutil.Process(stack.proc.pid), stub_process(server, "dstool_lm_llm")
    before = statistics.median(timed_chat(stack.http_port, f"baseline {i}") for i in range(5))
    idle_before = cpu_seconds(gateway), cpu_seconds(llm)  # idle, as the suite will find them
    rss = gateway.memory_info().rss, llm.memory_info().rss
    wrong = []
    for name, path, body in kinds:
        started = time.monotonic()
        status, headers, answer = post(stack.http_port, path, body, timeout=60)
        if not _well_formed(path, body, status, headers, answer) or time.monotonic() - started > 30:
            wrong.append((name, status, answer[:200]))

    def infer_input(name, value, datatype):
        item = grpcclient.InferInput(name, list(value.shape), datatype)
        item.set_data_from_numpy(value)
        return item

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    answers: list = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    try:
        for name, parameters, inputs in grpc_cases:  # streamed (NAME_llm is decoupled)
            answers.clear()
            client.async_stream_infer("dstool_lm_llm", [infer_input(*i) for i in inputs], parameters=parameters)
            deadline = time.monotonic() + 30
            while not answers or (answers[-1][1] is None and not answers[-1][0].get_response().parameters[
                    "triton_final_response"].bool_param):
                assert time.monotonic() < deadline, f"gRPC {name}: no final answer in 30 s"
                time.sleep(0.01)
            error = next((e for _, e in answers if e is not None), None)  # a stream's errors carry no code
            if error is not None and (error.message() or "").startswith(SERVER_FAULTS):
                wrong.append((f"gRPC stream {name}", error.status(), error.message()[:200]))
            elif error is None and not all(0 <= i < VOCAB for r, _ in answers for i in r.as_numpy("output_ids")):
                wrong.append((f"gRPC stream {name}", "ids outside the vocabulary", ""))
    finally:
        client.stop_stream()
    for name, parameters, inputs in grpc_cases:  # unary: Triton refuses a decoupled model's unary call
        try:
            client.infer("dstool_lm_llm", [infer_input(*i) for i in inputs], parameters=parameters, client_timeout=30)
        except InferenceServerException as e:
            if "INTERNAL" in str(e.status()) or "UNAVAILABLE" in str(e.status()) or "DEADLINE" in str(e.status()):
                if "decoupled" not in (e.message() or ""):
                    wrong.append((f"gRPC unary {name}", e.status(), (e.message() or "")[:200]))
    client.close()
    assert not wrong, "\n".join(f"{n}: {s} {a!r}" for n, s, a in wrong)
    assert stack.proc.poll() is None
    assert gateway.memory_info().rss - rss[0] < 96 << 20 and llm.memory_info().rss - rss[1] < 160 << 20
    after = statistics.median(timed_chat(stack.http_port, f"after {i}") for i in range(5))
    # The suite left nothing behind that would slow what follows: no sequence in the engine, and neither the gateway
    # nor NAME_llm busy once idle (CPU seconds over 2 s, near 0 for an idle process however loaded the machine; a
    # task or thread left spinning takes what it is given). How fast a chat is answered after is printed, not
    # bounded: on a loaded machine it says more of the machine than of what the suite left.
    settled_generated(server)
    assert sequences_left(server) == 0, "the suite left sequences in the engine"
    idle_after = cpu_seconds(gateway), cpu_seconds(llm)
    print(f"\nhostile LLM suite: {len(kinds)} HTTP kinds + {len(grpc_cases)} gRPC cases x2, {len(wrong)} wrong; RSS "
          f"gateway {(gateway.memory_info().rss - rss[0]) / 2**20:+.1f} MB, NAME_llm "
          f"{(llm.memory_info().rss - rss[1]) / 2**20:+.1f} MB; chat {before * 1e3:.0f} ms before, "
          f"{after * 1e3:.0f} ms after; CPU s idle over 2 s (gateway, NAME_llm) {idle_before} before, {idle_after} "
          "after")
    for name, was, now in zip(("the gateway", "NAME_llm"), idle_before, idle_after):
        assert now < was + 0.5, f"{name} used {now:.2f} CPU s over 2 idle s after the suite ({was:.2f} s before)"


def test_generate_on_a_decoupled_model_asked_to_stream_is_a_4xx(stack, server):
    """`stream: true` on NAME_llm's generate route (one answer expected, the model sends several): Triton's own
    answer is a 200 whose body is only an error; the gateway answers the client's mistake as a 400 in KServe's shape."""
    path, body = "/v2/models/dstool_lm_llm/generate", {"text_input": "JULIET:", "max_new_tokens": 3, "stream": True}
    triton = post(server.http_port, path, body)
    print(f"\nTriton itself: {triton[0]} {triton[2][:200]!r}")
    status, _, answer = post(stack.http_port, path, body)
    assert status == 400 and _error_shape(path, answer) and "generate stream" in error_of(answer), (status, answer)
