"""vLLM's metrics on a dstool server: NAME_llm publishes its engine's figures under vLLM's names, label
(model_name, the served name) and buckets beside its own dstool_llm_*, so that vLLM's Grafana board reads a real
Triton 2.51 serving an exported model unchanged. Every metric and label the board's PromQL queries is on Triton's
/metrics, and the values agree with what the requests got back and with dstool's own counters."""

from __future__ import annotations

import json
import math
import queue
import re
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from gatewaylib import eventually
from promlib import PROMETHEUS, Prometheus

LLM, SERVED = "dstool_lm_llm", "dstool_lm"  # the Triton model and the name clients give it (model_name)

# The PromQL of vLLM's Grafana board: vllm-project/vllm, examples/observability/prometheus_grafana/grafana.json at
# commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9, every panel's targets[].expr copied as they are (reference data),
# by panel title; and its one template variable's query.
_Q = 'histogram_quantile({q}, sum by(le) (rate(vllm:{m}_bucket{{model_name="$model_name"}}[$__rate_interval])))'
_MEAN = ('rate(vllm:{m}_sum{{model_name="$model_name"}}[$__rate_interval])\n/\n'
         'rate(vllm:{m}_count{{model_name="$model_name"}}[$__rate_interval])')
BOARD = {
    "E2E Request Latency": [*(_Q.format(q=q, m="e2e_request_latency_seconds") for q in ("0.99", "0.95", "0.9", "0.5")),
                            _MEAN.format(m="e2e_request_latency_seconds")],
    "Token Throughput": ['rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
                         'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])'],
    "Inter Token Latency": [*(_Q.format(q=q, m="inter_token_latency_seconds") for q in ("0.99", "0.95", "0.9", "0.5")),
                            _MEAN.format(m="inter_token_latency_seconds")],
    "Scheduler State": ['vllm:num_requests_running{model_name="$model_name"}',
                        'vllm:num_requests_waiting{model_name="$model_name"}'],
    "Time To First Token Latency": [*(_Q.format(q=q, m="time_to_first_token_seconds")
                                      for q in ("0.99", "0.95", "0.9", "0.5")),
                                    _MEAN.format(m="time_to_first_token_seconds")],
    "Cache Utilization": ['vllm:kv_cache_usage_perc{model_name="$model_name"}'],
    "Request Prompt Length": ['sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}'
                              '[$__rate_interval]))'],
    "Request Generation Length": ['sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}'
                                  '[$__rate_interval]))'],
    "Finish Reason": ['sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}'
                      '[$__rate_interval]))'],
    "Queue Time": ['rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])'],
}
TEMPLATE_QUERY = "label_values(model_name)"

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py); the token-count histograms' are build_1_2_5_buckets(
# max_model_len)
FIRST_TOKEN = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0, 160.0, 640.0, 2560.0]
INTER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]

SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(server) -> list[tuple[str, dict[str, str], float]]:
    """Triton's /metrics as (name, labels, value) series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = SERIES.match(line)
        if m and not line.startswith("#"):
            out.append((m[1], dict(LABEL.findall(m[2] or "")), float(m[3])))
    return out


def value(series, name: str, **labels: str | None) -> float:
    """The sum of `name`'s series whose labels include `labels` (model_name=SERVED unless given; None: any)."""
    want = {k: v for k, v in {"model_name": SERVED, **labels}.items() if v is not None}
    return sum(v for n, ls, v in series if n == name and want.items() <= ls.items())


def board_queries() -> dict[str, set[str]]:
    """Each metric the board queries -> the labels it selects or groups by."""
    queried: dict[str, set[str]] = {}
    for expressions in BOARD.values():
        for expr in expressions:
            groups = set(re.findall(r"by\s*\((\w+)\)", expr))
            for name, selector in re.findall(r"(vllm:[a-zA-Z0-9_:]+)(?:\{([^}]*)\})?", expr):
                queried.setdefault(name, set()).update(groups, re.findall(r"(\w+)\s*=", selector))
    return queried


def generate(server, body: dict) -> dict:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{LLM}/generate", json.dumps(body).encode())
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def lengths_upto(n: int) -> list[float]:
    return [float(m * 10 ** e) for e in range(12) for m in (1, 2, 5) if m * 10 ** e <= n]


