"""Malformed and hostile requests, several hundred kinds on both protocols, each sent to Triton and through the
gateway: where Triton answers, the gateway answers the same; where Triton refuses, the gateway refuses with a client
error (4xx, a gRPC client-error code), never a 5xx, a hang or a dropped connection; and it serves afterwards."""

from __future__ import annotations

import copy
import http.client
import json
import socket
import zlib

import numpy as np
import psutil
import pytest

from gatewaylib import GatewayProcess, decoded_body

PAIR = "/v2/models/echo_pair/infer"
BASE = {"id": "r1",
        "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                   {"name": "INPUT1", "shape": [1], "datatype": "INT64", "data": [7]}],
        "outputs": [{"name": "INPUT0_OUT"}, {"name": "INPUT1_OUT", "parameters": {"binary_data": False}}],
        "parameters": {"binary_data_output": False}}
PATHS = [("id",), ("parameters",), ("parameters", "binary_data_output"), ("parameters", "priority"),
         ("parameters", "timeout"), ("parameters", "sequence_id"), ("inputs",), ("inputs", 0), ("inputs", 0, "name"),
         ("inputs", 0, "shape"), ("inputs", 0, "shape", 0), ("inputs", 0, "datatype"), ("inputs", 0, "data"),
         ("inputs", 0, "data", 0), ("inputs", 0, "parameters"), ("inputs", 0, "parameters", "binary_data_size"),
         ("inputs", 1, "data", 0), ("inputs", 1, "shape"), ("outputs",), ("outputs", 0), ("outputs", 0, "name"),
         ("outputs", 0, "parameters"), ("outputs", 1, "parameters", "binary_data"),
         ("outputs", 0, "parameters", "classification")]
VALUES = [None, True, False, 0, -1, 1.5, 2**63, 1e30, "", "x", "é\u0000", [], [1], [[1, 2]], {}, {"a": [1]}]
DELETED = object()
LIMIT = 1 << 20  # the gateway's --max-request-bytes in these tests


def _mutated(path: tuple, value) -> bytes:
    doc = copy.deepcopy(BASE)
    target = doc
    for step in path[:-1]:
        if isinstance(target, dict):
            target = target.setdefault(step, {})
        else:
            target = target[step]
    if value is DELETED:
        if isinstance(target, dict):
            target.pop(path[-1], None)
        else:
            del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(doc).encode()


def _binary(header: dict, payload: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + payload, {"Inference-Header-Content-Length": str(len(head))}


def _binary_kinds() -> list[tuple[str, str, str, bytes, dict]]:
    """Binary-extension requests: sizes that lie, header lengths that do not fit, dtypes whose bytes do not."""
    two = np.array([1.5, 2.5], np.float32).tobytes()
    one = np.array([7], np.int64).tobytes()
    kinds = []
    for size in (-1, 0, 1, 7, 9, 16, 2**40, "8", 8.0, None, True):
        header = {"inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32",
                              "parameters": {"binary_data_size": size}},
                             {"name": "INPUT1", "shape": [1], "datatype": "INT64", "data": [7]}]}
        kinds.append((f"binary_data_size {size!r}", "POST", PAIR, *_binary(header, two)))
    good = {"inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                       {"name": "INPUT1", "shape": [1], "datatype": "INT64", "parameters": {"binary_data_size": 8}}]}
    body, headers = _binary(good, two + one)
    for length in ("-1", "abc", "1e3", " 12", str(len(body)), str(len(body) + 1), "99999999999999999999", "",
                   str(len(body) - 16)):
        kinds.append((f"header length {length!r}", "POST", PAIR, body, {"Inference-Header-Content-Length": length}))
    for cut in (1, 8, 15):
        kinds.append((f"binary payload short by {cut}", "POST", PAIR, body[:-cut], headers))
    kinds.append(("binary payload with extra bytes", "POST", PAIR, body + b"\0" * 5, headers))
    for datatype, payload in (("BYTES", b"\x05\0\0\0ab"), ("BYTES", b"\xff\xff\xff\xff"), ("BYTES", b"\x01\0"),
                              ("BOOL", b"\x02"), ("FP16", b"\0\0\0\0"), ("BF16", b"\0\0"), ("UINT8", b"\1\2")):
        header = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": datatype,
                              "parameters": {"binary_data_size": len(payload)}}]}
        kinds.append((f"binary {datatype} {payload!r}", "POST", "/v2/models/echo_bytes/infer",
                      *_binary(header, payload)))
    return kinds


