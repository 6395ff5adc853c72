"""The cache gateway at the edge: cancelled and joined misses, a hung or killed Triton, hostile clients, memory
and metrics bounds, and the protocol details where it must answer as Triton does. Real processes: Triton 2.51
serving our own small python-backend models (tests/models) and the exported tensor model, the gateway as `dstool
gateway`, the unmodified tritonclient. The gateway caches in its own memory here (what these tests are about is in
front of the cache); the tests about Redis itself (a cancelled Redis call, a slow first answer at start, files changed
under a loaded version, workers sharing one cache) use a real redis-server; test_gateway.py runs the gateway's routes
on Redis."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import time

import numpy as np
import pytest

from gatewaylib import GatewayProcess, decoded_body, eventually, wait_for


def _fp32_inputs(module, values, binary: bool = True):
    t = module.InferInput("INPUT0", [len(values)], "FP32")
    data = np.asarray(values, dtype=np.float32)
    if module.__name__.startswith("tritonclient.http"):
        t.set_data_from_numpy(data, binary_data=binary)
    else:
        t.set_data_from_numpy(data)
    return [t]


def test_a_cancelled_miss_does_not_hang_the_requests_that_joined_it(gateway, gateway_server):
    """The first client of a miss gives up (gRPC deadline) while Triton computes; a second client asked for the
    same result meanwhile: it gets the result of that one computation, not a hang (the computation belongs to
    no single request)."""
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http as http
    import tritonclient.http.aio as http_aio
    from tritonclient.utils import InferenceServerException

    values = [float(time.time() % 1000), 1.0, 2.0]  # a fresh input: a miss
    parameters = {"delay_ms": 1500}

    async def run():
        g, h = grpc_aio.InferenceServerClient(gateway.grpc_url), http_aio.InferenceServerClient(gateway.http_url)
        try:
            first = asyncio.ensure_future(g.infer("echo_joined", _fp32_inputs(grpc_aio, values), client_timeout=0.5,
                                                  parameters=parameters))
            await asyncio.sleep(0.15)
            started = time.monotonic()
            joiner = await asyncio.wait_for(h.infer("echo_joined", _fp32_inputs(http_aio, values),
                                                    parameters=parameters), 10)
            with pytest.raises(InferenceServerException, match="Deadline"):
                await first
            return joiner.as_numpy("INPUT0_OUT"), time.monotonic() - started
        finally:
            await g.close()
            await h.close()

    stats = http.InferenceServerClient(gateway_server.http_url)

    def ran() -> int:  # inferences Triton ran for the model, once its statistics have settled
        counts = [-1]
        while True:
            time.sleep(0.2)
            counts.append(sum(int(m["inference_count"]) for m in
                              stats.get_inference_statistics("echo_joined")["model_stats"]))
            if counts[-1] == counts[-2]:
                return counts[-1]

    before = ran()
    out, _ = asyncio.run(run())
    assert np.array_equal(out, np.asarray(values, np.float32))
    assert ran() == before + 1  # both clients were answered by one computation
    stats.close()


def test_a_cancelled_redis_call_never_goes_on(redis_server):
    """A request whose client hangs up during a Redis call (the cache lookup, the key check) stops there. redis-py
    bounds each command with asyncio.wait_for, which on Python 3.11 can return the reply and drop the cancellation
    (gh-86296): before the gateway re-raised it, about a third of these calls went on, and their requests on to
    Triton. Cancelled at every few loop turns into the call, on the real redis-server."""
    from dstool.serve.cache_url import CacheURL
    from dstool.serve.gateway.cache.store import RedisStore
    from dstool.serve.gateway.metrics import Metrics
    from dstool.serve.gateway.tenancy.guard import Guard

    async def run():
        store = RedisStore(CacheURL.parse(redis_server.url), timeout=2.0)
        guard = Guard(store, None, "deny", 0.0, "deny", Metrics())

        async def key_check():
            return await guard._redis(lambda: store.client.get("k"))

        went_on, tries = {"cache": 0, "guard": 0}, 0
        for i in range(600):
            kind = "cache" if i % 2 else "guard"
            task = asyncio.ensure_future(store.call("get", "k") if kind == "cache" else key_check())
            for _ in range(i % 7):
                await asyncio.sleep(0)
            if not task.cancel():  # it had already ended
                await task
                continue
            tries += 1
            try:
                await task
                went_on[kind] += 1
            except asyncio.CancelledError:
                pass
        await store.close()
        return went_on, tries

    went_on, tries = asyncio.run(run())
    assert tries > 300 and went_on == {"cache": 0, "guard": 0}, (went_on, tries)


def test_an_answer_that_came_in_time_on_a_stalled_loop_is_not_a_timeout():
    """A busy gateway's loop stalled past a deadline while the answer arrived in time: the timer and the answer are
    due in the same turn, and the answer counts (before: a timeout — a connection to Triton made in 1 ms, read
    after a 2 s stall, marked a healthy Triton down and every request failed with 503 for a second)."""
    from dstool.serve.gateway.upstream import within

    async def run(answer_at: float) -> str:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        loop.call_later(answer_at, answer.set_result, "made")

        async def connect() -> str:  # an awaitable of a few steps, as loop.create_connection is
            made = await answer
            for _ in range(3):  # the transport made, connection_made called, its waiter woken
                await asyncio.sleep(0)
            return made

        loop.call_later(0.01, time.sleep, 0.3)  # the stall: the loop does nothing else for 0.3 s
        try:
            return await within(connect(), 0.1)
        except asyncio.TimeoutError:
            return "timeout"

    assert asyncio.run(run(0.05)) == "made"
    assert asyncio.run(run(0.5)) == "timeout"  # an answer that came late still times out


def test_a_burst_of_redis_calls_waits_for_a_connection_not_an_outage(redis_server):
    """More cache lookups and key checks at once than redis-py's default pool of 100 holds (which failed the 101st with
    "Too many connections", and the gateway called that an outage: every request past the cache for a back-off), on
    the real redis-server: each is answered, Redis stays in use; with a pool of 8, the rest wait for a free one."""
    from dstool.serve.cache_url import CacheURL
    from dstool.serve.gateway.cache.store import RedisStore
    from dstool.serve.gateway.metrics import Metrics
    from dstool.serve.gateway.tenancy.guard import Guard

    async def burst(**pool):
        store = RedisStore(CacheURL.parse(redis_server.url), timeout=2.0, **pool)
        guard = Guard(store, None, "deny", 0.0, "deny", Metrics())
        await store.call("set", "burst", "v")
        try:
            replies = await asyncio.gather(*(store.call("get", "burst") if i % 2 else
                                             guard._redis(lambda: store.client.get("burst")) for i in range(400)))
            return replies, store.available, store.client.connection_pool.max_connections
        finally:
            await store.close()

    for pool in ({}, {"connections": 8}):
        replies, available, size = asyncio.run(burst(**pool))
        assert available and replies == [b"v"] * 400, (pool, available, {r for r in replies if r != b"v"})
        assert size == pool.get("connections", 1024)


def test_a_slow_first_answer_is_waited_for_at_start(redis_server, caplog):
    """The gateway's start asks Redis once with patience: behind a link whose first answers come 0.3 s late (a loaded
    machine's TLS handshake), a PING within --redis-timeout 0.1 times out, and the start used to call that an outage
    and warn. It retries timeouts silently for a few seconds; a refused connection answers at once."""
    from dstool.proc import free_port
    from dstool.serve.cache_url import CacheURL
    from dstool.serve.gateway.cache.store import RedisStore

    host, port = "127.0.0.1", redis_server.port

    async def run():
        slow = {"left": 2}

        async def relay(reader, writer):
            up_reader, up_writer = await asyncio.open_connection(host, port)
            if slow["left"]:
                slow["left"] -= 1
                await asyncio.sleep(0.3)

            async def pipe(src, dst):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                dst.close()
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        url = redis_server.url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}")
        patient = RedisStore(CacheURL.parse(url), timeout=0.1)
        answered = await patient.reachable()
        await patient.close()
        slow["left"] = 1
        hasty = RedisStore(CacheURL.parse(url), timeout=0.1)
        hasty_answered = await hasty.ping()
        await hasty.close()
        refused = RedisStore(CacheURL.parse(f"redis://127.0.0.1:{free_port()}/0"), timeout=0.1)
        started = time.monotonic()
        refused_answered, refused_s = await refused.reachable(), time.monotonic() - started
        await refused.close()
        proxy.close()
        return answered, hasty_answered, refused_answered, refused_s

    with caplog.at_level("WARNING", logger="dstool.gateway"):
        answered, hasty_answered, refused_answered, refused_s = asyncio.run(run())
    assert answered and not hasty_answered  # the link is slow indeed: one PING within its timeout does not answer
    assert refused_answered is False and refused_s < 2  # nothing listening: no wait
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == 2, warned  # the hasty PING's and the refused one's, not the patient start's


def test_metrics_do_not_grow_with_model_names_clients_invent(gateway):
    import http.client

    import grpc
    from tritonclient.grpc import service_pb2

    channel = grpc.insecure_channel(gateway.grpc_url)
    model_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    body = b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}]}'

    def invent(names) -> int:
        for name in names:
            conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
            conn.request("POST", f"/v2/models/{name}/infer", body)
            assert conn.getresponse().status == 404
            conn.close()
            request = service_pb2.ModelInferRequest(model_name=name)
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
            request.raw_input_contents.append(np.float32(1).tobytes())
            with pytest.raises(grpc.RpcError) as e:
                model_infer(request.SerializeToString(), timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        return len(gateway.metrics_text())

    after_100 = invent(f"invented_{i}_" + "x" * 200 for i in range(100))
    after_300 = invent(f"invented_{i}_" + "x" * 200 for i in range(100, 300))
    channel.close()
    text = gateway.metrics_text()
    assert "invented_" not in text and 'model="(unknown)"' in text
    assert abs(after_300 - after_100) < 200, (after_100, after_300)  # counts change, series do not


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def test_the_memory_bound_counts_renderings_too():
    """A hit keeps its JSON or gRPC rendering for the next one: that counts against the bound, and evicts."""
    from dstool.serve.gateway.cache.store import ENTRY_OVERHEAD, ResultCache
    from dstool.serve.gateway.kserve.codec import render_infer as render_http
    from dstool.serve.gateway.kserve.grpc import render_infer as render_grpc
    from dstool.serve.gateway.tensors import InferResult, Tensor

    bound = 1 << 20
    cache = ResultCache(None, 60, bound, bound)
    sizes = {}
    for i in range(40):
        raw = (np.arange(16384, dtype=np.int32) * 100003 * (i + 1)).tobytes()  # 64 KB out; as JSON ~3x that
        entry = cache.put(f"k{i}", InferResult("m", "1", [Tensor("y", "INT32", (16384,), raw)]))
        json_response = render_http(entry.result, "", (False, ()))
        entry.keep(("http", (False, ())), json_response, sum(len(c) for c in json_response.chunks))
        grpc_body = render_grpc(entry.result, "")
        entry.keep("grpc", grpc_body, len(grpc_body))
        sizes[id(entry)] = len(raw) + sum(len(c) for c in json_response.chunks) + len(grpc_body) + ENTRY_OVERHEAD
        assert cache.front.bytes <= bound
    held = list(cache.front._entries.values())
    assert held and sum(e.size for e in held) == cache.front.bytes
    assert all(e.size == sizes[id(e)] for e in held)  # raw + JSON + gRPC, each counted
    assert abs(len(held) - bound // next(iter(sizes.values()))) <= 1  # so fewer entries fit


def test_memory_stays_bounded_under_distinct_requests(gateway_server, session_tmp):
    """--memory-cache-bytes bounds what the gateway holds: its gauge stays under the bound, and its resident size
    stops growing once the cache is full."""
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    bound = 4 << 20
    gw = GatewayProcess(session_tmp / "gateway-memory.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": "memory", "memory_cache_bytes": bound, "max_entry_bytes": bound})
    h, g = http.InferenceServerClient(gw.http_url), grpc.InferenceServerClient(gw.grpc_url)

    def load(rounds: range) -> None:
        for i in rounds:  # 256 KB of int32 out, ~0.7 MB of it as JSON, 256 KB again for gRPC
            values = ((np.arange(65536, dtype=np.int64) * 32749 + i * 7919) % (2**31) - 2**30).astype(np.int32)
            for client, module in ((h, http), (g, grpc)):
                t = module.InferInput("INPUT0", [65536], "INT32")
                if client is h:
                    t.set_data_from_numpy(values, binary_data=False)
                    wanted = [http.InferRequestedOutput("INPUT0_OUT", binary_data=False)]
                else:
                    t.set_data_from_numpy(values)
                    wanted = None
                for _ in range(2):  # the second is a hit: it renders, and the rendering is kept
                    assert np.array_equal(client.infer("echo_int32", [t], outputs=wanted).as_numpy("INPUT0_OUT"),
                                          values)

    try:
        load(range(60))  # the cache is full after ~5 distinct requests; the allocator settles after a few dozen
        rss_settled = _rss(gw.proc.pid)
        load(range(60, 120))
        held = gw.metric("dstool_gateway_memory_cache_bytes")
        assert 0 < held <= bound
        assert _rss(gw.proc.pid) - rss_settled < 2 * bound, (_rss(gw.proc.pid) - rss_settled) / 2**20
    finally:
        h.close()
        g.close()
        gw.stop()


@pytest.fixture
def lone_triton(gateway_repo, tmp_path):
    """A Triton of its own (echo models only) for a test that kills or freezes it."""
    import shutil

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    repo = tmp_path / "repo"
    for name in ("echo_fp32", "echo_bytes"):
        shutil.copytree(gateway_repo / name, repo / name)
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), tmp_path / "t.log")
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
    srv.stop()


def _http(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
          timeout: float = 30) -> tuple[int, dict, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


ECHO_BODY = b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[1.5,2.5]}]}'


def test_triton_killed_misses_are_503_hits_still_served(lone_triton, session_tmp):
    import grpc
    from tritonclient.grpc import service_pb2

    gw = GatewayProcess(session_tmp / "gateway-killed.log",
                        config={"upstreams": [lone_triton.http_url], "upstreams_grpc": [lone_triton.grpc_url],
                                "cache": "memory", "version_check_interval": 0.2})
    try:
        assert _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY)[0] == 200  # cached now
        lone_triton.proc.kill()  # Triton gone at once
        lone_triton.proc.wait()
        time.sleep(0.5)  # past the version check interval (0.2 s, on the same clock): the gateway must ask Triton,
        # and cannot (a sleep that a loaded machine can only make longer)
        status, _, body = _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY)
        assert status == 200 and b"INPUT0_OUT" in body  # what the cache holds is still served
        other = ECHO_BODY.replace(b"2.5", b"3.5")
        for method, path, payload in (("POST", "/v2/models/echo_fp32/infer", other), ("GET", "/v2/health/ready", None),
                                      ("GET", "/v2/models/echo_fp32", None)):
            started = time.monotonic()
            status, _, body = _http(gw.http_port, method, path, payload, timeout=120)
            assert status == 503 and "error" in json.loads(body), (path, body)
            # a net against waiting out the upstream deadline (60 s by default) for a Triton that refuses every
            # connection, not a measure of speed
            assert time.monotonic() - started < 50, path
        channel = grpc.insecure_channel(gw.grpc_url)
        request = service_pb2.ModelInferRequest(model_name="echo_fp32")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
        request.raw_input_contents.append(np.float32(4).tobytes())
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady")(b"", timeout=30)
        assert service_pb2.ServerReadyResponse.FromString(ready).ready is False
        health = channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=30)
        assert health == b"\x08\x02"  # NOT_SERVING
        channel.close()
        assert gw.proc.poll() is None
    finally:
        gw.stop()


def test_triton_frozen_fails_fast_and_readiness_turns_false(lone_triton, session_tmp):
    """A hung Triton (SIGSTOP): a miss waits out its deadline once (504), then Triton is found not answering its
    health check and every miss fails at once with 503; readiness is false within the health timeout; once
    Triton runs again, so does the gateway."""
    import tritonclient.grpc as grpc
    from tritonclient.utils import InferenceServerException

    gw = GatewayProcess(session_tmp / "gateway-frozen.log",
                        config={"upstreams": [lone_triton.http_url], "upstreams_grpc": [lone_triton.grpc_url],
                                "cache": "memory", "upstream_timeout": 2, "health_timeout": 0.5,
                                "version_check_interval": 30})
    try:
        assert _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY)[0] == 200
        os.kill(lone_triton.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        status, _, body = _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY.replace(b"2.5", b"9"))
        # its deadline waited out (no less: a loaded machine only makes it longer), then a 504 of the gateway's own
        assert status == 504 and b"did not answer within 2 s" in body, (status, body)
        assert time.monotonic() - started > 1.5
        # the health check after the timeout (not answered within 0.5 s) marks Triton down, as the log says
        wait_for(lambda: "is not answering: requests fail at once with 503" in gw.log.read_text(),
                 "the health check to mark Triton down", 60)
        # every miss now fails at once: refused before anything is sent to Triton (what says "marked down"), where
        # one sent would wait out the 2 s deadline and be a 504 "did not answer"
        for k in range(5):
            fresh = ECHO_BODY.replace(b"2.5", str(k).encode())
            status, _, body = _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", fresh)
            assert status == 503 and b"marked down" in body, (status, body)
        assert _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY)[0] == 200  # a hit needs no Triton
        status, _, body = _http(gw.http_port, "GET", "/v2/health/ready")
        assert status == 503 and b"marked down" in body, (status, body)  # not the 0.5 s health check either
        c = grpc.InferenceServerClient(gw.grpc_url)
        assert c.is_server_ready() is False
        errors: queue.Queue = queue.Queue()  # a stream, too, fails at once while Triton is marked down
        c.start_stream(callback=lambda result, error: errors.put(error))
        x = grpc.InferInput("INPUT0", [1], "FP32")
        x.set_data_from_numpy(np.array([3.0], np.float32))
        try:
            c.async_stream_infer("echo_fp32", [x])
        except InferenceServerException:
            pass  # the stream ended before the request was sent; its error came to the callback
        error = errors.get(timeout=60)
        assert error is not None and error.status() == "StatusCode.UNAVAILABLE", error
        # refused at once, every Triton being marked down (a stream sent on would wait out the 2 s deadline)
        assert "no Triton is answering" in error.message(), error.message()
        c.stop_stream()
        os.kill(lone_triton.proc.pid, signal.SIGCONT)
        # the health check every second finds Triton again
        wait_for(lambda: _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer",
                               ECHO_BODY.replace(b"2.5", b"7"))[0] == 200, "the gateway to serve misses again", 60)
        assert c.is_server_ready() is True
        c.close()
    finally:
        os.kill(lone_triton.proc.pid, signal.SIGCONT)
        gw.stop()


@pytest.fixture
def guarded_gateway(gateway_server, session_tmp, tmp_path):
    """A gateway with a token and short client timeouts, for the hostile-client tests."""
    (tmp_path / "token").write_text("s3cret-token\n")
    gw = GatewayProcess(session_tmp / "gateway-guarded.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": "memory", "token_file": str(tmp_path / "token"), "header_timeout": 1.0,
                                "body_timeout": 1.0, "keepalive_timeout": 1.0, "max_connections": 1200,
                                "max_request_bytes": 8 << 20, "max_buffered_bytes": 12 << 20})
    yield gw
    gw.stop()


AUTH = {"Authorization": "Bearer s3cret-token"}


def _raw(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send raw bytes, read what comes back until the server closes (or `wait` passes)."""
    import socket

    s = socket.create_connection(("127.0.0.1", port))
    out = b""
    try:
        s.sendall(data)
        s.settimeout(wait)
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return out