def test_vllm_board_reads_a_dstool_server(server):
    config = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/{LLM}/config", timeout=10).read())
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    positions, budget = int(params["max_positions"]), int(params["max_cache_tokens"])
    before = scrape(server)

    def grew(after, name: str, **labels: str | None) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # A greedy request, then four at once: three cut at max_new_tokens (length), and the first one's prompt again
    # (a prefix-cache hit) stopping at its first token (stop: its first token is a stop token)
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    first = generate(server, {"text_input": prompt, "max_new_tokens": 8, "ignore_eos": True})
    bodies = [{"text_input": f"{who}:\n", "max_new_tokens": 6, "ignore_eos": True}
              for who in ("HAMLET", "OPHELIA", "LEAR")]
    bodies.append({"text_input": prompt, "max_new_tokens": 8, "stop_token_ids": [first["output_ids"][0]]})
    with ThreadPoolExecutor(4) as pool:
        answers = [first, *pool.map(lambda b: generate(server, b), bodies)]
    made = [np.ravel(a["output_ids"]).size for a in answers]
    assert made == [8, 6, 6, 6, 1]
    prompts = sum(int(np.ravel(a["prompt_tokens"])[0]) for a in answers)
    cached = sum(int(np.ravel(a["prompt_cached_tokens"])[0]) for a in answers)
    assert cached >= 16  # the last one's prompt: whole blocks of the first one's

    # the figures go out after each step's responses: read them once the fifth request's have
    after = eventually(lambda: scrape(server),
                       lambda s: grew(s, "vllm:e2e_request_latency_seconds_count") >= 5
                       and value(s, "vllm:num_requests_running") == 0, 30)
    assert grew(after, "vllm:generation_tokens_total") == sum(made) == 27
    assert grew(after, "vllm:time_to_first_token_seconds_count") == 5
    assert grew(after, "vllm:inter_token_latency_seconds_count") == sum(made) - 5  # every token after a first
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens"):
        assert grew(after, f"vllm:{name}_count") == 5, name
    assert grew(after, "vllm:request_success_total", finished_reason="length") == 4
    assert grew(after, "vllm:request_success_total", finished_reason="stop") == 1
    assert grew(after, "vllm:request_generation_tokens_sum") == sum(made)
    assert grew(after, "vllm:request_max_num_generation_tokens_sum") == sum(made)  # one sequence a request
    assert grew(after, "vllm:prompt_tokens_total") == grew(after, "vllm:request_prompt_tokens_sum") == prompts
    assert grew(after, "vllm:prefix_cache_hits_total") == cached
    own = {result: grew(after, "dstool_llm_prefix_cache_tokens_total", model_name=None, model=LLM, result=result)
           for result in ("hit", "miss")}
    assert grew(after, "vllm:prefix_cache_hits_total") == own["hit"]
    assert grew(after, "vllm:prefix_cache_queries_total") == own["hit"] + own["miss"] == prompts
    # a request's end to end is its queue, prefill and decode times; its first token came within it
    e2e = grew(after, "vllm:e2e_request_latency_seconds_sum")
    parts = sum(grew(after, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert abs(e2e - parts) < 1e-3 * max(1.0, e2e), (e2e, parts)
    assert 0 < grew(after, "vllm:time_to_first_token_seconds_sum") <= e2e

    # A stream whose client goes away (gRPC, its request cancelled): counted as aborted; while it runs the engine's
    # cache budget holds its prompt and max_new_tokens
    client, got = tgrpc.InferenceServerClient(server.grpc_url), queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        inputs = [tgrpc.InferInput("text_input", [1], "BYTES"), tgrpc.InferInput("max_new_tokens", [1], "INT32"),
                  tgrpc.InferInput("stream", [1], "BOOL")]
        long = positions // 2
        for tensor, array in zip(inputs, (np.array([b"KING:\n"], np.object_), np.array([long], np.int32),
                                          np.array([True]))):
            tensor.set_data_from_numpy(array)
        client.async_stream_infer(LLM, inputs, parameters={"ignore_eos": True})
        result, error = got.get(timeout=60)
        assert error is None, error
        held = int(result.as_numpy("prompt_tokens")[0]) + long
        # (a step's gauges are set one after another by the model's outbox thread: a scrape may fall between them)
        running = eventually(lambda: scrape(server), lambda s: value(s, "vllm:num_requests_running") == 1
                             and value(s, "vllm:kv_cache_usage_perc") > 0, 30)
        assert value(running, "vllm:kv_cache_usage_perc") == pytest.approx(held / budget, rel=1e-9)
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    gone = eventually(lambda: scrape(server),
                      lambda s: grew(s, "vllm:request_success_total", finished_reason="abort") >= 1
                      and value(s, "vllm:num_requests_running") == value(s, "vllm:kv_cache_usage_perc") == 0, 30)
    assert grew(gone, "vllm:request_success_total", finished_reason="abort") == 1
    assert grew(gone, "vllm:request_success_total", finished_reason="error") == 0
    assert grew(gone, "vllm:e2e_request_latency_seconds_count") == 5  # an aborted request's times are not observed
    assert value(gone, "vllm:num_requests_running") == value(gone, "vllm:num_requests_waiting") == 0
    assert value(gone, "vllm:kv_cache_usage_perc") == 0
    # every token the engine made, the aborted stream's too, as dstool counts them
    assert grew(gone, "vllm:generation_tokens_total") == \
        grew(gone, "dstool_llm_generated_tokens_total", model_name=None, model=LLM) > sum(made)

    # (a) every metric and label the board queries, for this model; (b) vLLM's buckets
    queried = board_queries()
    assert len(queried) == 21 and TEMPLATE_QUERY == "label_values(model_name)"
    for name, labels in sorted(queried.items()):
        series = [ls for n, ls, _ in gone if n == name and ls.get("model_name") == SERVED]
        assert series, f"{name} (queried by vLLM's board) is not on Triton's /metrics for model_name={SERVED}"
        assert all(labels <= ls.keys() for ls in series), (name, labels, series)
    reasons = {ls["finished_reason"] for n, ls, _ in gone if n == "vllm:request_success_total"
               and ls.get("model_name") == SERVED}
    assert reasons == {"stop", "length", "abort", "error"}
    expected = {"time_to_first_token_seconds": FIRST_TOKEN, "inter_token_latency_seconds": INTER_TOKEN,
                **{name: REQUEST for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                              "request_prefill_time_seconds", "request_decode_time_seconds")},
                **{name: lengths_upto(positions) for name in ("request_prompt_tokens", "request_generation_tokens",
                                                              "request_max_num_generation_tokens")}}
    for name, buckets in expected.items():
        le = [ls["le"] for n, ls, _ in gone if n == f"vllm:{name}_bucket" and ls.get("model_name") == SERVED]
        assert le[-1] == "+Inf" and [float(x) for x in le[:-1]] == buckets, (name, le)


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus): the "
                                                  "board's metric names are checked above without it")
