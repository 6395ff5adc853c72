"""What `dstool infer` does: `generate_text` (MODEL_generate), `stream_text` (MODEL_llm, token by token),
`openai_text` (the gateway's OpenAI route), `infer_ids` (the tensor model) — with the unmodified tritonclient (HTTP
or gRPC), and plain HTTP for the server-sent events."""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import queue
from collections.abc import Iterator

import numpy as np

from dstool.errors import UsageError
from dstool.serve.config.export_config import model_names


def infer_ids(url: str, protocol: str, model: str, ids: list[int], headers: dict | None = None) -> np.ndarray:
    """Send token ids to the tensor model with tritonclient; returns logits [seq, vocab]."""
    client = _tritonclient(protocol)
    arr = np.asarray([ids], dtype=np.int64)  # [1, seq]: a batch of one, batched model or not
    inputs = []
    for name in ("input_ids", "attention_mask"):
        t = client.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr if name == "input_ids" else np.ones_like(arr))
        inputs.append(t)
    with _client(client, url) as c:
        result = c.infer(model, inputs, outputs=[client.InferRequestedOutput("logits")], headers=headers)
    return result.as_numpy("logits")[0]


def generate_text(url: str, protocol: str, model: str, prompt: str, max_new_tokens: int | None = None,
                  use_kv_cache: bool = True, parameters: dict | None = None,
                  headers: dict | None = None) -> tuple[str, list[int]]:
    """Send `prompt` to the text-generation entry point `MODEL_generate` with tritonclient; returns the
    generated text and its token ids."""
    client = _tritonclient(protocol)
    values = {"text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_)}  # [batch 1, 1]
    if max_new_tokens is not None:
        values["max_new_tokens"] = np.array([[max_new_tokens]], dtype=np.int32)
    if not use_kv_cache:
        values["use_kv_cache"] = np.array([[False]])
    inputs = []
    for name, value in values.items():
        inputs.append(client.InferInput(name, list(value.shape), {np.object_: "BYTES", np.int32: "INT32",
                                                                   np.bool_: "BOOL"}[value.dtype.type]))
        inputs[-1].set_data_from_numpy(value)
    with _client(client, url) as c:
        result = c.infer(model_names(model)["generate"], inputs, parameters=parameters or None, headers=headers)
    return result.as_numpy("text_output")[0, 0].decode("utf-8"), result.as_numpy("output_ids")[0].tolist()


def stream_text(url: str, protocol: str, model: str, prompt: str, max_new_tokens: int | None = None,
                parameters: dict | None = None, headers: dict | None = None) -> Iterator[str]:
    """The text MODEL_llm generates for `prompt`, piece by piece as its tokens come: over a gRPC stream, or
    Triton's generate_stream (server-sent events) over HTTP."""
    name = model_names(model)["llm"]
    if protocol == "http":
        body = {"text_input": prompt, "stream": True, **(parameters or {})}
        if max_new_tokens is not None:
            body["max_new_tokens"] = max_new_tokens
        for event in _sse(url, f"/v2/models/{name}/generate_stream", body, headers or {}):
            if "error" in event:
                raise UsageError(f"Triton at {url}: {event['error']}")
            yield event.get("text_output", "")
        return
    import tritonclient.grpc as grpc

    values = {"text_input": (np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
              "stream": (np.array([True]), "BOOL")}
    if max_new_tokens is not None:
        values["max_new_tokens"] = (np.array([max_new_tokens], dtype=np.int32), "INT32")
    inputs = []
    for key, (value, datatype) in values.items():
        inputs.append(grpc.InferInput(key, list(value.shape), datatype))
        inputs[-1].set_data_from_numpy(value)
    answers: queue.Queue = queue.Queue()
    with _client(grpc, url) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)), headers=headers)
        try:
            c.async_stream_infer(name, inputs, parameters=parameters or None)
            while True:
                result, error = answers.get()
                if error is not None:
                    raise error
                yield result.as_numpy("text_output")[0].decode("utf-8")
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            c.stop_stream()