def test_hostile_clients_cannot_exhaust_the_gateway(guarded_gateway):
    import socket

    gw = guarded_gateway
    rss_before = _rss(gw.proc.pid)
    # A 64 MiB header: refused (431) once past the head limit, not read into memory; others are served meanwhile.
    big = socket.create_connection(("127.0.0.1", gw.http_port))
    big.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: ")
    big.settimeout(10)
    sent = 0
    try:
        while sent < 64 << 20:
            big.sendall(b"a" * (1 << 20))
            sent += 1 << 20
    except (BrokenPipeError, ConnectionResetError):
        pass
    # dropped unread, then the connection closes: what the client got out before the close is what the kernels'
    # buffers took meanwhile (16-17 MB seen under load), far from the 64 MB sent
    assert sent < 32 << 20, sent
    assert big.recv(4096).startswith(b"HTTP/1.1 431")
    assert _http(gw.http_port, "GET", "/v2/health/ready", timeout=5)[0] == 200
    big.close()
    # Bodies without the token: refused before they are read (six 60 MiB bodies announced, none held).
    holders = []
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", gw.http_port))
        s.sendall(b"POST /v2/models/echo_fp32/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 62914560\r\n\r\n"
                  + b"x" * (1 << 20))
        holders.append(s)
    for s in holders:
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 401")
        s.close()
    # With the token: a body over --max-request-bytes is refused at its Content-Length (413), unread.
    answer = _raw(gw.http_port, b"POST /v2/models/echo_fp32/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  b"s3cret-token\r\nContent-Length: 62914560\r\n\r\n" + b"x" * 100)
    assert answer.startswith(b"HTTP/1.1 413")
    # A thousand half-sent requests: each closed after --header-timeout, and the gateway serves throughout.
    half = [socket.create_connection(("127.0.0.1", gw.http_port)) for _ in range(1000)]
    for s in half:
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")
    assert _http(gw.http_port, "GET", "/v2/health/ready", timeout=5)[0] == 200
    time.sleep(2.0)
    for s in half:
        s.settimeout(30)  # a net against a connection left open, not a measure of speed: 1000 answers take their time
        assert s.recv(4096).startswith(b"HTTP/1.1 408")
        s.close()
    assert _rss(gw.proc.pid) - rss_before < 64 << 20
    assert _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY, AUTH)[0] == 200


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET /v2/models/" + b"m" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
     431),
    (b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", 431),
    (b"POST /v2/models/echo_fp32/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret-token\r\n"
     b"Content-Length: 100\r\n\r\n{\"inputs\"", 408),
    (b"POST /v2/models/echo_fp32/infer HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n", 400),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"GET /v2/models/echo_fp32 HTTP/1.1\r\nHost: x\r\n\r\n", 401),
    (b"GET /v2/models/echo_fp32 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cr\xc3\xa9t-t\xffken\r\n\r\n", 401),
    (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n", 501),  # no proxy: not implemented
])
def test_requests_breaking_a_limit_get_one_clear_answer(guarded_gateway, request_bytes, status):
    answer = _raw(guarded_gateway.http_port, request_bytes)
    assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer[:200]
    assert b'{"error":' in answer
    assert _http(guarded_gateway.http_port, "GET", "/v2/models/echo_fp32", headers=AUTH)[0] == 200