def test_every_panel_of_vllms_board_answers_from_prometheus_scraping_a_dstool_server(server, tmp_path):
    """What Grafana does with the board: its template variable listed by label_values(model_name), then each
    panel's PromQL, $model_name and $__rate_interval put in, asked of a real Prometheus scraping a real Triton
    (the shipped prometheus.yml's triton job) while requests run — every panel answers for the served model, a
    finite figure in each series (a quantile over no traffic would be NaN, an unknown name no series)."""
    prom = Prometheus(tmp_path / "prometheus", {"triton": [f"127.0.0.1:{server.metrics_port}"]})
    try:
        assert eventually(lambda: prom.targets_up("triton"), lambda n: n == 1, 60) == 1, "Prometheus never scraped"
        assert eventually(lambda: prom.query("vllm:generation_tokens_total"), bool, 60), "no sample of Triton's yet"
        with ThreadPoolExecutor(4) as pool:  # counted between two scrapes: every rate() has an increase to show
            list(pool.map(lambda i: generate(server, {"text_input": f"Speak {i}.", "max_new_tokens": 6,
                                                      "ignore_eos": True}), range(8)))
        assert SERVED in prom.label_values("model_name")
        for panel, expressions in BOARD.items():
            gauge = panel in ("Scheduler State", "Cache Utilization")  # 0 once the requests ended
            for expr in expressions:
                asked = expr.replace("$model_name", SERVED).replace("$__rate_interval", "5m")
                result = eventually(partial(prom.query, asked), partial(_answered, gauge), 60)  # rate(): 2 scrapes
                assert _answered(gauge, result), (panel, asked, result)
    finally:
        prom.stop()


