"""What one `dstool batch` task runs on an executor: its partition's rows through ONNX Runtime (the continuous-
batching engine NAME_llm runs inside Triton, with its sampler; graphs and tokenizer loaded once per executor
process, not per row or task) or through a running Triton / dstool gateway with tritonclient; then the
partition's files, each written atomically, the summary last (it marks the partition done)."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dstool.decoding.engine import Engine, Sequence
from dstool.decoding.grammar import Grammars
from dstool.decoding.sampling import SamplingError, request_choices
from dstool.files import write_atomic

ROW_ERROR = "dstool-batch-row-error"  # a task failing on a row (--on-error fail) says this; the driver reports it
PREFILL_TOKENS = 256  # prompt tokens prefilled per engine step: offline, throughput matters more than first tokens
RETRIES = 3  # a Triton call that fails for want of the server (not the row) is tried this often


@dataclass(frozen=True)
class Plan:
    """Everything a task needs, decided by the driver (pickled to the executors)."""

    task: str
    engine: str
    output: str
    format: str
    on_error: str
    column: str
    ids_column: str | None
    input_schema: bytes  # the input's Arrow schema, serialized: every partition's file has the same columns
    family: str
    version: int
    models: dict[str, str]  # role -> Triton model name
    decoder: str  # path of the decoder graph
    logits: str  # path of the logits graph
    tokenizer: str  # folder of the tokenizer files
    cache_shapes: dict[str, tuple[int, int]]
    eos: tuple[int, ...]
    max_positions: int
    max_prompt_bytes: int  # longer text cannot fit in max_positions: refused untokenized
    default_new_tokens: int
    sampling: str  # the request parameters, JSON (structured_outputs: --json-schema's grammar)
    schema_column: str | None  # a column of JSON schemas, each row's own grammar
    max_new_tokens: int | None
    max_batch: int
    concurrency: int
    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # the gateway's credentials, never printed
    rows_per_partition: int = 1  # output partition k holds rows k*N ... (k+1)*N - 1
    done: frozenset[int] = field(default_factory=frozenset)  # partitions an earlier run finished


class RowFailed(Exception):
    """A row that cannot run (the message says why, for failures.jsonl or the one-line error)."""


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def run_partition(plan: Plan, index: int, items):
    """Spark's mapPartitionsWithIndex function: this partition's rows (Row objects with their number in `_row`) in,
    its summary out."""
    if index in plan.done:
        return
    rows = []
    for item in items:
        row = item.asDict(recursive=True)
        rows.append((row.pop("_row"), row))
    rows.sort(key=lambda r: r[0])
    strays = [n for n, _ in rows if n // plan.rows_per_partition != index]
    if strays:  # the driver's shuffle put rows elsewhere: writing them here would mix partitions
        raise RuntimeError(f"partition {index} was given row {strays[0]}, which belongs to partition "
                           f"{strays[0] // plan.rows_per_partition}")
    began = time.monotonic()
    results, failures = (_score if plan.task == "score" else _generate)(plan, rows)
    if failures and plan.on_error == "fail":
        number, error = failures[0]
        raise RuntimeError(f"{ROW_ERROR}: row {number}: {error}")
    summary = _write(plan, index, rows, results, dict(failures), time.monotonic() - began)
    yield summary


# ---- preparing rows ---------------------------------------------------------------------------------------

def _prompt_ids(plan: Plan, tokenizer, row: dict) -> list[int]:
    if plan.ids_column is not None:
        value = row.get(plan.ids_column)
        if isinstance(value, str):
            try:
                value = [int(x) for x in value.replace("[", "").replace("]", "").split(",") if x.strip()]
            except ValueError:
                raise RowFailed(f"{plan.ids_column} is not a list of token ids: {value[:60]!r}") from None
        if not value:
            raise RowFailed(f"{plan.ids_column} is empty or missing: give at least one token id")
        ids = [int(x) for x in value]
        vocab = len(tokenizer)
        if min(ids) < 0 or max(ids) >= vocab:
            raise RowFailed(f"{plan.ids_column} holds {min(ids) if min(ids) < 0 else max(ids)}, outside the "
                            f"vocabulary 0..{vocab - 1}")
        return ids
    text = row.get(plan.column)
    if not isinstance(text, str):
        raise RowFailed(f"{plan.column} is {'missing' if text is None else type(text).__name__}, not text")
    if len(text) > plan.max_prompt_bytes:  # characters: at least as many bytes
        raise RowFailed(f"{plan.column} is {len(text)} characters, more than the model's {plan.max_positions} "
                        f"positions can hold (at most {plan.max_prompt_bytes} bytes)")
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise RowFailed(f"{plan.column} is empty: give at least one token of text")
    return ids


def _prepare(rows: list[tuple[int, dict]], make) -> tuple[dict, list[tuple[int, str]]]:
    """`make(row)` for every row, by row number; a row it refuses (RowFailed) is a failure with the reason."""
    made, failures = {}, []
    for number, row in rows:
        try:
            made[number] = make(row)
        except RowFailed as e:
            failures.append((number, str(e)))
    return made, failures


def _choices(plan: Plan, prompt_tokens: int, row: dict):
    asked = None if plan.max_new_tokens is None else np.array([plan.max_new_tokens])
    parameters = plan.sampling
    own = row.get(plan.schema_column) if plan.schema_column else None
    if own:  # this row's schema, in place of the job's
        try:
            parameters = json.dumps({**json.loads(plan.sampling),
                                     "structured_outputs": json.dumps({"json": json.loads(own)})})
        except (ValueError, TypeError, RecursionError):
            raise RowFailed(f"{plan.schema_column} is not a JSON schema (JSON text): {str(own)[:60]!r}") from None
    try:
        return request_choices(parameters, prompt_tokens, asked, plan.default_new_tokens, plan.max_positions,
                               None, set(plan.eos), _grammars(plan))
    except SamplingError as e:
        raise RowFailed(str(e)) from None


def _grammars(plan: Plan):
    """The grammar engine's view of the tokenizer, made once per executor."""
    tokenizer = _load("tokenizer", plan.tokenizer)
    with _LOCK:
        if ("grammars", plan.tokenizer) not in _LOADED:
            _LOADED["grammars", plan.tokenizer] = Grammars(tokenizer, set(plan.eos))
        return _LOADED["grammars", plan.tokenizer]