def test_idle_keepalive_connections_are_closed(guarded_gateway):
    import socket

    s = socket.create_connection(("127.0.0.1", guarded_gateway.http_port))
    started = time.monotonic()  # before the request: the gateway's 1 s idle timer starts after its answer
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(30)  # a net against a connection never closed, not a measure of speed
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert s.recv(4096) == b""  # closed by the gateway after --keepalive-timeout
    assert time.monotonic() - started >= 0.95  # not before (a loaded machine only makes it later)
    s.close()


def test_shutdown_drains_requests_in_flight(gateway_server, session_tmp, tmp_path):
    """SIGTERM: no new connection is accepted, the requests in flight (HTTP and gRPC, a model holding them) finish
    with their answers, then the gateway exits 0 — as soon as they are done, not at the end of --shutdown-grace.
    The model holds each request until the test lets it go (tests/models/echo.py `hold`), so every step happens while
    they are in flight however slow the machine; the grace is long (120 s) so that waiting it out cannot pass."""
    import socket
    import subprocess
    import threading

    import tritonclient.grpc as grpc
    import tritonclient.http as http

    grace = 120
    gw = GatewayProcess(session_tmp / "gateway-drain.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": "memory", "shutdown_grace": grace})
    results: dict[str, object] = {}
    release = tmp_path / "release"

    def call(protocol: str) -> None:
        module = http if protocol == "http" else grpc
        c = module.InferenceServerClient(gw.http_url if protocol == "http" else gw.grpc_url,
                                         **({"network_timeout": 300.0} if protocol == "http" else {}))
        try:
            value = float(time.time() % 100) + (0.5 if protocol == "http" else 0.25)
            out = c.infer("echo_fp32", _fp32_inputs(module, [value]),
                          parameters={"started": str(tmp_path / protocol), "hold": str(release)})
            results[protocol] = out.as_numpy("INPUT0_OUT")[0] == np.float32(value)
        except Exception as e:  # noqa: BLE001 (reported below)
            results[protocol] = e
        finally:
            c.close()

    threads = [threading.Thread(target=call, args=(p,)) for p in ("http", "grpc")]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (tmp_path / "http").exists() and (tmp_path / "grpc").exists(),
                 "both requests to reach the model", 60)
        gw.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:  # the listening socket is closed: new clients go elsewhere
            try:
                socket.create_connection(("127.0.0.1", gw.http_port), timeout=2).close()
            except OSError:
                return True
            return False

        wait_for(refused, "the gateway to stop listening", 60)
        assert not results and all(t.is_alive() for t in threads), results  # still in flight, still held
        assert gw.proc.poll() is None  # and the gateway waits for them
    finally:
        release.touch()
    for t in threads:
        t.join(60)
    assert results == {"http": True, "grpc": True}, results
    try:
        code = gw.proc.wait(60)  # at once in fact: nothing is left in flight (the grace would end 120 s after SIGTERM)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, code
    assert f"requests in flight have {grace} s to finish" in gw.log.read_text()
    gw.stop()


