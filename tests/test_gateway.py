"""The cache gateway (issue #5) on real processes: a redis-server started here, a real Triton 2.51 on a
repository made by `dstool export`, the gateway as its own process, and the unmodified tritonclient."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dstool.proc import free_port

from conftest import DSTOOL, dstool
from gatewaylib import GatewayProcess, RedisServer, eventually, wait_for

MODEL = "dstool_lm"


@pytest.fixture
def server(gateway_server):
    return gateway_server


def test_cache_key_covers_what_changes_a_result_and_nothing_else():
    from dstool.serve.gateway.cache.digests import cache_key
    from dstool.serve.gateway.tensors import InferRequest, Tensor

    def key(inputs=((b"\x01" * 8, "a"), (b"\x02" * 8, "b")), outputs=None, parameters=None, version="1",
            fingerprint="f", datatype="INT64", shape=(1, 1)):
        tensors = [Tensor(name, datatype, shape, raw) for raw, name in inputs]
        return cache_key(fingerprint, version, InferRequest("m", "", tensors, outputs, parameters or {}), ["y", "z"])

    base = key()
    assert key(inputs=((b"\x02" * 8, "b"), (b"\x01" * 8, "a"))) == base  # input order does not matter
    assert key(outputs=[("z", {"binary_data": True}), ("y", {})]) == base  # all outputs, format aside
    assert key(parameters={"binary_data_output": True, "priority": 2, "timeout": 5}) == base
    changed = {key(inputs=((b"\x01" * 8, "a"), (b"\x03" * 8, "b"))), key(outputs=[("y", {})]),
               key(outputs=[("y", {"classification": 3}), ("z", {})]), key(parameters={"temperature": 0.5}),
               key(version="2"), key(fingerprint="g"), key(datatype="FP64"), key(shape=(1, 1, 1))}
    assert base not in changed and len(changed) == 8


def test_stored_entries_round_trip_and_damage_is_detected():
    from dstool.serve.gateway.cache.store import CorruptEntry, decode, encode
    from dstool.serve.gateway.tensors import InferResult, Tensor

    result = InferResult("m", "3", [Tensor("logits", "FP32", (1, 2), np.array([[1.5, -2.0]], np.float32).tobytes()),
                                    Tensor("text", "BYTES", (1,), b"\x02\x00\x00\x00hi")], {"p": 1})
    blob = encode(result, 123.5)
    assert decode(blob) == (result, 123.5)
    for damaged in (blob[:-1], blob[:20], b"", b"DSG1" + blob[4:10], blob[:30] + bytes([blob[30] ^ 1]) + blob[31:]):
        with pytest.raises(CorruptEntry):
            decode(damaged)


def api_gateway(server, log: Path, **config) -> GatewayProcess:
    return GatewayProcess(log, config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                       "version_check_interval": 0.5, **config})


def ids_for(seed: int, length: int = 8) -> np.ndarray:
    return (np.arange(length, dtype=np.int64)[None] * 37 + seed * 101) % 4000 + 1


def make_inputs(client, ids: np.ndarray, binary: bool = True):
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        t = client.InferInput(name, list(value.shape), "INT64")
        if client.__name__.startswith("tritonclient.http"):
            t.set_data_from_numpy(value, binary_data=binary)
        else:
            t.set_data_from_numpy(value)
        inputs.append(t)
    return inputs


def infer(protocol: str, url: str, ids: np.ndarray, *, outputs: bool = True, **kwargs):
    """(logits, model_version) from tritonclient; protocol is http-binary, http-json or grpc."""
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    client = grpc if protocol == "grpc" else http
    binary = protocol != "http-json"
    c = client.InferenceServerClient(url)
    try:
        wanted = None
        if outputs:
            wanted = [grpc.InferRequestedOutput("logits") if client is grpc
                      else http.InferRequestedOutput("logits", binary_data=binary)]
        result = c.infer(MODEL, make_inputs(client, ids, binary), outputs=wanted, **kwargs)
        response = result.get_response(as_json=True) if client is grpc else result.get_response()
        return result.as_numpy("logits"), str(response["model_version"])
    finally:
        c.close()


def triton_inferences(server, at_least: int = 0, model: str = MODEL) -> int:
    """Inferences Triton itself ran for the model (all versions), from its statistics, which Triton updates
    just after answering: read until two reads 50 ms apart agree and reach `at_least` (or 5 s pass)."""
    import tritonclient.http as http

    c = http.InferenceServerClient(server.http_url)
    deadline, last = time.time() + 5, None
    try:
        while True:
            count = sum(int(s["inference_count"]) for s in c.get_inference_statistics(model)["model_stats"])
            if (count == last and count >= at_least) or time.time() > deadline:
                return count
            last = count
            time.sleep(0.05)
    finally:
        c.close()


def test_gateway_matches_triton_and_repeats_are_hits_across_protocols(server, gateway):
    ids = ids_for(1)
    direct, _ = infer("http-binary", server.http_url, ids)
    before = triton_inferences(server)
    first, _ = infer("http-binary", gateway.http_url, ids)  # the miss
    assert triton_inferences(server, before + 1) == before + 1
    for protocol, url in (("http-binary", gateway.http_url), ("http-json", gateway.http_url),
                          ("grpc", gateway.grpc_url)):
        for outputs in (True, False):  # naming no outputs means all of them: the same entry
            logits, _ = infer(protocol, url, ids, outputs=outputs)
            assert logits.dtype == np.float32 and np.array_equal(logits, direct), protocol
    assert np.array_equal(first, direct)
    assert triton_inferences(server, before + 1) == before + 1  # every repeat, in every protocol, was a hit
    assert gateway.metric("dstool_gateway_cache_hits_total", model=MODEL) >= 6
    assert gateway.metric("dstool_gateway_cache_misses_total", model=MODEL, protocol="http") >= 1
    infer("grpc", gateway.grpc_url, ids_for(2))  # new inputs: a miss
    assert triton_inferences(server, before + 2) == before + 2


def test_everything_else_is_relayed_unchanged(server, gateway):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    for client, kind in ((http, "http"), (grpc, "grpc")):
        direct = client.InferenceServerClient(getattr(server, f"{kind}_url"))
        through = client.InferenceServerClient(getattr(gateway, f"{kind}_url"))
        try:
            assert through.is_server_live() and through.is_server_ready() and through.is_model_ready(MODEL)
            as_json = {"as_json": True} if client is grpc else {}
            for call, args in (("get_server_metadata", ()), ("get_model_metadata", (MODEL,)),
                               ("get_model_config", (MODEL,)), ("get_model_repository_index", ())):
                assert getattr(through, call)(*args, **as_json) == getattr(direct, call)(*args, **as_json), call
            stats = through.get_inference_statistics(MODEL, **as_json)
            assert stats["model_stats"][0]["name"] == MODEL
            assert not through.is_model_ready("no_such_model")
        finally:
            direct.close()
            through.close()


def test_grpc_stream_infer_is_relayed(server, gateway):
    import queue

    import tritonclient.grpc as grpc

    ids = ids_for(11)
    expected, _ = infer("grpc", server.grpc_url, ids)
    c = grpc.InferenceServerClient(gateway.grpc_url)
    answers = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(3):
            c.async_stream_infer(MODEL, make_inputs(grpc, ids), request_id=str(i))
        for _ in range(3):
            result, error = answers.get(timeout=60)
            assert error is None and np.array_equal(result.as_numpy("logits"), expected)
    finally:
        c.stop_stream()
        c.close()


def test_requests_that_opt_out_are_never_cached(server, gateway):
    ids = ids_for(3)
    before = triton_inferences(server)
    for _ in range(2):
        infer("http-binary", gateway.http_url, ids, headers={"Cache-Control": "no-store"})
        infer("grpc", gateway.grpc_url, ids, headers={"cache-control": "no-cache"})
    assert triton_inferences(server, before + 4) == before + 4


def test_sampling_without_a_seed_is_never_cached(server, gateway):
    """A request that asks a generation model to sample without a seed is a new draw each time: it always reaches
    Triton; with a seed (or greedy) it is a function of the request and is cached, the seed part of the key."""
    import tritonclient.grpc as grpc

    c = grpc.InferenceServerClient(gateway.grpc_url)
    x = grpc.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.array([4.25], np.float32))
    runs = {}
    try:
        for name, parameters in (("temperature", {"temperature": 0.8}), ("top_p", {"top_p": 0.9}),
                                 ("seeded", {"temperature": 0.8, "seed": 5}), ("other seed", {"temperature": 0.8,
                                                                                             "seed": 6}),
                                 ("greedy", {"temperature": 0, "top_k": 4})):
            before = triton_inferences(server, model="params")
            answers = {c.infer("params", [x], parameters=parameters).as_numpy("PARAMS")[0] for _ in range(3)}
            assert len(answers) == 1
            runs[name] = triton_inferences(server, model="params") - before
    finally:
        c.close()
    assert runs == {"temperature": 3, "top_p": 3, "seeded": 1, "other seed": 1, "greedy": 1}, runs


def test_entries_live_in_redis_shared_by_gateways_and_bad_ones_are_recomputed(server, gateway, redis_server,
                                                                             session_tmp):
    ids = ids_for(4)
    r = redis_server.client()
    expected, _ = infer("grpc", gateway.grpc_url, ids)  # stored by the main gateway, in the background
    wait_for(lambda: any(holds(r.get(k), expected) for k in r.keys("dstool:gw:1:dstool_lm:*")), "the entry in Redis")
    keys = [k for k in r.keys("dstool:gw:1:dstool_lm:*") if holds(r.get(k), expected)]  # this test's, not others'
    assert keys and all(0 < r.ttl(k) <= 600 for k in keys)
    second = api_gateway(server, session_tmp / "gateway-second.log", cache=redis_server.url)
    try:
        before = triton_inferences(server)
        logits, _ = infer("http-json", second.http_url, ids)  # another process, same Redis: a hit
        assert np.array_equal(logits, expected) and triton_inferences(server) == before
        assert second.metric("dstool_gateway_cache_hits_total") == 1
    finally:
        second.stop()
    for k in keys:  # damage every entry: garbage, and a truncated copy of a real one
        value = r.get(k)
        r.set(k, b"not an entry" if k == keys[0] else value[: len(value) // 2], keepttl=True)
    third = api_gateway(server, session_tmp / "gateway-third.log", cache=redis_server.url)
    try:
        before = triton_inferences(server)
        logits, _ = infer("grpc", third.grpc_url, ids)
        assert np.array_equal(logits, expected) and triton_inferences(server, before + 1) == before + 1  # recomputed
        assert third.metric("dstool_gateway_errors_total", kind="corrupt_entry") >= 1
    finally:
        third.stop()  # waits for its background Redis writes
    assert any(holds(r.get(k), expected) for k in r.keys("dstool:gw:1:dstool_lm:*"))  # replaced by a good entry


def holds(value: bytes | None, expected: np.ndarray) -> bool:
    """Whether a Redis value decodes to a result whose first output equals `expected`."""
    from dstool.serve.gateway.cache.store import CorruptEntry, decode

    try:
        result = decode(value or b"")[0]
    except CorruptEntry:
        return False
    values = np.frombuffer(result.outputs[0].raw, np.float32)  # another test's entry may hold another shape
    return values.size == expected.size and np.array_equal(values.reshape(expected.shape), expected)


def test_entries_expire_after_the_ttl(server, redis_server, session_tmp):
    """Within the TTL a repeat is a hit; after it, the entry is gone and the request computed again. The TTL (5 s) is
    long beside two small requests however loaded the machine; its end is waited for, not slept for."""
    ttl = 5.0
    gw = api_gateway(server, session_tmp / "gateway-ttl.log", cache=redis_server.url, cache_ttl=ttl)
    try:
        ids = ids_for(5)
        before = triton_inferences(server)
        started = time.monotonic()  # before the entry was made: its TTL runs from after this
        infer("http-binary", gw.http_url, ids)
        infer("http-binary", gw.http_url, ids)
        assert time.monotonic() - started < ttl, "the two requests took longer than the TTL: nothing was shown"
        assert triton_inferences(server, before + 1) == before + 1
        time.sleep(ttl)  # the TTL is over (the entry was made after `started`); whatever is kept goes in its time

        def computed_again() -> int:
            infer("http-binary", gw.http_url, ids)
            return triton_inferences(server)
        assert eventually(computed_again, lambda n: n > before + 1) == before + 2
    finally:
        gw.stop()


def test_rediss_tls_url(server, session_tmp):
    rds = RedisServer(session_tmp / "redis-tls", password="pw", tls=True)
    gw = api_gateway(server, session_tmp / "gateway-tls.log", cache=rds.url)
    try:
        assert "cache: Redis rediss://***@127.0.0.1" in gw.log.read_text()
        before = triton_inferences(server)
        expected, _ = infer("grpc", gw.grpc_url, ids_for(10))
        assert triton_inferences(server, before + 1) == before + 1
        gw.stop()  # waits for its background Redis writes
        assert any(holds(rds.client().get(k), expected) for k in rds.client().keys("dstool:gw:1:*"))
    finally:
        gw.stop()
        rds.stop()


def test_without_redis_an_in_process_cache_with_a_warning(server, session_tmp):
    dead = free_port()
    log = session_tmp / "gateway-memory.log"
    os.environ["DSTOOL_REDIS_URL"] = f"redis://127.0.0.1:{dead}/0"
    try:
        gw = api_gateway(server, log)
    finally:
        del os.environ["DSTOOL_REDIS_URL"]
    try:
        assert "in-process LRU cache" in log.read_text()
        before = triton_inferences(server)
        infer("grpc", gw.grpc_url, ids_for(6))
        infer("http-binary", gw.http_url, ids_for(6))
        assert triton_inferences(server, before + 1) == before + 1
    finally:
        gw.stop()


async def load(gw, sequences: list, n: int, on_progress, concurrency: int = 12) -> list[tuple[int, np.ndarray]]:
    """`n` requests for the sequences in turn, alternating HTTP and gRPC, `concurrency` at a time; (sequence
    index, logits) for each; `on_progress(done)` after each answer."""
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http.aio as http_aio

    grpc_client = grpc_aio.InferenceServerClient(gw.grpc_url)
    http_client = http_aio.InferenceServerClient(gw.http_url)
    done, results = 0, []
    gate = asyncio.Semaphore(concurrency)

    async def one(k: int):
        nonlocal done
        i = k % len(sequences)
        client, module = (grpc_client, grpc_aio) if k % 2 else (http_client, http_aio)
        async with gate:
            result = await client.infer(MODEL, make_inputs(module, sequences[i]))
        results.append((i, result.as_numpy("logits")))
        done += 1
        on_progress(done)

    try:
        await asyncio.gather(*(one(k) for k in range(n)))
    finally:
        await grpc_client.close()
        await http_client.close()
    return results


def test_redis_killed_or_frozen_under_load_fails_no_request(server, session_tmp):
    rds = RedisServer(session_tmp / "redis-failing", password="s3cret")  # a password URL, too
    gw = api_gateway(server, session_tmp / "gateway-failing.log", cache=rds.url, redis_timeout=0.05)
    sequences = [ids_for(100 + i, 4 + i % 5) for i in range(120)]  # 120 misses (Redis killed after 40), 120 hits
    reference = {i: infer("grpc", server.grpc_url, s)[0] for i, s in enumerate(sequences)}

    try:
        killed = []
        results = asyncio.run(load(gw, sequences, 240,
                                   lambda done: done == 40 and not killed and (rds.kill(), killed.append(1))))
        assert killed and len(results) == 240
        assert all(np.array_equal(logits, reference[i]) for i, logits in results)
        assert gw.metric("dstool_gateway_errors_total", kind="redis") >= 1

        rds.start()  # back on the same port: the gateway reconnects by itself
        fresh_inputs = iter(range(1000, 10**6))
        wait_for(lambda: infer("http-binary", gw.http_url, ids_for(next(fresh_inputs))) and rds.client().dbsize() > 0,
                 "the gateway to write to the restarted Redis", 15)

        fresh = [ids_for(300 + k) for k in range(10)]  # not in the gateway's front LRU: each asks Redis first
        expected = [infer("grpc", server.grpc_url, s)[0] for s in fresh]
        os.kill(rds.proc.pid, signal.SIGSTOP)  # a Redis that stops answering: timeouts, not failures
        try:
            started = time.perf_counter()
            for k, s in enumerate(fresh):
                logits, _ = infer("grpc" if k % 2 else "http-binary", gw.grpc_url if k % 2 else gw.http_url, s)
                assert np.array_equal(logits, expected[k])
            assert time.perf_counter() - started < 10
        finally:
            os.kill(rds.proc.pid, signal.SIGCONT)
    finally:
        gw.stop()
        rds.stop()


def test_two_hundred_malformed_requests_get_4xx_kserve_errors(server, gateway):
    import grpc
    import tritonclient.grpc as tgrpc
    from tritonclient.grpc import service_pb2

    good_header = {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]},
                              {"name": "attention_mask", "shape": [1, 4], "datatype": "INT64", "data": [1, 1, 1, 1]}]}
    raw = np.arange(4, dtype=np.int64).tobytes()
    binary_header = json.dumps({"inputs": [
        {"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "parameters": {"binary_data_size": 32}},
        {"name": "attention_mask", "shape": [1, 4], "datatype": "INT64", "parameters": {"binary_data_size": 32}}]})

    def variant(i: int) -> tuple[str, bytes, dict]:
        path = f"/v2/models/{MODEL}/infer"
        kind = i % 10
        if kind == 0:
            return path, b'{"inputs": [' + str(i).encode(), {}  # bad JSON
        if kind == 1:
            h = json.loads(json.dumps(good_header))
            h["inputs"][0]["shape"] = [1, 3 + i % 4 * 2]  # data count does not fit the shape
            return path, json.dumps(h).encode(), {}
        if kind == 2:
            h = json.loads(json.dumps(good_header))
            for t in h["inputs"]:
                t["datatype"] = ["INT32", "FP32", "BOOL"][i % 3]  # a dtype the model does not take
            return path, json.dumps(h).encode(), {}
        if kind == 3:  # truncated binary payload
            body = binary_header.encode() + raw + raw[: i % 31]
            return path, body, {"Inference-Header-Content-Length": str(len(binary_header))}
        if kind == 4:  # header length pointing past the body
            return path, binary_header.encode(), {"Inference-Header-Content-Length": str(10_000 + i)}
        if kind == 5:
            return path, b"x" * ((1 << 20) + 1 + i), {}  # over --max-request-bytes
        if kind == 6:
            return f"/v2/models/no_such_model_{i}/infer", json.dumps(good_header).encode(), {}
        if kind == 7:
            return path, json.dumps({"inputs": []}).encode(), {}
        if kind == 8:
            h = json.loads(json.dumps(good_header))
            h["inputs"][0]["data"] = ["a", "b", "c", "d"]  # strings for INT64
            return path, json.dumps(h).encode(), {}
        h = json.loads(json.dumps(good_header))
        h["inputs"][1]["shape"] = [1, -4]
        return path, json.dumps(h).encode(), {}

    for i in range(200):
        path, body, headers = variant(i)
        conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        payload = json.loads(response.read())
        conn.close()
        assert 400 <= response.status < 500, (i, response.status, payload)
        assert isinstance(payload.get("error"), str) and payload["error"], (i, payload)

    channel = grpc.insecure_channel(gateway.grpc_url)
    model_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    bad_shape = service_pb2.ModelInferRequest(model_name=MODEL)
    bad_shape.inputs.add(name="input_ids", datatype="INT64", shape=[1, 5])
    bad_shape.raw_input_contents.append(raw)
    unknown = service_pb2.ModelInferRequest(model_name="no_such_model")
    unknown.inputs.add(name="x", datatype="INT64", shape=[1, 4])
    unknown.raw_input_contents.append(raw)
    for payload in [b"\xff\x00garbage" * (1 + k) for k in range(10)] + [bad_shape.SerializeToString(),
                                                                        unknown.SerializeToString()] * 5:
        with pytest.raises(grpc.RpcError) as e:
            model_infer(payload, timeout=30)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), e.value
    channel.close()

    assert gateway.proc.poll() is None  # still serving
    logits, _ = infer("http-json", gateway.http_url, ids_for(7))
    assert logits.shape == (1, 8, 4096)
    c = tgrpc.InferenceServerClient(gateway.grpc_url)
    assert c.is_server_ready()
    c.close()


def test_bearer_token_on_both_protocols(server, redis_server, session_tmp):
    import tritonclient.grpc as grpc
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    gw = api_gateway(server, session_tmp / "gateway-token.log", cache=redis_server.url, token="t0ken")
    try:
        for protocol, url in (("http-binary", gw.http_url), ("grpc", gw.grpc_url)):
            with pytest.raises(InferenceServerException, match="bearer token"):
                infer(protocol, url, ids_for(8))
            with pytest.raises(InferenceServerException, match="bearer token"):
                infer(protocol, url, ids_for(8), headers={"authorization": "Bearer wrong"})
            logits, _ = infer(protocol, url, ids_for(8), headers={"authorization": "Bearer t0ken"})
            assert logits.shape == (1, 8, 4096)
        for client, url in ((http, gw.http_url), (grpc, gw.grpc_url)):  # health stays open for probes
            c = client.InferenceServerClient(url)
            assert c.is_server_ready()
            with pytest.raises(InferenceServerException):
                c.get_model_metadata(MODEL)
            c.close()
    finally:
        gw.stop()


def test_bad_gateway_options_are_one_line_errors(server, gateway):
    from pydantic import ValidationError

    from dstool.serve.gateway import GatewayConfig

    for cache, needle in (("memcached://127.0.0.1:1", "unknown scheme"), ("redis://:pw@/0", "names no host"),
                          ("redis://127.0.0.1:6379/x", "database")):
        with pytest.raises(ValidationError, match=needle):
            GatewayConfig(upstreams=[server.http_url], cache=cache)
    for args, needle in ((["--cache", "redis://127.0.0.1:notaport/0"], "port"),
                         (["--cache", "memory", "--http-port", str(gateway.http_port)], "already in use")):
        proc = dstool("gateway", "--upstream", server.http_url, *args, check=False, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr


@pytest.mark.slow
def test_serve_with_cache_then_dstool_infer(gateway_repo, redis_server, session_tmp):
    http_port, grpc_port = free_port(), free_port()
    log = session_tmp / "serve-cache.log"
    out = open(log, "w")
    proc = subprocess.Popen([*DSTOOL, "serve", "--repository", str(gateway_repo), "--cache", redis_server.url,
                             "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port",
                             str(free_port()), "--log-file", str(session_tmp / "serve-cache-triton.log"),
                             "--cache-config", f"local,size={1 << 20}"],
                            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.time() + 120
        while "gateway: ready" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        internal = SimpleNamespace(http_url=log.read_text().split("internal ports — HTTP ")[1].split(",")[0])
        before = triton_inferences(internal)
        answers = [dstool("infer", "--ids", "5,17,300,42", "--protocol", protocol, "--url",
                          f"127.0.0.1:{port}").stdout for protocol, port in (("http", http_port), ("grpc", grpc_port))]
        assert answers[0] == answers[1] and "greedy next token" in answers[0]
        assert triton_inferences(internal, before + 1) == before + 1  # Triton, behind the gateway, ran it once
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        out.close()
    assert "Triton stopped (exit code 0)" in log.read_text()
    assert "Creating TritonCache with name: 'local'" in (session_tmp / "serve-cache-triton.log").read_text()


def test_a_new_model_version_misses(server, gateway, gateway_repo):
    import tritonclient.http as http

    ids = ids_for(9)
    _, version = infer("http-binary", gateway.http_url, ids)
    infer("http-binary", gateway.http_url, ids)
    new = str(int(version) + 1)
    shutil.copytree(gateway_repo / MODEL / version, gateway_repo / MODEL / new)  # deploy the next version
    c = http.InferenceServerClient(gateway.http_url)
    try:
        c.load_model(MODEL)  # through the gateway, like any repository call
        assert c.get_model_metadata(MODEL)["versions"] == [new]
    finally:
        c.close()
    before = triton_inferences(server)
    logits, served = infer("grpc", gateway.grpc_url, ids)
    assert served == new and triton_inferences(server, before + 1) == before + 1  # not the old version's entry
    infer("http-json", gateway.http_url, ids)
    assert triton_inferences(server, before + 1) == before + 1


def test_a_generate_answer_whose_fields_sort_before_the_id_keeps_them():
    """Triton writes a generate answer's fields sorted: an output named before "id" comes first. The gateway's own id
    is taken out all the same, the rest kept; an answer for another id is still refused."""
    import orjson

    from dstool.serve.gateway.generation import Answer
    from dstool.serve.gateway.tensors import GatewayError

    answer = Answer("m", "1", "gw-1", ours=True)
    fields = {"a_count": 2, "model_name": "m", "model_version": "1", "text_output": "x"}
    assert orjson.loads(answer.check(orjson.dumps({**fields, "id": "gw-1"}, option=orjson.OPT_SORT_KEYS))) == fields
    plain = b'{"model_name":"m","model_version":"1"}'
    assert answer.check(b'{"id":"gw-1",' + plain[1:]) == plain  # the id first: cut out, the bytes kept as they came
    assert answer.intact
    with pytest.raises(GatewayError):
        answer.check(orjson.dumps({**fields, "id": "gw-2"}, option=orjson.OPT_SORT_KEYS))