# ---- loaded once per executor process --------------------------------------------------------------------

_LOADED: dict[tuple[str, str], object] = {}
_LOCK = threading.Lock()


def _threads() -> int:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return max(ctx.cpus(), 1) if ctx is not None else 0


def _load(kind: str, path: str):
    """The tokenizer or an onnxruntime session of `path`, made on this executor's first use (Spark reuses its
    Python workers, so later tasks find it here)."""
    with _LOCK:
        if (kind, path) not in _LOADED:
            if kind == "tokenizer":
                from transformers import AutoTokenizer

                _LOADED[kind, path] = AutoTokenizer.from_pretrained(path)
            else:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.intra_op_num_threads = _threads()
                opts.inter_op_num_threads = 1
                _LOADED[kind, path] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        return _LOADED[kind, path]


# ---- generate -------------------------------------------------------------------------------------------

def _generate(plan: Plan, rows: list[tuple[int, dict]]) -> tuple[dict[int, dict], list[tuple[int, str]]]:
    tokenizer = _load("tokenizer", plan.tokenizer)

    def job(row: dict) -> tuple:
        ids = _prompt_ids(plan, tokenizer, row)
        return (ids, *_choices(plan, len(ids), row), row.get(plan.column))

    jobs, failures = _prepare(rows, job)
    made = (_generate_onnx if plan.engine == "onnx" else _generate_triton)(plan, jobs, failures)
    results = {}
    for number, (output, seconds) in made.items():
        ids = jobs[number][0]
        results[number] = {"text": tokenizer.decode(output, skip_special_tokens=True), "prompt_tokens": len(ids),
                           "generated_tokens": len(output),
                           "finish_reason": "stop" if output and output[-1] in jobs[number][3] else "length",
                           "latency_s": round(seconds, 6)}
    return results, sorted(failures)


def _generate_onnx(plan: Plan, jobs: dict, failures: list) -> dict[int, tuple[list[int], float]]:
    engine = Engine(_load("onnx", plan.decoder), plan.cache_shapes, plan.max_batch,
                    max_prefill_tokens=PREFILL_TOKENS)
    for number, (ids, new_tokens, sampler, stops, _) in jobs.items():
        engine.add(Sequence(str(number), ids, new_tokens, sampler.next, stops))
    began: dict[int, float] = {}  # engine step -> when it started
    made = {}
    while engine.busy:
        began[engine.steps_started + 1] = time.monotonic()
        for sequence, _ in engine.step():
            if sequence.error is not None:  # this row's generation failed; the others go on
                failures.append((int(sequence.id), f"generation failed: {sequence.error}"))
            elif sequence.finished:
                made[int(sequence.id)] = (sequence.output, time.monotonic() - began[sequence.started_step or 1])
    return made