def test_what_a_killed_triton_leaves_behind_is_removed(gateway_repo, tmp_path):
    """Triton SIGKILLed: its python-backend stubs and their /dev/shm regions must not outlive it. `stop()` (also
    what `dstool serve` runs when Triton died) kills what is left of its process group and removes the regions
    its stubs made (the name prefix dstool gives the python backend)."""
    import shutil
    import subprocess
    from pathlib import Path

    import psutil

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    repo = tmp_path / "repo"
    shutil.copytree(gateway_repo / "echo_fp32", repo / "echo_fp32")
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), tmp_path / "t.log")
    assert sorted(Path("/dev/shm").glob(srv.shm_prefix + "*"))  # the prefix is the one the python backend used
    stubs = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
             if p.name() == "triton_python_backend_stub"]
    planted = Path("/dev/shm") / (srv.shm_prefix + "leftover")  # as a stub that outlived Triton would leave
    planted.write_bytes(b"x")
    os.kill(srv.proc.pid, signal.SIGKILL)
    assert srv.stop() == -signal.SIGKILL
    assert not list(Path("/dev/shm").glob(srv.shm_prefix + "*"))
    assert stubs
    for stub in stubs:
        try:
            stub.wait(5)
        except psutil.NoSuchProcess:
            pass
    # A process its group still holds (a stub that did not notice): killed by the clean-up too.
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & exec sleep 301"], start_new_session=True)

    def grouped() -> list:  # the background `sleep 300` once the shell has started it, in the leader's group
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "300"]
                and os.getpgid(p.pid) == leader.pid]

    left = eventually(grouped, bool)
    leader.kill()
    fake = triton.TritonProcess(leader, 0, 0, 0, tmp_path / "t.log")
    fake.stop()
    assert left
    for p in left:
        try:
            p.wait(5)  # gone (psutil.TimeoutExpired otherwise)
        except psutil.NoSuchProcess:
            pass


