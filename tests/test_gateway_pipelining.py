"""HTTP/1.1 pipelining on the gateway's own server (issue 40): answers go out in request order, and a request refused
at its head (401, 414, 431) is answered in its turn and never answers another request — the real gateway in front of
a real Triton, raw sockets."""

from __future__ import annotations

import json
import socket
import time

import pytest

from gatewaylib import GatewayProcess

PAIR = "/v2/models/echo_fp32/infer"


def _post(value: float, path: str = PAIR, token: str = "s3cret", extra: bytes = b"") -> bytes:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [value]}]}).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Cache-Control: no-cache\r\nContent-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def _answers(port: int, data: bytes, timeout: float = 20) -> list[tuple[int, bytes]]:
    """(status, body) of each answer the gateway writes, in order, until it closes the connection."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(data)
    s.settimeout(timeout)
    raw = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        raw += chunk
    s.close()
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length"))
        out.append((status, rest[:length]))
        raw = rest[length:]
    return out


@pytest.fixture(scope="module")
def guarded(gateway_server, redis_server, session_tmp):
    token = session_tmp / "pipelining.token"
    token.write_text("s3cret")
    gw = GatewayProcess(session_tmp / "gateway-pipelining.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": redis_server.url, "token_file": str(token)})
    yield gw
    gw.stop()


def _value(body: bytes) -> float:
    return json.loads(body)["outputs"][0]["data"][0]


def test_pipelined_answers_keep_their_order(guarded):
    answers = _answers(guarded.http_port, b"".join(_post(float(i)) for i in range(8)), timeout=5)
    assert [(s, _value(b)) for s, b in answers] == [(200, float(i)) for i in range(8)]


@pytest.mark.parametrize("refused, status", [
    (_post(1.0, token="wrong"), 401),
    (_post(1.0, path="/v2/" + "x" * 9000), 414),
    (_post(1.0, extra=b"X-Big: " + b"y" * 9000 + b"\r\n"), 431),
])
def test_a_refused_request_is_answered_in_its_turn(guarded, refused, status):
    """(valid, refused): the valid one's own answer, then the refusal, then the close. (refused, valid): the refusal
    alone — the valid request after it is not read, so nobody takes its answer for the refusal's."""
    after = _answers(guarded.http_port, _post(7.0) + refused)
    assert [s for s, _ in after] == [200, status] and _value(after[0][1]) == 7.0, after
    before = _answers(guarded.http_port, refused + _post(8.0))
    assert [s for s, _ in before] == [status], before
    three = _answers(guarded.http_port, _post(5.0) + _post(6.0) + refused + _post(9.0))
    assert [s for s, _ in three] == [200, 200, status] and [_value(b) for _, b in three[:2]] == [5.0, 6.0], three
