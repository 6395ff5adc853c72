"""`generate_text`, `infer_ids`: what `dstool infer` does, with the unmodified tritonclient (HTTP or gRPC)."""

from __future__ import annotations

import contextlib

import numpy as np

from dstool.errors import UsageError
from dstool.serve.config import model_names


def infer_ids(url: str, protocol: str, model: str, ids: list[int]) -> np.ndarray:
    """Send token ids to the tensor model with tritonclient; returns logits [seq, vocab]."""
    client = _tritonclient(protocol)
    arr = np.asarray([ids], dtype=np.int64)  # [1, seq]: a batch of one, batched model or not
    inputs = []
    for name in ("input_ids", "attention_mask"):
        t = client.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr if name == "input_ids" else np.ones_like(arr))
        inputs.append(t)
    with _client(client, url) as c:
        result = c.infer(model, inputs, outputs=[client.InferRequestedOutput("logits")])
    return result.as_numpy("logits")[0]


def generate_text(url: str, protocol: str, model: str, prompt: str, max_new_tokens: int | None = None,
                  use_kv_cache: bool = True) -> tuple[str, list[int]]:
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
        result = c.infer(model_names(model)["generate"], inputs)
    return result.as_numpy("text_output")[0, 0].decode("utf-8"), result.as_numpy("output_ids")[0].tolist()


def _tritonclient(protocol: str):
    """tritonclient.grpc or tritonclient.http."""
    import importlib

    return importlib.import_module("tritonclient.grpc" if protocol == "grpc" else "tritonclient.http")


@contextlib.contextmanager
def _client(client, url: str):
    """A tritonclient client for `url`; a server that does not answer or refuses the request is a one-line error."""
    from tritonclient.utils import InferenceServerException

    c = client.InferenceServerClient(url)
    try:
        yield c
    except InferenceServerException as e:
        raise UsageError(f"Triton at {url}: {e.message().splitlines()[0] if e.message() else e} "
                         "(is `dstool serve` running, and is the model exported?)") from None
    except (ConnectionError, OSError) as e:
        raise UsageError(f"no Triton answers at {url} ({e}): start one with `dstool serve`") from None
    finally:
        c.close()