# ---- where the gateway speaks Triton's protocol: the same request to Triton and through the gateway --------------

@pytest.fixture(scope="module")
def parity_gateway(gateway_server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-parity.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": "memory", "forward_headers": "^x-fwd-.*"})
    yield gw
    gw.stop()


def _input(datatype: str, shape, data) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": shape, "datatype": datatype, "data": data}]}).encode()


def _bytes_body(*items: bytes) -> tuple[bytes, dict]:
    import struct

    raw = b"".join(struct.pack("<I", len(b)) + b for b in items)
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [len(items)], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


FP32 = "/v2/models/echo_fp32/infer"
INT32 = "/v2/models/echo_int32/infer"
BYTES = "/v2/models/echo_bytes/infer"
PAIR = "/v2/models/echo_pair/infer"
PAIR_INPUTS = [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]},
               {"name": "INPUT1", "shape": [1], "datatype": "INT64", "data": [7]}]
# (case, method, path, body, headers, how the answers compare): "same" — status, encoding and body as Triton's;
# "parse" — Triton's message, but 400 where Triton says 500 (the client's mistake is a client error); "json" — as
# Triton's, but a JSON error body is labelled application/json where Triton says text/plain.
PARITY = [
    ("int32 as float", "POST", INT32, _input("INT32", [2], [9.7, 1]), {}, "parse"),
    ("int32 as bool", "POST", INT32, _input("INT32", [2], [True, 1]), {}, "parse"),
    ("int32 as string", "POST", INT32, _input("INT32", [2], ["5", 1]), {}, "parse"),
    ("int32 wraps", "POST", INT32, _input("INT32", [2], [2**40 + 3, -1]), {}, "same"),
    ("int32 beyond int64", "POST", INT32, _input("INT32", [2], [2**63, 1]), {}, "parse"),
    ("fp32 from ints", "POST", FP32, _input("FP32", [2], [1, 2]), {}, "same"),
    ("fp32 nested", "POST", FP32, _input("FP32", [2], [[1], [2.5]]), {}, "same"),
    ("fp32 as string", "POST", FP32, _input("FP32", [1], ["5"]), {}, "parse"),
    ("fp32 as null", "POST", FP32, _input("FP32", [1], [None]), {}, "parse"),
    ("fp32 NaN and infinities", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[3],"datatype":"FP32","data":[NaN, 1e-400, -Infinity]}]}', {}, "same"),
    ("fp32 beyond double", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[NaN, -1e400]}]}', {}, "parse"),
    ("an integer beyond double", "POST", FP32, _input("FP32", [1], [10**400]), {}, "parse"),
    ("fewer values than the shape", "POST", FP32, _input("FP32", [3], [1, 2]), {}, "parse"),
    ("ragged nesting", "POST", FP32, _input("FP32", [2, 2], [[1, 2], [3]]), {}, "parse"),
    ("bytes as null", "POST", BYTES, _input("BYTES", [1], [None]), {}, "parse"),
    ("bytes as int", "POST", BYTES, _input("BYTES", [1], [5]), {}, "parse"),
    ("bytes utf-8", "POST", BYTES, _input("BYTES", [2], ["hé", "a\"b\\c\n\u0001"]), {}, "same"),
    ("bytes not utf-8", "POST", BYTES, *_bytes_body(b"\xff\xfe", b"ok"), "same"),
    ("shape of floats", "POST", FP32, _input("FP32", [1.5, 4], [1] * 6), {}, "parse"),
    ("shape 1e30", "POST", FP32, b'{"inputs":[{"name":"INPUT0","shape":[1e30],"datatype":"FP32","data":[1]}]}', {},
     "parse"),
    ("negative shape", "POST", FP32, _input("FP32", [-1], [1]), {}, "parse"),
    ("shape of bools", "POST", FP32, _input("FP32", [True], [1]), {}, "parse"),
    ("no shape", "POST", FP32, b'{"inputs":[{"name":"INPUT0","datatype":"FP32","data":[1]}]}', {}, "parse"),
    ("no datatype", "POST", FP32, b'{"inputs":[{"name":"INPUT0","shape":[1],"data":[1]}]}', {}, "parse"),
    ("no name", "POST", FP32, b'{"inputs":[{"shape":[1],"datatype":"FP32","data":[1]}]}', {}, "parse"),
    ("data an object", "POST", FP32, b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":{}}]}', {},
     "parse"),
    ("no data", "POST", FP32, b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32"}]}', {}, "same"),
    ("data and binary", "POST", FP32, b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1],'
     b'"parameters":{"binary_data_size":4}}]}', {}, "same"),
    ("unknown datatype", "POST", FP32, _input("FP99", [1], [1]), {}, "same"),
    ("fp16 as json", "POST", FP32, _input("FP16", [1], [1]), {}, "same"),
    ("the model's datatype refused", "POST", FP32, _input("INT64", [1], [1]), {}, "same"),
    ("no inputs", "POST", FP32, b"{}", {}, "parse"),
    ("inputs an object", "POST", FP32, b'{"inputs":{"a":1}}', {}, "parse"),
    ("empty inputs", "POST", FP32, b'{"inputs":[]}', {}, "same"),
    ("id a number", "POST", FP32, b'{"id":5,"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}]}',
     {}, "parse"),
    ("parameters a string", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}],"parameters":"x"}', {}, "parse"),
    ("outputs an object", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}],"outputs":{}}', {}, "parse"),
    ("an output without name", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}],"outputs":[{"nom":"x"}]}', {}, "parse"),
    ("an unknown output", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}],"outputs":[{"name":"NOPE"}]}', {},
     "same"),
    ("binary_data_output not a bool", "POST", FP32,
     b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}],"parameters":{"binary_data_output":1}}',
     {}, "parse"),
    ("binary_data_output with listed outputs", "POST", PAIR,
     json.dumps({"inputs": PAIR_INPUTS, "outputs": [{"name": "INPUT0_OUT"}, {"name": "INPUT1_OUT"}],
                 "parameters": {"binary_data_output": True}}).encode(), {}, "same"),
    ("binary_data per output", "POST", PAIR,
     json.dumps({"inputs": PAIR_INPUTS, "outputs": [{"name": "INPUT0_OUT", "parameters": {"binary_data": True}},
                                                    {"name": "INPUT1_OUT"}]}).encode(), {}, "same"),
    ("binary_data_output", "POST", PAIR,
     json.dumps({"inputs": PAIR_INPUTS, "parameters": {"binary_data_output": True}}).encode(), {}, "same"),
    ("raw binary body", "POST", FP32, np.array([1.5, 2.5], np.float32).tobytes(),
     {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"}, "same"),
    ("gzip", "POST", FP32, _input("FP32", [3], [1, 2, 3]), {"Accept-Encoding": "gzip"}, "same"),
    ("deflate first", "POST", FP32, _input("FP32", [3], [1, 2, 3]), {"Accept-Encoding": "deflate, gzip"}, "same"),
    ("gzip first", "POST", FP32, _input("FP32", [3], [1, 2, 3]), {"Accept-Encoding": "gzip, deflate"}, "same"),
    ("gzip refused by q", "POST", FP32, _input("FP32", [3], [1, 2, 3]), {"Accept-Encoding": "gzip;q=0"}, "same"),
    ("br only", "POST", FP32, _input("FP32", [3], [1, 2, 3]), {"Accept-Encoding": "br"}, "same"),
    ("binary gzip", "POST", PAIR, json.dumps({"inputs": PAIR_INPUTS, "parameters": {"binary_data_output": True}}
                                             ).encode(), {"Accept-Encoding": "gzip"}, "same"),
    ("unknown model", "POST", "/v2/models/nope/infer", _input("FP32", [1], [1]), {}, "json"),
    ("unknown model metadata", "GET", "/v2/models/nope", None, {}, "same"),
    ("unknown model ready", "GET", "/v2/models/nope/ready", None, {}, "same"),
    ("model metadata", "GET", "/v2/models/echo_pair", None, {}, "same"),
    ("model config", "GET", "/v2/models/echo_pair/config", None, {}, "same"),
    ("server metadata", "GET", "/v2", None, {}, "same"),
    ("a wrong method", "DELETE", "/v2/health/ready", None, {}, "same"),
    ("an unknown route", "GET", "/nope", None, {}, "same"),
    ("an Upgrade request", "GET", "/v2/health/ready", None, {"Connection": "Upgrade", "Upgrade": "websocket"},
     "same"),
    # Triton answers this client mistake 200 with only an error in the body; the gateway makes it the 400 it is
    ("generate on a decoupled model", "POST", "/v2/models/stream/generate",
     json.dumps({"text_input": "hi", "count": 2}).encode(), {}, "error-200"),
    ("generate_stream", "POST", "/v2/models/stream/generate_stream",
     json.dumps({"text_input": "hi", "count": 3}).encode(), {}, "same"),
]


@pytest.mark.parametrize("case,method,path,body,headers,kind", PARITY, ids=[p[0] for p in PARITY])
def test_the_gateway_answers_as_triton_does(parity_gateway, gateway_server, case, method, path, body, headers, kind):
    direct = _http(gateway_server.http_port, method, path, body, headers)
    through = _http(parity_gateway.http_port, method, path, body, headers)
    if kind in ("parse", "error-200"):  # a client's mistake Triton answers 500 or 200: the gateway's 400, same error
        assert direct[0] == (500 if kind == "parse" else 200) and through[0] == 400, (direct, through)
        assert json.loads(through[2])["error"] == json.loads(direct[2])["error"]
        return
    assert through[0] == direct[0], (direct, through)
    assert through[1].get("content-encoding") == direct[1].get("content-encoding")
    if kind == "json":
        assert (direct[1]["content-type"], through[1]["content-type"]) == ("text/plain", "application/json")
    else:
        assert through[1].get("content-type", "").split(";")[0] == direct[1].get("content-type", "").split(";")[0]
    assert decoded_body(*through[1:]) == decoded_body(*direct[1:]), (direct, through)
    if case != "an Upgrade request":  # twice: the second answer may come from the cache
        assert decoded_body(*_http(parity_gateway.http_port, method, path, body, headers)[1:]) == \
            decoded_body(*direct[1:])


def test_forwarded_headers_reach_the_model_and_separate_cache_entries(parity_gateway, gateway_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    def params(module, url, headers):
        client = module.InferenceServerClient(url)
        try:
            x = module.InferInput("INPUT0", [1], "FP32")
            x.set_data_from_numpy(np.array([1], np.float32))
            out = client.infer("params", [x], headers=headers).as_numpy("PARAMS")
            return json.loads(out[0])
        finally:
            client.close()

    for module, direct, through in ((httpclient, gateway_server.http_url, parity_gateway.http_url),
                                    (grpcclient, gateway_server.grpc_url, parity_gateway.grpc_url)):
        for headers in ({"x-fwd-tag": "a", "x-other": "z"}, {"x-fwd-tag": "b"}, {"x-fwd-tag": "a"}, {}):
            expected = params(module, direct, headers)
            assert params(module, through, headers) == expected, (module.__name__, headers)
            assert expected.get("x-fwd-tag") == headers.get("x-fwd-tag") and "x-other" not in expected


def test_files_changed_under_a_loaded_version_never_mix(gateway_repo, redis_server, tmp_path):
    """The cache follows what Triton serves: a file replaced in place under a loaded version changes nothing Triton
    answers until it loads the version again, so results are not cached meanwhile (neither under the old files'
    namespace nor the new one); once Triton has loaded it again, caching resumes under the new files' namespace."""
    import tritonclient.http as httpclient

    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    repo = tmp_path / "repo"
    shutil.copytree(gateway_repo / "scaled", repo / "scaled")
    scale = repo / "scaled" / "1" / "scale.txt"
    scale.write_text("2")
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), tmp_path / "t.log",
                       extra_args=["--model-control-mode=explicit", "--load-model=*"])
    direct = httpclient.InferenceServerClient(srv.http_url)
    config = {"upstreams": [srv.http_url], "upstreams_grpc": [srv.grpc_url], "cache": redis_server.url,
              "repository": str(repo), "version_check_interval": 0.2}
    gateways = [GatewayProcess(tmp_path / "gw.log", config=config)]

    def scaled(x: float, gw=None) -> float:
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [x]}]}).encode()
        status, _, answer = _http((gw or gateways[0]).http_port, "POST", "/v2/models/scaled/infer", body)
        assert status == 200, answer
        return json.loads(answer)["outputs"][0]["data"][0]

    def ran(at_least: int | None = None) -> int:
        """Inferences Triton ran (Triton counts one as it releases the request, just after its answer): with
        `at_least`, read again until the count is that (a deadline against a hang; more is returned at once)."""
        def count() -> int:
            return sum(int(s["inference_count"]) for s in direct.get_inference_statistics("scaled")["model_stats"])
        if at_least is not None:
            return eventually(count, lambda n: n >= at_least)
        time.sleep(0.1)
        return count()

    try:
        assert scaled(1) == 2
        n = ran()
        assert scaled(1) == 2 and ran() == n  # cached
        scale.write_text("3")  # in place: Triton still serves scale 2
        time.sleep(0.5)
        assert scaled(5) == 10
        n = ran()
        assert scaled(5) == 10 and ran(n + 1) == n + 1  # not cached while the files differ from what Triton loaded
        direct.load_model("scaled")  # Triton loads it again (not through the gateway): now it serves scale 3
        time.sleep(0.5)
        assert scaled(5) == 15  # the answer of the old weights was not kept under the new files' namespace
        n = ran()
        assert scaled(5) == 15 and ran() == n  # cached again, under the new files' namespace
        gateways.append(GatewayProcess(tmp_path / "gw2.log", config=config))  # a restart, same Redis
        assert scaled(5, gateways[1]) == 15 and scaled(1, gateways[1]) == 3
        scale.write_text("4")  # changed again; then loaded through the gateway: caching resumes at once
        httpclient.InferenceServerClient(gateways[1].http_url).load_model("scaled")
        assert scaled(7, gateways[1]) == 28
        n = ran()
        assert scaled(7, gateways[1]) == 28 and ran() == n
    finally:
        for gw in gateways:
            gw.stop()
        direct.close()
        srv.stop()


