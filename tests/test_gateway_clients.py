"""What Triton's own client examples do (src/python/examples of triton-inference-server/client: simple_*_client,
health/metadata, async, asyncio, strings, system shared memory, model control, sequences, decoupled streams,
compression, explicit gRPC contents, timeouts, cancellation), written here as scenarios with tritonclient and run
against Triton and through the caching gateway: each gives the same result both ways, and again once the
gateway's answers come from its cache. The models are our own python-backend ones shaped like the examples'."""

from __future__ import annotations

import asyncio
import queue
import uuid

import numpy as np
import pytest

from gatewaylib import wait_for

SCENARIOS: dict = {}


def scenario(fn=None, *, protocols=("http", "grpc")):
    """Register a client example run over each of `protocols` (a gRPC-only example is not a case over HTTP)."""
    def register(f):
        SCENARIOS[f.__name__] = (f, protocols)
        return f
    return register(fn) if fn else register


def _clients(protocol: str):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    return httpclient if protocol == "http" else grpcclient


def _error(e: Exception) -> tuple:
    from tritonclient.utils import InferenceServerException

    if isinstance(e, InferenceServerException):
        return "error", str(e.status()), e.message()
    raise e


def _simple_inputs(client, string: bool = False, batch: int = 1):
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    datatype = "BYTES" if string else "INT32"
    inputs = [client.InferInput("INPUT0", [batch, 16], datatype), client.InferInput("INPUT1", [batch, 16], datatype)]
    for tensor, value in zip(inputs, (a, b)):
        tensor.set_data_from_numpy(np.array([str(v).encode() for v in value.flat], dtype=np.object_).reshape(
            value.shape) if string else value)
    return inputs


def _as_json(protocol: str) -> dict:
    """The gRPC client's keyword for answers as dicts, like the HTTP client's."""
    return {"as_json": True} if protocol == "grpc" else {}


def _outputs(result, names=("OUTPUT0", "OUTPUT1")) -> dict:
    return {n: result.as_numpy(n).tolist() for n in names}


@scenario
def health_metadata(protocol, url):
    """simple_{http,grpc}_health_metadata: liveness, readiness, server and model metadata, configs, a missing model."""
    client = _clients(protocol).InferenceServerClient(url)
    as_json = _as_json(protocol)
    got = {"live": client.is_server_live(), "ready": client.is_server_ready(),
           "model_ready": client.is_model_ready("simple"), "missing_ready": client.is_model_ready("no_such_model"),
           "server": client.get_server_metadata(**as_json), "model": client.get_model_metadata("simple", **as_json),
           "config": client.get_model_config("simple", **as_json)}
    try:
        client.get_model_metadata("no_such_model")
    except Exception as e:
        got["missing"] = _error(e)
    client.close()
    return got


