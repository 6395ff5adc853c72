"""HTTP/1.1 pipelining on the gateway's own server (issue 40): answers go out in request order, and a request refused
(401, 408, 414, 431) is answered in its turn, after every answer before it, and never answers another request — the
real gateway in front of a real Triton, raw sockets."""

from __future__ import annotations

import json
import socket
import time

import pytest

from gatewaylib import GatewayProcess

PAIR = "/v2/models/echo_fp32/infer"
BUFFERED = 1 << 20  # the gateway's --max-buffered-bytes in these tests


def _post(value: float, path: str = PAIR, token: str = "s3cret", extra: bytes = b"", delay_ms: int = 0,
          size: int = 1) -> bytes:
    doc: dict = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [size], "data": [value] * size}]}
    if delay_ms:
        doc["parameters"] = {"delay_ms": delay_ms}
    body = json.dumps(doc).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Cache-Control: no-cache\r\nContent-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def _answers(port: int, *packets: bytes, pause: float = 0.3, timeout: float = 20) -> list[tuple[int, bytes]]:
    """Send `packets` (`pause` seconds apart), then (status, body) of each answer the gateway writes, in order, until
    it closes the connection (a chunked body is joined)."""
    s = socket.create_connection(("127.0.0.1", port))
    for i, packet in enumerate(packets):
        if i:
            time.sleep(pause)
        s.sendall(packet)
    s.settimeout(timeout)
    raw = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        raw += chunk
    s.close()
    out = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
        if b"content-length" in fields:
            length = int(fields[b"content-length"])
            body, raw = raw[:length], raw[length:]
        else:  # chunked
            body = b""
            while True:
                size, _, raw = raw.partition(b"\r\n")
                body, raw = body + raw[:int(size, 16)], raw[int(size, 16) + 2:]
                if size == b"0":
                    break
        out.append((int(lines[0].split(b" ", 2)[1]), body))
    return out


@pytest.fixture(scope="module")
def guarded(gateway_server, redis_server, session_tmp):
    token = session_tmp / "pipelining.token"
    token.write_text("s3cret")
    gw = GatewayProcess(session_tmp / "gateway-pipelining.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": redis_server.url, "token_file": str(token), "body_timeout": 1.0,
                                "max_buffered_bytes": BUFFERED})
    yield gw
    gw.stop()


def _value(body: bytes) -> float:
    return json.loads(body)["outputs"][0]["data"][0]


def test_pipelined_answers_keep_their_order(guarded):
    requests = [_post(0.0, delay_ms=300), *(_post(float(i)) for i in range(1, 7)),
                _post(7.0, extra=b"Connection: close\r\n")]
    answers = _answers(guarded.http_port, b"".join(requests))
    assert [(s, _value(b)) for s, b in answers] == [(200, float(i)) for i in range(8)]


REFUSED = [(_post(1.0, token="wrong"), 401), (_post(1.0, path="/v2/" + "x" * 9000), 414),
           (_post(1.0, extra=b"X-Big: " + b"y" * 9000 + b"\r\n"), 431)]


@pytest.mark.parametrize("refused, status", REFUSED)
def test_a_refused_request_is_answered_in_its_turn(guarded, refused, status):
    """(valid, refused): the valid one's own answer, then the refusal, then the close, whether both come in one
    packet or the refusal while the valid one is still computed. (refused, valid): the refusal alone — the valid
    request after it is not read, so nobody takes its answer for the refusal's."""
    after = _answers(guarded.http_port, _post(7.0) + refused)
    assert [s for s, _ in after] == [200, status] and _value(after[0][1]) == 7.0, after
    later = _answers(guarded.http_port, _post(3.0, delay_ms=1000), refused + _post(4.0))
    assert [s for s, _ in later] == [200, status] and _value(later[0][1]) == 3.0, later
    before = _answers(guarded.http_port, refused + _post(8.0))
    assert [s for s, _ in before] == [status], before
    three = _answers(guarded.http_port, _post(5.0) + _post(6.0) + refused + _post(9.0))
    assert [s for s, _ in three] == [200, 200, status] and [_value(b) for _, b in three[:2]] == [5.0, 6.0], three


def test_a_refusal_waits_for_a_streamed_answer(guarded):
    body = json.dumps({"text_input": "hi", "count": 3, "parameters": {"delay_ms": 300}}).encode()
    stream = (b"POST /v2/models/stream/generate_stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    answers = _answers(guarded.http_port, stream, REFUSED[0][0])
    assert [s for s, _ in answers] == [200, 401] and answers[0][1].count(b"data: ") == 3, answers


def test_a_body_timed_out_behind_an_answer_waits_for_it(guarded):
    """A request whose body stops coming (408 after --body-timeout, 1 s) while the one before it is computed: that
    answer first, then the 408 — not a close that loses it."""
    partial = _post(9.0).replace(b"Content-Length: ", b"Content-Length: 1")[:-20]  # a body that stops short
    answers = _answers(guarded.http_port, _post(2.0, delay_ms=2500) + partial)
    assert [s for s, _ in answers] == [200, 408] and _value(answers[0][1]) == 2.0, answers


def test_what_follows_a_waiting_refusal_is_dropped(guarded):
    """Megabytes sent after a refusal that waits for an earlier answer are read and dropped, not a reason to close
    before that answer is written."""
    answers = _answers(guarded.http_port, _post(6.0, delay_ms=1500) + REFUSED[0][0] + b"x" * (12 << 20))
    assert [s for s, _ in answers] == [200, 401] and _value(answers[0][1]) == 6.0, answers


def test_pipelined_bodies_give_back_what_they_hold(guarded):
    """Each pipelined body's share of --max-buffered-bytes is given back once it is answered: many rounds of bodies
    of over a quarter of it each are all answered (a request begun while the one before it was computed took that
    one's share with it: the gateway refused every body with 503 from the third round on)."""
    pair = _post(1.0, size=60_000) + _post(2.0, size=60_000)
    assert BUFFERED // 4 < len(pair) // 2 < BUFFERED // 2
    for _ in range(8):
        answers = _answers(guarded.http_port, pair + _post(3.0, token="wrong"))
        assert [(s, _value(b) if s == 200 else None) for s, b in answers] == [(200, 1.0), (200, 2.0), (401, None)]


def test_a_streamed_answer_to_connection_close_ends_with_its_last_chunk(guarded):
    """A client that sends `Connection: close` (Python's urllib does) reads a streamed answer whole: its terminating
    chunk is written before the close (it was not, so the client saw a broken stream)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", guarded.http_port, timeout=30)
    conn.request("POST", "/v2/models/stream/generate_stream", json.dumps({"text_input": "a b c", "count": 3}),
                 {"Authorization": "Bearer s3cret", "Connection": "close", "Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()  # http.client raises IncompleteRead on a chunked body cut short
    conn.close()
    assert r.status == 200 and r.getheader("Connection") == "close" and body.count(b"data: ") == 3, body