class _Calls:
    """At most `limit` tritonclient calls in flight; each answer (or error) kept by row number."""

    def __init__(self, limit: int):
        self.free = threading.Semaphore(limit)
        self.answers: dict[int, tuple[object, object, float]] = {}
        self.lock = threading.Lock()

    def callback(self, number: int, began: float):
        def done(result, error):
            with self.lock:
                self.answers[number] = (result, error, time.monotonic() - began)
            self.free.release()
        return done

    def wait_all(self, limit: int) -> None:
        for _ in range(limit):
            self.free.acquire()


def _call_all(plan: Plan, requests: dict) -> dict[int, tuple[object, float]]:
    """Send every (model, inputs, parameters) request, `plan.concurrency` at a time; a row's client error fails that
    row (RowFailed), an unavailable server is retried, then fails the task (it reruns as a whole)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    answers: dict[int, tuple[object, float]] = {}
    pending = dict(requests)
    with grpcclient.InferenceServerClient(plan.url) as client:
        for attempt in range(RETRIES):
            calls = _Calls(plan.concurrency)
            for number, (model, inputs, parameters) in pending.items():
                calls.free.acquire()
                client.async_infer(model, inputs, calls.callback(number, time.monotonic()),
                                   model_version=str(plan.version), parameters=parameters, headers=plan.headers)
            calls.wait_all(plan.concurrency)
            retry = {}
            for number, (result, error, seconds) in calls.answers.items():
                if error is None:
                    answers[number] = (result, seconds)
                elif isinstance(error, InferenceServerException) and error.status() in (
                        "StatusCode.INVALID_ARGUMENT", "StatusCode.OUT_OF_RANGE"):
                    answers[number] = (RowFailed(error.message() or str(error)), seconds)
                else:
                    retry[number] = pending[number]
                    last = error
            if not retry:
                return answers
            pending = retry
            time.sleep(0.5 * 2 ** attempt)
    raise RuntimeError(f"Triton at {plan.url} did not answer {len(pending)} requests after {RETRIES} tries: {last}")


def _generate_triton(plan: Plan, jobs: dict, failures: list) -> dict[int, tuple[list[int], float]]:
    import tritonclient.grpc as grpcclient

    parameters = json.loads(plan.sampling) or None
    requests = {}
    for number, (_, new_tokens, _, _, prompt) in jobs.items():
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[prompt.encode("utf-8")]], dtype=np.object_))
        count = grpcclient.InferInput("max_new_tokens", [1, 1], "INT32")
        count.set_data_from_numpy(np.array([[new_tokens]], dtype=np.int32))
        requests[number] = (plan.models["generate"], [text, count], parameters)
    made = {}
    for number, (result, seconds) in _call_all(plan, requests).items():
        if isinstance(result, RowFailed):
            failures.append((number, str(result)))
        else:
            made[number] = (result.as_numpy("output_ids")[0].tolist(), seconds)  # type: ignore[attr-defined]
    return made


# ---- score ----------------------------------------------------------------------------------------------

def _score(plan: Plan, rows: list[tuple[int, dict]]) -> tuple[dict[int, dict], list[tuple[int, str]]]:
    """Each text's log-likelihood under the model: the sum of log p(token | the tokens before), its perplexity."""
    tokenizer = _load("tokenizer", plan.tokenizer)

    def text(row: dict) -> list[int]:
        ids = _prompt_ids(plan, tokenizer, row)
        if len(ids) > plan.max_positions:
            raise RowFailed(f"the text has {len(ids)} tokens, more than the model's {plan.max_positions} positions")
        return ids

    texts, failures = _prepare(rows, text)
    scored = _score_onnx(plan, texts) if plan.engine == "onnx" else _score_triton(plan, texts, failures)
    results = {}
    for number, (logprob, seconds) in scored.items():
        n = len(texts[number])
        results[number] = {"tokens": n, "logprob": logprob,
                           "perplexity": math.exp(-logprob / (n - 1)) if n > 1 else None,
                           "latency_s": round(seconds, 6)}
    return results, sorted(failures)