def _answered(gauge: bool, result: list[dict]) -> bool:
    """A series at least, each a finite figure, and (but for a gauge) one above zero."""
    figures = [float(r["value"][1]) for r in result]
    return bool(figures) and all(math.isfinite(f) for f in figures) and (gauge or any(f > 0 for f in figures))


class _Family:
    """The python backend's MetricFamily, faked: each metric made is kept by (family name, labels)."""

    HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

    def __init__(self, made: dict, name: str, text: str, kind: str):
        self.made, self.name = made, name

    def Metric(self, labels: dict, buckets: list | None = None):  # noqa: N802 (the backend's name)
        metric = types.SimpleNamespace(value=0.0, seen=[], buckets=buckets)
        metric.increment = lambda n: setattr(metric, "value", metric.value + n)
        metric.set = lambda v: setattr(metric, "value", v)
        metric.observe = metric.seen.append
        self.made[(self.name, tuple(sorted(labels.items())))] = metric
        return metric


def test_vllm_figures_from_the_engines_state(monkeypatch):
    """What a real Triton run does not reach: a failed request counted as an error, paused sequences waiting and
    still holding their budget, prefilling ones running, a request cut at max_new_tokens counted as length even when
    its last token is a stop token (as vLLM and the gateway say)."""
    from llmlib import llm_module

    llm = llm_module(monkeypatch)
    made: dict = {}
    monkeypatch.setattr(llm.pb_utils, "MetricFamily", lambda *a: _Family(made, *a), raising=False)
    for kind in ("HISTOGRAM", "COUNTER", "GAUGE"):
        setattr(llm.pb_utils.MetricFamily, kind, getattr(_Family, kind))
    metrics = llm.Metrics("family_llm", "1", 100)

    def got(name: str, **labels: str):
        return made[(name, tuple(sorted({"model_name": "family", **labels}.items())))]

    def finished(max_new: int, outputs: list[int], stop_ids: set[int]):
        sequence = llm.Sequence("s", [1, 2, 3], max_new, lambda *a: 0, stop_ids, started_step=1)
        out = llm.Stream(None, False)
        out.arrived -= 1.0
        for token in outputs:
            sequence.output.append(token)
            metrics.produced(sequence, out, out.arrived + 0.5)
        metrics.ended(sequence, out)

    finished(4, [5, 6, 7, 0], {0})  # its stop token at max_new_tokens: length
    finished(4, [5, 0], {0})  # stop
    metrics.cut_short("error")
    assert got("vllm:request_success_total", finished_reason="length").value == 1
    assert got("vllm:request_success_total", finished_reason="stop").value == 1
    assert got("vllm:request_success_total", finished_reason="error").value == 1
    assert got("vllm:request_success_total", finished_reason="abort").value == 0
    assert got("vllm:request_generation_tokens").seen == [4, 2]
    assert got("vllm:prompt_tokens_total").value == 6 and len(got("vllm:time_to_first_token_seconds").seen) == 2
    e2e, queued = got("vllm:e2e_request_latency_seconds").seen, got("vllm:request_queue_time_seconds").seen
    assert queued == [0.5, 0.5] and all(t >= 1.0 for t in e2e)
    assert got("vllm:request_prompt_tokens").buckets == [1, 2, 5, 10, 20, 50, 100]

    def sequence(prompt: int, max_new: int, paused: bool = False):
        return llm.Sequence("s", [1] * prompt, max_new, lambda *a: 0, set(), paused=paused)

    engine = types.SimpleNamespace(running=[sequence(10, 10)], prefilling=[sequence(5, 5)],
                                   waiting=[sequence(20, 10, paused=True), sequence(30, 30)], max_cache_tokens=100,
                                   prefix_cache=None, steps_started=3)
    metrics.step(engine, {}, 0.0, 6)
    assert got("vllm:num_requests_running").value == 2 and got("vllm:num_requests_waiting").value == 2
    assert got("vllm:kv_cache_usage_perc").value == (20 + 10 + 30) / 100  # the paused one's budget is still held
    assert got("vllm:generation_tokens_total").value == 6
    assert len(got("vllm:inter_token_latency_seconds").seen) == 4  # every token after a first