def _datatype_kinds() -> list[tuple[str, str, str, bytes, dict]]:
    kinds = []
    for datatype in ("BOOL", "UINT8", "UINT64", "INT8", "INT64", "FP16", "BF16", "FP64", "BYTES", "fp32", "", "FP32 "):
        for data in ([1], [-1], [True], ["1"], [1e39], [300]):
            body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": datatype, "data": data}]})
            kinds.append((f"{datatype!r} {data!r}", "POST", "/v2/models/echo_fp32/infer", body.encode(), {}))
    return kinds


def _route_kinds() -> list[tuple[str, str, str, bytes | None, dict]]:
    body = json.dumps(BASE).encode()
    kinds = []
    for name in ("x" * 10_000, "%C3%A9", "%00", "..", "%2e%2e%2fecho_pair", "echo_pair%2F", "echo%20pair", "%ff%fe",
                 "echo_pair/versions/1/../..", "ECHO_PAIR", "echo_pair;x"):
        kinds.append((f"model name {name[:20]!r}", "POST", f"/v2/models/{name}/infer", body, {}))
    for version in ("abc", "-1", "0", "2", "99999999999999999999", "1.5", "%31", "x" * 5000):
        kinds.append((f"version {version[:20]!r}", "POST", f"/v2/models/echo_pair/versions/{version}/infer", body, {}))
    for method in ("GET", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"):
        kinds.append((f"{method} infer", method, PAIR, body if method in ("PUT", "PATCH") else None, {}))
    for path in ("/v2/models/echo_pair/infer/", "/v2/models//infer", "/v2/models/echo_pair/infer?x=%zz",
                 "/v2/models/echo_pair/infer#frag", "/v2//health/ready", "/v2/health/ready/x", "/v2/models/stats",
                 "/v2/models/echo_pair/stats?x=1", "/v2/models/nope/stats", "/v2/repository/index",
                 "/v2/repository/models/nope/load", "/v2/repository/models/%2e%2e/load",
                 "/v2/systemsharedmemory/status", "/v2/systemsharedmemory/region/x/register",
                 "/v2/cudasharedmemory/status", "/v2/trace/setting", "/v2/logging", "/metrics/x", "/" + "a" * 7000):
        method = "POST" if "repository" in path or "register" in path else "GET"
        kinds.append((f"path {path[:40]!r}", method, path, b"{}" if method == "POST" else None, {}))
    for encoding, data in (("gzip", zlib.compress(body)), ("deflate", b"not deflate"), ("br", body),
                           ("gzip, gzip", body), ("GZIP", zlib.compressobj(wbits=31).compress(body) + b"")):
        kinds.append((f"content-encoding {encoding}", "POST", PAIR, data, {"Content-Encoding": encoding}))
    for accept in ("gzip;q=0.5, deflate;q=0.9", "*", "*;q=0", "identity;q=0", "gzip;q=abc", ", ,", "x" * 4000):
        kinds.append((f"accept-encoding {accept[:20]!r}", "POST", PAIR, body, {"Accept-Encoding": accept}))
    for ctype in ("text/plain", "application/json; charset=latin-1", "multipart/form-data; boundary=x", "\u00e9"):
        kinds.append((f"content-type {ctype!r}", "POST", PAIR, body, {"Content-Type": ctype}))
    for text in (b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"inputs": [' * 5000, b"\xef\xbb\xbf" + body, b"\xff",
                 body + b"x", body + b"   ", b'{"inputs":[],"inputs":[]}', body.replace(b'"id"', b'"i\\ud800d"'),
                 b'{"id":"\\u0000"}', b"{" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 10_000 + b"1"):
        kinds.append((f"body {text[:12]!r}...{text[-12:]!r} ({len(text)} bytes)", "POST", PAIR, text, {}))
    return kinds


def _http_kinds() -> list[tuple[str, str, str, bytes | None, dict]]:
    kinds = [(f"{'.'.join(map(str, p))} = {v!r}", "POST", PAIR, _mutated(p, v), {}) for p in PATHS for v in VALUES]
    kinds += [(f"{'.'.join(map(str, p))} deleted", "POST", PAIR, _mutated(p, DELETED), {}) for p in PATHS]
    return kinds + _binary_kinds() + _datatype_kinds() + _route_kinds()


def _send(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v.encode() if isinstance(v, str) else v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _same_error(direct: bytes, through: bytes) -> bool:
    """Triton's message, or one that says the same where Triton's words are its JSON parser's (rapidjson's and
    orjson's words for a syntax error differ), or where the gateway refuses what Triton gets wrong (a body that does
    not decompress, read as an empty one) or has a limit Triton has not (JSON nested over 1,024 levels)."""
    d, t = json.loads(direct)["error"], json.loads(through)["error"]
    syntax = "failed to parse the request JSON buffer: "
    return d == t or (d.startswith(syntax) and t.startswith(syntax)) or \
        t.startswith("request body does not decompress") or t == syntax + "nested deeper than 1024 levels"


@pytest.fixture(scope="module")
def hostile_gateway(gateway_server, redis_server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-hostile.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": redis_server.url, "max_request_bytes": LIMIT, "upstream_timeout": 20})
    yield gw
    gw.stop()


def test_hundreds_of_malformed_http_requests(hostile_gateway, gateway_server):
    kinds = _http_kinds()
    names = [k[0] for k in kinds]
    assert len(set(names)) == len(names) >= 500
    rss = psutil.Process(hostile_gateway.proc.pid).memory_info().rss
    wrong = []
    for name, method, path, body, headers in kinds:
        try:
            direct = _send(gateway_server.http_port, method, path, body, headers)
        except ConnectionError:  # Triton drops some of them (URLs over its limit) without an answer
            direct = (0, {}, b"")
        through = _send(hostile_gateway.http_port, method, path, body, headers)
        relayed = through[0] == direct[0] and through[2] == direct[2] and not path.endswith("/infer")
        # Triton closed this one without an answer (on a loaded machine it now and then drops a 5,000-byte URL it
        # answers 404 to otherwise): the gateway's 503 says so, as a proxy's 502 would
        relayed = relayed or (direct[0] == 0 and through[0] == 503
                              and through[2] == b'{"error":"Triton closed the connection"}')
        if (through[0] >= 500 and not relayed) or (direct[0] == 200) != (through[0] == 200):
            wrong.append((name, direct, through))
        elif direct[0] == 200 and decoded_body(*direct[1:]) != decoded_body(*through[1:]):
            wrong.append((name, direct, through))
        elif through[0] != 200 and not (through[0] == 405 or json.loads(through[2]).get("error")):
            wrong.append((name, direct, through))
        elif through[0] != 200 and direct[0] and not _same_error(direct[2], through[2]):
            wrong.append((name, direct, through))
    assert not wrong, "\n".join(f"{n}: Triton {d[0]} {d[2][:150]!r} / gateway {t[0]} {t[2][:150]!r}"
                                for n, d, t in wrong)
    assert hostile_gateway.proc.poll() is None
    assert psutil.Process(hostile_gateway.proc.pid).memory_info().rss - rss < 200 << 20
    status, _, body = _send(hostile_gateway.http_port, "POST", PAIR, json.dumps(BASE).encode(), {})
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]


GOOD = json.dumps(BASE).encode()


def _wire(head: bytes, body: bytes = b"") -> bytes:
    return head + b"\r\n\r\n" + body


CLOSE = "close"  # no answer: the request never ends (the client shuts its side), so there is none to give


def _raw_kinds() -> list[tuple[str, bytes, int | tuple[int, ...] | str]]:
    """Requests no well-behaved client library would send, each with what RFC 9110/9112 (and Triton, where it
    answers at all) say the server does: the status of each final answer in order (a malformed head gets a 400, or
    the 4xx/5xx that names its fault, with a KServe error body), or CLOSE: a close without any answer, only where the
    request is never complete (the client shuts its side after the part it sent)."""
    post = b"POST " + PAIR.encode() + b" HTTP/1.1\r\nHost: x"
    length = b"\r\nContent-Length: " + str(len(GOOD)).encode()
    kinds: list[tuple[str, bytes, int | tuple[int, ...] | str]] = [
        ("binary garbage", b"\x00\x01\x02\xff\r\n\r\n", 400),  # no request-line: 400 (RFC 9112 2.2)
        ("only CRLFs", b"\r\n" * 50, CLOSE),  # empty lines before a request are skipped (2.2): no request yet
        ("no version", b"GET /v2/health/ready\r\n\r\n", 200),  # HTTP/0.9's simple request, answered (and closed)
        ("HTTP/9.9", b"GET /v2/health/ready HTTP/9.9\r\n\r\n", 505),  # a major version not served (RFC 9110 15.6.6)
        ("HTTP/0.9", b"GET /v2/health/ready\r\n", CLOSE),  # the line never ends in its blank line
        ("lower-case method", b"get /v2/health/ready HTTP/1.1\r\n\r\n", 501),  # methods are case-sensitive: unknown
        ("non-ASCII method", b"G\xc3\x89T /v2/health/ready HTTP/1.1\r\n\r\n", 400),  # not a token: no request-line
        ("unknown method", b"BREW /v2/health/ready HTTP/1.1\r\n\r\n", 501),  # RFC 9110 9.1: 501
        ("CONNECT", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n", 501),  # no proxy: not implemented
        ("absolute URI", b"GET http://example.com/v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", 200),  # 9112 3.2.2
        ("asterisk target", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # no route takes the server-wide form
        ("space in path", _wire(b"POST /v2/models/echo pair/infer HTTP/1.1\r\nHost: x" + length, GOOD), 400),
        ("raw UTF-8 model name", _wire(b"POST /v2/models/\xc3\xa9/infer HTTP/1.1\r\nHost: x" + length, GOOD), 400),
        ("raw invalid UTF-8 model name",
         _wire(b"POST /v2/models/\xff\xfe/infer HTTP/1.1\r\nHost: x" + length, GOOD), 400),
        ("NUL in path", _wire(b"POST /v2/models/echo\x00pair/infer HTTP/1.1\r\nHost: x" + length, GOOD), 400),
        # RFC 9112 3.2 asks a 400 for an HTTP/1.1 request without Host; Triton answers it, so does the gateway
        ("no Host", _wire(b"POST " + PAIR.encode() + b" HTTP/1.1" + length, GOOD), 200),
        ("header without colon", _wire(post + b"\r\nNoColonHere" + length, GOOD), 400),
        ("space before colon", _wire(post + b"\r\nContent-Length : " + str(len(GOOD)).encode(), GOOD), 400),  # 5.1
        ("folded header", _wire(post + length + b"\r\nX-A: a\r\n b", GOOD), 400),  # obs-fold refused (5.2)
        ("NUL in a header value", _wire(post + length + b"\r\nX-A: a\x00b", GOOD), 400),  # RFC 9110 5.5
        ("non-ASCII header value", _wire(post + length + b"\r\nX-A: \xc3\xa9\xff", GOOD), 200),  # obs-text
        ("header name of 7 kB", _wire(post + length + b"\r\n" + b"X" * 7000 + b": 1", GOOD), 200),  # under 8 kB
        ("two different Content-Lengths", _wire(post + length + b"\r\nContent-Length: 3", GOOD), 400),  # 6.3
        ("two equal Content-Lengths", _wire(post + length + length, GOOD), 400),  # may be refused (RFC 9110 8.6)
        ("Content-Length -1", _wire(post + b"\r\nContent-Length: -1", GOOD), 400),
        ("Content-Length abc", _wire(post + b"\r\nContent-Length: abc", GOOD), 400),
        ("Content-Length 1e3", _wire(post + b"\r\nContent-Length: 1e3", GOOD), 400),
        ("Content-Length 2^64", _wire(post + b"\r\nContent-Length: 18446744073709551616", GOOD), 400),
        ("Content-Length +5", _wire(post + b"\r\nContent-Length: +5", GOOD), 400),
        ("Content-Length 0x10", _wire(post + b"\r\nContent-Length: 0x10", GOOD), 400),
        ("body shorter than Content-Length", _wire(post + b"\r\nContent-Length: 9999", GOOD), CLOSE),  # (9112 8)
        ("body longer than Content-Length", _wire(post + length, GOOD + b"GARBAGE / HTTP/1.1\r\n\r\n"), (200, 400)),
        ("chunked", _wire(post + b"\r\nTransfer-Encoding: chunked",
                          b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)), 200),
        ("chunked with extensions and trailer", _wire(post + b"\r\nTransfer-Encoding: chunked",
                                                      b"%x;a=b\r\n%s\r\n0\r\nX-T: 1\r\n\r\n" % (len(GOOD), GOOD)), 200),
        ("chunk size not hex", _wire(post + b"\r\nTransfer-Encoding: chunked", b"zz\r\nab\r\n0\r\n\r\n"), 400),
        ("chunk size 2^64", _wire(post + b"\r\nTransfer-Encoding: chunked", b"10000000000000000\r\nab\r\n0\r\n\r\n"),
         400),
        ("chunk longer than said", _wire(post + b"\r\nTransfer-Encoding: chunked", b"2\r\nabcdef\r\n0\r\n\r\n"), 400),
        ("chunked and Content-Length", _wire(post + length + b"\r\nTransfer-Encoding: chunked",
                                             b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)), 400),  # smuggling (6.3)
        # a transfer coding the server does not implement: 501 (RFC 9112 6.1), not the body read as if plain
        ("Transfer-Encoding gzip, chunked", _wire(post + b"\r\nTransfer-Encoding: gzip, chunked", b"0\r\n\r\n"), 501),
        ("Transfer-Encoding identity", _wire(post + length + b"\r\nTransfer-Encoding: identity", GOOD), 400),
        ("Expect: 100-continue", _wire(post + length + b"\r\nExpect: 100-continue", GOOD), (100, 200)),
        ("Expect: something else", _wire(post + length + b"\r\nExpect: teapot", GOOD), 200),  # 417 optional
        ("Upgrade to h2c", _wire(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings"
                                 b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA"), 200),  # ignored
        ("HTTP/2 preface on the HTTP port", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
         400),
        ("TLS hello on the HTTP port", bytes.fromhex("160301002c010000280303") + b"\x00" * 40, 400),
        ("HTTP/1.0 keep-alive", _wire(b"GET /v2/health/ready HTTP/1.0\r\nConnection: keep-alive"), 200),
        ("pipelined good and bad", _wire(post + length, GOOD) + b"\x00garbage\r\n\r\n", (200, 400)),
        ("pipelined twenty", _wire(b"GET /v2/health/ready HTTP/1.1\r\nHost: x") * 20, (200,) * 20),
        ("Connection: close", _wire(post + length + b"\r\nConnection: close", GOOD), 200),
        ("Authorization not ASCII", _wire(post + length + b"\r\nAuthorization: Bearer t\xc3\xb6k\xff", GOOD), 200),
    ]
    return kinds


def _answers(s: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` answers (a 100 Continue counts as one), each framed by its Content-Length; fewer where the
    connection closes first."""
    buf, out = b"", []
    while len(out) < count:
        if b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            found = [v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                     if k.strip().lower() == b"content-length"]
            size = int(found[0]) if found else 0
            if len(rest) >= size:
                status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.") else 0
                out.append((status, rest[:size]))
                buf = rest[size:]
                continue
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            if buf:
                out.append((0, buf))  # bytes that are no answer
            break
        buf += chunk
    return out


def test_malformed_http_on_the_wire(hostile_gateway, gateway_server):
    kinds = _raw_kinds()
    wrong = []
    for name, data, expected in kinds:
        s = socket.create_connection(("127.0.0.1", hostile_gateway.http_port))
        s.settimeout(10)
        want = () if expected == CLOSE else expected if isinstance(expected, tuple) else (expected,)
        try:
            s.sendall(data)
            if expected == CLOSE:  # nothing more comes: the request stays incomplete, the gateway must close
                s.shutdown(socket.SHUT_WR)
            # (a complete request is read with the connection open: a client that shuts its side is taken as gone,
            # docs/cache.md, so its answer may be dropped; that is no answer to a malformed request)
            got = _answers(s, len(want) or 1)
        except TimeoutError:
            wrong.append((name, f"expected {expected}: no answer and no close within 10 s"))
            continue
        except BrokenPipeError:
            got = [(0, b"the gateway closed before the request was sent")]
        finally:
            s.close()
        if [status for status, _ in got] != list(want):
            wrong.append((name, f"expected {expected}, got {[(st, body[:150]) for st, body in got]}"))
        elif any(st >= 400 and not isinstance(json.loads(body or b"{}").get("error"), str) for st, body in got):
            wrong.append((name, f"an error without a KServe body: {got}"))
    assert not wrong, "\n".join(map(str, wrong))
    assert hostile_gateway.proc.poll() is None
    status, _, body = _send(hostile_gateway.http_port, "POST", PAIR, GOOD, {})
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
    assert b"Traceback" not in hostile_gateway.log.read_bytes()


SERVICE = "/inference.GRPCInferenceService/"


def _grpc_base():
    from tritonclient.grpc import service_pb2

    m = service_pb2.ModelInferRequest(model_name="echo_pair", id="r1")
    m.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    m.inputs.add(name="INPUT1", datatype="INT64", shape=[1])
    m.raw_input_contents.extend([np.array([1, 2], np.float32).tobytes(), np.array([7], np.int64).tobytes()])
    m.outputs.add(name="INPUT0_OUT")
    return m


def _grpc_kinds() -> list[tuple[str, str, bytes, tuple]]:
    """ModelInfer messages bent every way the protocol allows, bytes that are no message, other methods with
    odd arguments, odd metadata."""
    from tritonclient.grpc import service_pb2

    def set_param(p, value):
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            if value >= 2**63:
                p.uint64_param = value
            else:
                p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = value

    mutations = []
    for name in ("", "x" * 10_000, "é", "a/b", "echo_pair ", "%65cho_pair", "echo\0pair", "ECHO_PAIR", "../echo_pair"):
        mutations.append((f"model_name {name[:12]!r}", lambda m, v=name: setattr(m, "model_name", v)))
    for version in ("abc", "-1", "0", "2", "99999999999999999999", "1 ", "é", "01"):
        mutations.append((f"model_version {version!r}", lambda m, v=version: setattr(m, "model_version", v)))
    for rid in ("x" * 100_000, "a\0b", "é", ""):
        mutations.append((f"id {rid[:8]!r}", lambda m, v=rid: setattr(m, "id", v)))
    for value in ("", "NOPE", "INPUT1", "é"):
        mutations.append((f"input name {value!r}", lambda m, v=value: setattr(m.inputs[0], "name", v)))
    for value in ("", "FP99", "fp32", "BYTES", "FP16", "BF16", "INT64", "BOOL", "UINT8"):
        mutations.append((f"input datatype {value!r}", lambda m, v=value: setattr(m.inputs[0], "datatype", v)))
    for shape in ([], [0], [3], [1, 2], [-1], [2**62], [2**62, 4], [-(2**63)], [2**31], [1] * 64):
        def reshape(m, v=shape):
            del m.inputs[0].shape[:]
            m.inputs[0].shape.extend(v)
        mutations.append((f"input shape {shape[:3]}{'...' if len(shape) > 3 else ''}", reshape))
    raw_cases = {"one raw content missing": lambda m: m.raw_input_contents.pop(),
                 "an extra raw content": lambda m: m.raw_input_contents.append(b"\0" * 8),
                 "raw content short": lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 7),
                 "raw content long": lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 9),
                 "raw content empty": lambda m: m.raw_input_contents.__setitem__(0, b""),
                 "raw and contents": lambda m: m.inputs[0].contents.fp32_contents.extend([1, 2]),
                 "no inputs": lambda m: (m.ClearField("inputs"), m.ClearField("raw_input_contents")),
                 "no outputs": lambda m: m.ClearField("outputs"),
                 "outputs twice": lambda m: m.outputs.add(name="INPUT0_OUT"),
                 "unknown output": lambda m: m.outputs.add(name="NOPE"),
                 "empty output name": lambda m: m.outputs.add(name=""),
                 "output shared memory": lambda m: m.outputs[0].parameters["shared_memory_region"].__setattr__(
                     "string_param", "nope"),
                 "input shared memory": lambda m: m.inputs[0].parameters["shared_memory_region"].__setattr__(
                     "string_param", "nope")}
    mutations += list(raw_cases.items())

    def contents(field, values, datatype="FP32", shape=(2,)):
        def apply(m):
            m.ClearField("raw_input_contents")
            m.inputs[0].datatype = datatype
            del m.inputs[0].shape[:]
            m.inputs[0].shape.extend(shape)
            getattr(m.inputs[0].contents, field).extend(values)
            m.inputs[1].contents.int64_contents.extend([7])
        return apply
    for label, args in (("fp32 contents", ("fp32_contents", [1, 2])),
                        ("fp32 contents, three values", ("fp32_contents", [1, 2, 3])),
                        ("int contents for FP32", ("int_contents", [1, 2])),
                        ("fp64 contents for FP32", ("fp64_contents", [1, 2])),
                        ("bytes contents for FP32", ("bytes_contents", [b"a", b"b"])),
                        ("int contents for INT8 overflowing", ("int_contents", [300, -300], "INT8")),
                        ("uint contents for UINT16", ("uint_contents", [1, 70000], "UINT16")),
                        ("bool contents", ("bool_contents", [True, False], "BOOL")),
                        ("bytes contents", ("bytes_contents", [b"\xff", b""], "BYTES")),
                        ("int64 contents for INT32", ("int64_contents", [1, 2], "INT32")),
                        ("FP16 as fp32 contents", ("fp32_contents", [1, 2], "FP16")),
                        ("contents, no values", ("fp32_contents", [], "FP32", (0,)))):
        mutations.append((label, contents(*args)))
    for key, value in (("priority", -1), ("priority", "high"), ("priority", 2**63), ("timeout", "1"),
                       ("timeout", 2**63), ("sequence_id", 1.5), ("sequence_id", 5), ("sequence_start", 1),
                       ("sequence_end", "yes"), ("binary_data_output", 1), ("triton_x", True), ("custom", 2**63),
                       ("custom", 1.5), ("custom", "é"), ("", True), ("x" * 5000, 1)):
        mutations.append((f"parameter {key[:10]!r} = {value!r}",
                          lambda m, k=key, v=value: set_param(m.parameters[k], v)))
    mutations.append(("parameter with no value", lambda m: m.parameters["custom"].SetInParent()))
    for key, value in (("classification", 1), ("classification", -1), ("classification", "2"), ("binary_data", 1)):
        mutations.append((f"output parameter {key} = {value!r}",
                          lambda m, k=key, v=value: set_param(m.outputs[0].parameters[k], v)))

    kinds = []
    for label, mutate in mutations:
        m = _grpc_base()
        mutate(m)
        kinds.append((label, "ModelInfer", m.SerializeToString(), ()))
    base = _grpc_base().SerializeToString()
    rng = np.random.default_rng(7)
    for k in range(12):
        kinds.append((f"random bytes {k}", "ModelInfer", rng.bytes(int(rng.integers(1, 300))), ()))
    for cut in (1, 5, 11, 20, 40, len(base) - 1):
        kinds.append((f"message cut at {cut}", "ModelInfer", base[:cut], ()))
    kinds.append(("invalid UTF-8 in a string field", "ModelInfer", b"\x0a\x02\xff\xfe" + base, ()))
    kinds.append(("unknown field", "ModelInfer", base + b"\xa8\x1f\x01", ()))
    kinds.append(("a field of the wrong wire type", "ModelInfer", b"\x08\x01" + base, ()))
    kinds.append(("empty message", "ModelInfer", b"", ()))
    for name in ("", "x" * 10_000, "nope", "é", "echo_pair"):
        kinds.append((f"metadata of {name[:8]!r}", "ModelMetadata",
                      service_pb2.ModelMetadataRequest(name=name).SerializeToString(), ()))
        kinds.append((f"config of {name[:8]!r}", "ModelConfig",
                      service_pb2.ModelConfigRequest(name=name, version="x").SerializeToString(), ()))
        kinds.append((f"ready of {name[:8]!r}", "ModelReady",
                      service_pb2.ModelReadyRequest(name=name, version="9").SerializeToString(), ()))
    kinds += [("statistics of nope", "ModelStatistics",
               service_pb2.ModelStatisticsRequest(name="nope").SerializeToString(), ()),
              ("load nope", "RepositoryModelLoad",
               service_pb2.RepositoryModelLoadRequest(model_name="nope").SerializeToString(), ()),
              ("load ../x", "RepositoryModelLoad",
               service_pb2.RepositoryModelLoadRequest(model_name="../x").SerializeToString(), ()),
              ("shared memory register garbage", "SystemSharedMemoryRegister",
               service_pb2.SystemSharedMemoryRegisterRequest(name="r", key="/nope", byte_size=2**62
                                                             ).SerializeToString(), ()),
              ("shared memory status", "SystemSharedMemoryStatus", b"", ()),
              ("garbage to ServerReady", "ServerReady", b"\xff\xff\xff", ()),
              ("unknown method", "NoSuchMethod", b"", ()),
              ("forwarded metadata", "ModelInfer", base, (("x-fwd-a", "1"),)),
              ("binary metadata", "ModelInfer", base, (("x-data-bin", b"\xff\x00"),)),
              ("long metadata", "ModelInfer", base, (("x-long", "a" * 6000),)),
              ("many metadata", "ModelInfer", base, tuple((f"x-m{i}", "v") for i in range(60))),
              ("cache-control no-store", "ModelInfer", base, (("cache-control", "no-store"),))]
    return kinds


CLIENT_CODES = {"INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                "OUT_OF_RANGE", "UNIMPLEMENTED", "ALREADY_EXISTS", "PERMISSION_DENIED"}


def _call(channel, method: str, payload: bytes, metadata: tuple):
    import grpc

    try:
        return "OK", channel.unary_unary(SERVICE + method)(payload, metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        return e.code().name, e.details()


def test_hundreds_of_malformed_grpc_requests(hostile_gateway, gateway_server):
    import grpc
    from tritonclient.grpc import service_pb2

    kinds = _grpc_kinds()
    names = [k[0] for k in kinds]
    assert len(set(names)) == len(names) >= 130
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
               ("grpc.max_metadata_size", 1 << 20), ("grpc.absolute_max_metadata_size", 1 << 20)]
    direct_channel = grpc.insecure_channel(gateway_server.grpc_url, options=options)
    gateway_channel = grpc.insecure_channel(hostile_gateway.grpc_url, options=options)
    wrong = []
    for name, method, payload, metadata in kinds:
        direct = _call(direct_channel, method, payload, metadata)
        through = _call(gateway_channel, method, payload, metadata)
        if direct[0] == "OK":
            same = through[0] == "OK" and (
                service_pb2.ModelInferResponse.FromString(through[1]) ==
                service_pb2.ModelInferResponse.FromString(direct[1]) if method == "ModelInfer"
                else through[1] == direct[1])
        elif direct[1] == "Unable to parse request":  # Triton's words, with a client error's code
            same = through == ("INVALID_ARGUMENT", direct[1])
        elif method == "ModelInfer":
            same = through == direct and direct[0] in CLIENT_CODES
        else:  # Triton's answer to a repository or shared-memory call (INTERNAL for a missing model) relayed
            same = through == direct
        if not same:
            wrong.append((name, direct[0], str(direct[1])[:160], through[0], str(through[1])[:160]))
    direct_channel.close()
    gateway_channel.close()
    assert not wrong, "\n".join(f"{w[0]}: Triton {w[1]} {w[2]!r} / gateway {w[3]} {w[4]!r}" for w in wrong)
    assert hostile_gateway.proc.poll() is None
    assert b"Traceback" not in hostile_gateway.log.read_bytes()