def test_streams_arrive_part_by_part(gateway):
    """generate_stream's server-sent events and a decoupled model's gRPC responses reach the client as the model
    sends them, not gathered into one answer at the end."""
    import socket

    import tritonclient.grpc as grpc

    body = json.dumps({"text_input": "hi", "count": 4, "parameters": {"delay_ms": 400}}).encode()
    sock = socket.create_connection(("127.0.0.1", gateway.http_port), timeout=30)
    sock.sendall(b"POST /v2/models/stream/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    started, seen, received = time.monotonic(), [], b""
    while len(seen) < 4:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
        while received.count(b"data: ") > len(seen):
            seen.append(time.monotonic() - started)
    sock.close()
    assert b"hi 3" in received and seen[-1] - seen[0] > 0.8, (seen, received)

    c = grpc.InferenceServerClient(gateway.grpc_url)
    answers: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((time.monotonic(), result, error)))
    text, count = grpc.InferInput("text_input", [1], "BYTES"), grpc.InferInput("count", [1], "INT32")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    count.set_data_from_numpy(np.array([4], np.int32))
    started = time.monotonic()
    c.async_stream_infer("stream", [text, count], parameters={"delay_ms": 400})
    arrivals = []
    for i in range(4):
        at, result, error = answers.get(timeout=30)
        assert error is None and result.as_numpy("text_output")[0] == f"hi {i}".encode()
        arrivals.append(at - started)
    c.stop_stream()
    c.close()
    assert arrivals[-1] - arrivals[0] > 0.8, arrivals