@scenario
def infer(protocol, url):
    """simple_{http,grpc}_infer_client: add/sub of two INT32 tensors; outputs listed, binary and not (HTTP)."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    outputs = [client.InferRequestedOutput("OUTPUT0"), client.InferRequestedOutput("OUTPUT1")]
    if protocol == "http":
        outputs = [client.InferRequestedOutput("OUTPUT0", binary_data=True),
                   client.InferRequestedOutput("OUTPUT1", binary_data=False)]
    got = [_outputs(c.infer("simple", _simple_inputs(client), outputs=outputs, request_id="1")),
           _outputs(c.infer("simple", _simple_inputs(client, batch=3))),
           c.infer("simple", _simple_inputs(client), request_id="my-id").get_response(**_as_json(protocol))["id"]]
    c.close()
    return got


@scenario
def infer_errors(protocol, url):
    """What the examples' models answer to a wrong input name, shape, datatype, version, or a missing input."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    wrong_name = _simple_inputs(client)
    wrong_name[1] = client.InferInput("INPUT9", [1, 16], "INT32")
    wrong_name[1].set_data_from_numpy(np.zeros((1, 16), np.int32))
    wrong_shape = [client.InferInput(n, [1, 15], "INT32") for n in ("INPUT0", "INPUT1")]
    wrong_type = [client.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for t in wrong_shape:
        t.set_data_from_numpy(np.zeros((1, 15), np.int32))
    for t in wrong_type:
        t.set_data_from_numpy(np.zeros((1, 16), np.float32))
    got = []
    for kwargs in ({"inputs": wrong_name}, {"inputs": wrong_shape}, {"inputs": wrong_type},
                   {"inputs": _simple_inputs(client)[:1]}, {"inputs": _simple_inputs(client), "model_version": "7"},
                   {"inputs": _simple_inputs(client, batch=9)}):
        try:
            got.append(_outputs(c.infer("simple", **kwargs)))
        except Exception as e:
            got.append(_error(e))
    c.close()
    return got


@scenario
def async_infer(protocol, url):
    """simple_{http,grpc}_async_infer_client: several requests in flight, answers matched to their inputs."""
    client = _clients(protocol)
    if protocol == "http":
        c = client.InferenceServerClient(url, concurrency=4)
        pending = [c.async_infer("simple", _simple_inputs(client, batch=b)) for b in range(1, 9)]
        got = [_outputs(p.get_result()) for p in pending]
    else:
        c = client.InferenceServerClient(url)
        answers: queue.Queue = queue.Queue()
        for b in range(1, 9):
            c.async_infer("simple", _simple_inputs(client, batch=b), request_id=str(b),
                          callback=lambda result, error: answers.put((result, error)))
        done = {}
        for _ in range(8):
            result, error = answers.get(timeout=30)
            assert error is None, error
            done[result.get_response().id] = _outputs(result)
        got = [done[str(b)] for b in range(1, 9)]
    c.close()
    return got


@scenario
def asyncio_infer(protocol, url):
    """simple_{http,grpc}_aio_infer_client: the asyncio clients, requests gathered."""
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio

    client = _clients(protocol)
    aio = httpaio if protocol == "http" else grpcaio

    async def run():
        c = aio.InferenceServerClient(url)
        try:
            live = await c.is_server_live()
            results = await asyncio.gather(*(c.infer("simple", _simple_inputs(client, batch=b)) for b in (1, 2, 4)))
            return live, [_outputs(r) for r in results]
        finally:
            await c.close()

    return asyncio.run(run())


@scenario
def string_infer(protocol, url):
    """simple_{http,grpc}_string_infer_client: BYTES tensors in and out (binary and JSON over HTTP)."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    got = [_outputs(c.infer("simple_string", _simple_inputs(client, string=True)))]
    if protocol == "http":
        outputs = [client.InferRequestedOutput("OUTPUT0", binary_data=False),
                   client.InferRequestedOutput("OUTPUT1", binary_data=True)]
        inputs = _simple_inputs(client, string=True)
        inputs[0].set_data_from_numpy(np.array([[str(v).encode() for v in range(16)]], dtype=np.object_),
                                      binary_data=False)  # JSON `data` for one input, binary for the other
        got.append(_outputs(c.infer("simple_string", inputs, outputs=outputs)))
    c.close()
    return got


@scenario
def system_shared_memory(protocol, url):
    """simple_{http,grpc}_shm_client: inputs and outputs in registered system shared memory regions; the same
    regions used again with other contents (a cache keyed on the request alone would answer the old sums)."""
    import tritonclient.utils.shared_memory as shm

    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    tag = uuid.uuid4().hex[:8]
    nbytes = 16 * 4
    regions = {"in": shm.create_shared_memory_region(f"in_{tag}", f"/dstool_in_{tag}", 2 * nbytes),
               "out": shm.create_shared_memory_region(f"out_{tag}", f"/dstool_out_{tag}", 2 * nbytes)}
    got = []
    try:
        c.register_system_shared_memory("input_data", f"/dstool_in_{tag}", 2 * nbytes)
        c.register_system_shared_memory("output_data", f"/dstool_out_{tag}", 2 * nbytes)
        status = c.get_system_shared_memory_status(**_as_json(protocol))
        got.append(sorted(r["name"] for r in (status.get("regions", {}).values() if protocol == "grpc" else status)))
        for offset in (0, 100):
            a = np.arange(offset, offset + 16, dtype=np.int32).reshape(1, 16)
            shm.set_shared_memory_region(regions["in"], [a, np.ones((1, 16), np.int32)])
            inputs = [client.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_shared_memory("input_data", nbytes)
            inputs[1].set_shared_memory("input_data", nbytes, offset=nbytes)
            outputs = [client.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
            outputs[0].set_shared_memory("output_data", nbytes)
            outputs[1].set_shared_memory("output_data", nbytes, offset=nbytes)
            c.infer("simple", inputs, outputs=outputs)
            got.append([shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16], offset=o).tolist()
                        for o in (0, nbytes)])
    finally:
        wait_for(lambda: _unregistered(c), "Triton to release the regions its answered requests held")
        for region in regions.values():
            shm.destroy_shared_memory_region(region)
        c.close()
    return got


def _unregistered(c) -> bool:
    """Unregister every region; False while Triton (2.51) still holds one for a request it has answered ("Failed to
    unregister the following system shared memory regions", each "currently in use": the reference goes with the
    request's release, a moment after its response, directly as through the gateway)."""
    from tritonclient.utils import InferenceServerException

    try:
        c.unregister_system_shared_memory()
        return True
    except InferenceServerException as e:
        if "Failed to unregister the following" not in str(e):
            raise
        return False


@scenario
def model_control(protocol, url):
    """simple_{http,grpc}_model_control: unload a model, its readiness and an inference meanwhile, load it again."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    got = [c.is_model_ready("simple_string")]
    c.unload_model("simple_string")
    got.append(c.is_model_ready("simple_string"))
    try:
        c.infer("simple_string", _simple_inputs(client, string=True))
    except Exception as e:
        got.append(_error(e))
    c.load_model("simple_string")
    got += [c.is_model_ready("simple_string"), _outputs(c.infer("simple_string", _simple_inputs(client, string=True)))]
    index = c.get_model_repository_index(**_as_json(protocol))
    rows = index if protocol == "http" else index.get("models", [])
    got.append(sorted((m["name"], m.get("state", "")) for m in rows))
    try:
        c.load_model("no_such_model")
    except Exception as e:
        got.append(_error(e))
    c.close()
    return got


def _sequence_values(protocol, url, sync: bool):
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    plan = [(1001, 5, True, False), (1002, 100, True, False), (1001, 7, False, False), (1002, 1, False, False),
            (1001, 7, False, True), (1002, 7, False, True)]  # interleaved; the same (1001, 7) twice

    def request(value):
        t = client.InferInput("INPUT", [1], "INT32")
        t.set_data_from_numpy(np.array([value], np.int32))
        return [t]

    got = []
    if sync:
        for seq, value, start, end in plan:
            r = c.infer("simple_sequence", request(value), sequence_id=seq, sequence_start=start, sequence_end=end)
            got.append(r.as_numpy("OUTPUT").tolist())
    else:
        answers: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            for i, (seq, value, start, end) in enumerate(plan):
                c.async_stream_infer("simple_sequence", request(value), request_id=str(i), sequence_id=seq,
                                     sequence_start=start, sequence_end=end)
                result, error = answers.get(timeout=30)  # one at a time: the order within a sequence matters
                assert error is None, error
                got.append(result.as_numpy("OUTPUT").tolist())
        finally:
            c.stop_stream()
    c.close()
    return got


@scenario
def sequence_sync(protocol, url):
    """simple_{http,grpc}_sequence_sync_infer_client: two interleaved sequences; a repeated request in a
    sequence gets its running sum, never an earlier answer."""
    return _sequence_values(protocol, url, sync=True)


@scenario(protocols=("grpc",))
def sequence_stream(protocol, url):
    """simple_grpc_sequence_stream_infer_client: the same over one gRPC stream."""
    return _sequence_values(protocol, url, sync=False)


@scenario(protocols=("grpc",))
def decoupled_stream(protocol, url):
    """A decoupled model's several responses to one request over a gRPC stream (the examples' repeat model)."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    text, count = client.InferInput("text_input", [1], "BYTES"), client.InferInput("count", [1], "INT32")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    count.set_data_from_numpy(np.array([4], np.int32))
    got = []
    try:
        c.async_stream_infer("stream", [text, count], enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=30)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            got.append((None if final else result.as_numpy("text_output").tolist(), final))
            if final:
                break
    finally:
        c.stop_stream()
        c.close()
    return got


@scenario
def compression(protocol, url):
    """simple_{http,grpc}_infer_client with compressed requests and answers (gzip, deflate)."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    got = []
    if protocol == "http":
        for request, response in (("gzip", "gzip"), ("deflate", "deflate"), ("gzip", None), (None, "deflate")):
            got.append(_outputs(c.infer("simple", _simple_inputs(client), request_compression_algorithm=request,
                                        response_compression_algorithm=response)))
    else:
        for algorithm in ("gzip", "deflate"):
            got.append(_outputs(c.infer("simple", _simple_inputs(client), compression_algorithm=algorithm)))
    c.close()
    return got


@scenario
def custom_args(protocol, url):
    """simple_grpc_custom_args_client / keepalive: channel arguments and keepalive options; HTTP headers."""
    client = _clients(protocol)
    if protocol == "grpc":
        c = client.InferenceServerClient(url, keepalive_options=client.KeepAliveOptions(
            keepalive_time_ms=2 ** 31 - 1, keepalive_timeout_ms=20000, keepalive_permit_without_calls=False,
            http2_max_pings_without_data=2), channel_args=[("grpc.max_receive_message_length", 1 << 20)])
    else:
        c = client.InferenceServerClient(url, connection_timeout=10, network_timeout=10)
    got = _outputs(c.infer("simple", _simple_inputs(client), headers={"x-custom": "1"}))
    c.close()
    return got


@scenario(protocols=("grpc",))
def explicit_contents(protocol, url):
    """grpc_explicit_{int,byte}_content_client: ModelInferRequest with typed contents, through the raw stub."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    channel = grpc.insecure_channel(url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    got = []
    for model, datatype, field, values in (("simple", "INT32", "int_contents", [list(range(16)), [1] * 16]),
                                           ("simple_string", "BYTES", "bytes_contents",
                                            [[str(v).encode() for v in range(16)], [b"1"] * 16])):
        request = service_pb2.ModelInferRequest(model_name=model)
        for name, value in zip(("INPUT0", "INPUT1"), values):
            item = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
            getattr(item.contents, field).extend(value)
        response = stub.ModelInfer(request)
        got.append(([(o.name, o.datatype, list(o.shape)) for o in response.outputs],
                    [bytes(r) for r in response.raw_output_contents]))
    channel.close()
    return got


@scenario
def timeout_and_cancel(protocol, url):
    """client_timeout on a slow request (DEADLINE_EXCEEDED over gRPC; the HTTP client's own timeout), and a
    gRPC request cancelled while in flight."""
    client = _clients(protocol)
    x = client.InferInput("INPUT0", [2], "FP32")
    # a fresh input each run: a slow answer the gateway has cached since would come at once
    x.set_data_from_numpy(np.random.default_rng().random(2, dtype=np.float32))
    got = []
    if protocol == "grpc":
        c = client.InferenceServerClient(url)
        try:
            c.infer("echo_fp32", [x], parameters={"delay_ms": 1500}, client_timeout=0.3)
        except Exception as e:
            got.append(_error(e))
        answers: queue.Queue = queue.Queue()
        future = c.async_infer("echo_fp32", [x], parameters={"delay_ms": 800},
                               callback=lambda result, error: answers.put((result, error)))
        future.cancel()
        result, error = answers.get(timeout=30)
        got.append(_error(error) if error is not None else "answered")
    else:
        c = client.InferenceServerClient(url, network_timeout=0.3)
        try:
            c.infer("echo_fp32", [x], parameters={"delay_ms": 1500})
        except Exception as e:
            got.append(type(e).__name__)
    c.close()
    return got


@scenario
def settings_and_statistics(protocol, url):
    """The examples' trace/log settings calls, and statistics of a model (counts differ when the gateway
    answers from its cache, so the model and version are compared)."""
    client = _clients(protocol)
    c = client.InferenceServerClient(url)
    as_json = _as_json(protocol)
    stats = c.get_inference_statistics("simple", **as_json)
    got = {"trace": c.get_trace_settings(**as_json), "log": c.get_log_settings(**as_json),
           "stats": [(s["name"], s["version"]) for s in stats["model_stats"]]}
    c.close()
    return got


@pytest.mark.parametrize("name, protocol", [(n, p) for n, (_, protocols) in SCENARIOS.items() for p in protocols],
                         ids=lambda v: v)
def test_triton_client_examples_give_the_same_result_through_the_gateway(gateway, gateway_server, name, protocol):
    run = SCENARIOS[name][0]
    expected = run(protocol, gateway_server.http_url if protocol == "http" else gateway_server.grpc_url)
    assert expected not in (None, [], {}), "a scenario must return what the client got"
    through = gateway.http_url if protocol == "http" else gateway.grpc_url
    assert run(protocol, through) == expected
    assert run(protocol, through) == expected  # again: what the gateway cached is what Triton answers