def openai_text(url: str, model: str, prompt: str, max_new_tokens: int | None = None,
                parameters: dict | None = None, stream: bool = False, headers: dict | None = None) -> Iterator[str]:
    """The text of a completion from the gateway's OpenAI route (/v1/completions), whole or streamed. Greedy unless
    `parameters` ask otherwise."""
    body = {"model": model, "prompt": prompt, "stream": stream, "temperature": 0, **(parameters or {})}
    if max_new_tokens is not None:
        body["max_tokens"] = max_new_tokens
    for event in _sse(url, "/v1/completions", body, headers or {}):
        if "error" in event:
            raise UsageError(f"the gateway at {url}: {event['error'].get('message', event['error'])}")
        for choice in event.get("choices", []):
            yield choice.get("text", "")


def _sse(url: str, path: str, body: dict, headers: dict) -> Iterator[dict]:
    """POST `body` as JSON; the answer's events (server-sent, or one JSON document); errors as one line."""
    host, _, port = url.rpartition(":")
    conn = http.client.HTTPConnection(host or "127.0.0.1", int(port), timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        if r.getheader("Content-Type", "").startswith("text/event-stream"):
            buffer = b""
            while chunk := r.read1(65536):
                buffer += chunk
                while b"\n\n" in buffer:
                    line, buffer = buffer.split(b"\n\n", 1)
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        yield json.loads(line[len(b"data: "):])
            return
        answer = json.loads(r.read() or b"{}")
        if r.status != 200:
            message = answer.get("error", answer)
            raise UsageError(f"{url}{path} answered {r.status}: "
                             f"{message.get('message', message) if isinstance(message, dict) else message}"
                             f"{refusal_hint(str(r.status))}")
        yield answer
    except (ConnectionError, OSError) as e:
        raise UsageError(f"nothing answers at {url} ({e}): start one with `dstool serve`") from None
    except (http.client.HTTPException, json.JSONDecodeError):
        raise UsageError(f"{url} does not answer HTTP as Triton or the gateway does: give the HTTP port "
                         "(--url HOST:PORT)") from None
    finally:
        conn.close()


REFUSALS = {"401": "UNAUTHENTICATED", "403": "PERMISSION_DENIED", "429": "RESOURCE_EXHAUSTED"}


def refusal_hint(status: str) -> str:
    """What to do about a gateway's refusal (HTTP status or tritonclient's gRPC status), or ""."""
    for http_status, grpc_status in REFUSALS.items():
        if status in (http_status, f"StatusCode.{grpc_status}"):
            return {"401": " (the gateway wants an API key: pass --api-key KEY or set $DSTOOL_API_KEY; `dstool keys "
                           "create` makes one)",
                    "403": " (the key is not given this model or route: `dstool keys create --models ...`)",
                    "429": " (the key's rate limit or budget: retry later, or raise it with `dstool keys`)",
                    }[http_status]
    return ""


def _tritonclient(protocol: str):
    """tritonclient.grpc or tritonclient.http."""
    return importlib.import_module("tritonclient.grpc" if protocol == "grpc" else "tritonclient.http")


@contextlib.contextmanager
def _client(client, url: str):
    """A tritonclient client for `url`; a server that does not answer or refuses the request is a one-line error."""
    from tritonclient.utils import InferenceServerException

    c = client.InferenceServerClient(url)
    try:
        yield c
    except InferenceServerException as e:
        hint = refusal_hint(str(e.status())) or " (is `dstool serve` running, and is the model exported?)"
        raise UsageError(f"Triton at {url}: {e.message().splitlines()[0] if e.message() else e}{hint}") from None
    except (ConnectionError, OSError) as e:
        raise UsageError(f"no Triton answers at {url} ({e}): start one with `dstool serve`") from None
    finally:
        c.close()