def test_several_workers_share_the_ports_the_cache_and_the_metrics(gateway_server, redis_server, session_tmp):
    """--workers 2: two processes answer on one HTTP and one gRPC port; what one stored the other serves (Redis);
    /metrics counts both; a worker that dies is replaced and clients are still answered; SIGTERM stops all."""
    import psutil
    import tritonclient.grpc as grpc

    def running_workers() -> list:
        return [p for p in psutil.Process(gw.proc.pid).children() if p.is_running() and
                p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]

    gw = GatewayProcess(session_tmp / "gateway-workers.log",
                        config={"upstreams": [gateway_server.http_url], "upstreams_grpc": [gateway_server.grpc_url],
                                "cache": redis_server.url, "workers": 2})
    try:
        workers = running_workers()
        assert len(workers) == 2
        for k in range(40):  # new connections each time: the kernel spreads them over both workers
            status, _, body = _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer",
                                    ECHO_BODY.replace(b"2.5", str(k % 4).encode()))
            assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.5, float(k % 4)], body
        assert gw.metric("dstool_gateway_cache_misses_total", model="echo_fp32") == 4
        assert gw.metric("dstool_gateway_cache_hits_total", model="echo_fp32") == 36
        c = grpc.InferenceServerClient(gw.grpc_url)
        x = grpc.InferInput("INPUT0", [2], "FP32")
        x.set_data_from_numpy(np.array([1.0, 3.0], np.float32))
        assert c.infer("echo_fp32", [x]).as_numpy("INPUT0_OUT").tolist() == [1.0, 3.0]
        c.close()
        workers[0].kill()
        wait_for(lambda: len(running_workers()) == 2 and "worker 0" in gw.log.read_text(), "a new worker", 30)
        for _ in range(10):
            assert _http(gw.http_port, "POST", "/v2/models/echo_fp32/infer", ECHO_BODY)[0] == 200
        workers = running_workers()
    finally:
        assert gw.stop() == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