def _logprob(logits: np.ndarray, ids: list[int]) -> float:
    """sum over positions t >= 1 of log softmax(logits[t-1])[ids[t]]."""
    rows = logits[: len(ids) - 1].astype(np.float64)
    top = rows.max(axis=-1, keepdims=True)
    norm = top[:, 0] + np.log(np.exp(rows - top).sum(axis=-1))
    return float((rows[np.arange(len(ids) - 1), ids[1:]] - norm).sum())


def _score_onnx(plan: Plan, texts: dict[int, list[int]]) -> dict[int, tuple[float, float]]:
    session = _load("onnx", plan.logits)
    order = sorted(texts, key=lambda k: len(texts[k]))  # similar lengths together: little padding
    scored = {}
    for start in range(0, len(order), plan.max_batch):
        chunk = order[start:start + plan.max_batch]
        began = time.monotonic()
        longest = max(len(texts[k]) for k in chunk)
        ids = np.zeros((len(chunk), longest), np.int64)
        mask = np.zeros_like(ids)
        for i, k in enumerate(chunk):
            ids[i, :len(texts[k])], mask[i, :len(texts[k])] = texts[k], 1
        logits = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
        seconds = time.monotonic() - began
        for i, k in enumerate(chunk):
            scored[k] = (_logprob(logits[i], texts[k]), seconds)
    return scored


def _score_triton(plan: Plan, texts: dict[int, list[int]], failures: list) -> dict[int, tuple[float, float]]:
    import tritonclient.grpc as grpcclient

    requests = {}
    for number, ids in texts.items():
        arr = np.asarray([ids], dtype=np.int64)
        inputs = []
        for name, value in (("input_ids", arr), ("attention_mask", np.ones_like(arr))):
            inputs.append(grpcclient.InferInput(name, list(value.shape), "INT64"))
            inputs[-1].set_data_from_numpy(value)
        requests[number] = (plan.models["logits"], inputs, None)
    scored = {}
    for number, (result, seconds) in _call_all(plan, requests).items():
        if isinstance(result, RowFailed):
            failures.append((number, str(result)))
        else:
            scored[number] = (_logprob(result.as_numpy("logits")[0], texts[number]), seconds)  # type: ignore
    return scored


# ---- writing --------------------------------------------------------------------------------------------

RESULT_TYPES = {"generate": {"text": "string", "prompt_tokens": "int64", "generated_tokens": "int64",
                             "finish_reason": "string", "latency_s": "float64"},
                "score": {"tokens": "int64", "logprob": "float64", "perplexity": "float64", "latency_s": "float64"}}


def _write(plan: Plan, index: int, rows: list, results: dict, failed: dict, seconds: float) -> dict:
    import pyarrow as pa

    schema = pa.ipc.read_schema(pa.py_buffer(plan.input_schema))
    kept = [(n, r) for n, r in rows if n in results]
    extra = [("row", pa.int64())] + [(k, pa.type_for_alias(t)) for k, t in RESULT_TYPES[plan.task].items()] + [
        ("model", pa.string()), ("model_version", pa.int64())]
    full = pa.schema(list(schema) + [pa.field(k, t) for k, t in extra])
    records = [{**r, "row": n, **results[n], "model": plan.family, "model_version": plan.version} for n, r in kept]
    table = pa.Table.from_pylist(records, schema=full)
    out, name = Path(plan.output), part_name(index)
    for folder in ("failures", "rows", "_parts"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    if failed:
        lines = "".join(json.dumps({"row": n, "error": failed[n], **r}, default=str) + "\n"
                        for n, r in rows if n in failed)
        write_atomic(out / "failures" / f"{name}.jsonl", lambda p: p.write_text(lines))
    rows_file = f"rows/{name}.{plan.format}"
    if plan.format == "parquet":
        import pyarrow.parquet as pq

        write_atomic(out / rows_file, lambda p: pq.write_table(table, p))
    else:
        text = "".join(json.dumps(r, default=str) + "\n" for r in table.to_pylist())
        write_atomic(out / rows_file, lambda p: p.write_text(text))
    summary = {"index": index, "file": rows_file, "rows": len(kept), "failed": len(failed),
               "prompt_tokens": sum(results[n].get("prompt_tokens", results[n].get("tokens", 0)) for n, _ in kept),
               "generated_tokens": sum(results[n].get("generated_tokens", 0) for n, _ in kept),
               "seconds": round(seconds, 4)}
    write_atomic(out / "_parts" / f"{name}.json", lambda p: p.write_text(json.dumps(summary)))  # last: it marks done
    return summary
