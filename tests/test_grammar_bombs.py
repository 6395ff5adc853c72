"""Grammar bombs (issue 40): client grammars that crashed the gateway and the engine (a chain of rules or `$ref`s
overflowing llguidance's stack), cost seconds and hundreds of MB to build, or came back with the parser's internal
state — bounded and compiled where a crash cannot happen, on every route: the grammar module itself, the OpenAI
chat, completions and Responses routes, Triton's generate extension, a gRPC stream to NAME_llm, and a batch row's
schema. The bombs run in child processes where a crash would take the test runner with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from llmlib import post, stub_process, timed_chat

MODULE = "dstool.decoding.grammar"


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def ref_chain(n: int, wrap: bool = False) -> dict:
    """A schema whose `$defs` are a chain of n `$ref`s (each inside an object's property, with `wrap`)."""
    def link(i):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"a": ref}} if wrap else ref
    defs = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(n: int, key: str) -> str:
    """A `structured_outputs` value as JSON text (deeper than Python's json writes): n levels of `items` or `anyOf`."""
    opening = '{"type":"array","items":' if key == "items" else '{"anyOf":['
    closing = "}" if key == "items" else ',{"type":"null"}]}'
    return '{"json":' + opening * n + '{"type":"string"}' + closing * n + "}"


# what the attacker sent (issue 40), and more of each class: every one is refused or served, none crashes
BOMBS = {
    "lark chain of 3,000 rules": {"grammar": lark_chain(3000)},
    "lark chain of 3,000 terminals": {"grammar": "start: T0\n" + "".join(f"T{i}: T{i + 1}\n" for i in range(3000))
                                      + 'T3000: "x"\n'},
    "$ref chain of 10,000": {"json": ref_chain(10000)},
    "$ref chain of 1,600 in objects": {"json": ref_chain(1600, wrap=True)},
    "$ref chain of 900 in objects (64 KiB)": {"json": ref_chain(850, wrap=True)},
    "allOf chain of 1,500": {"json": {"$ref": "#/$defs/d0", "$defs": {
        **{f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}]} for i in range(1500)}, "d1500": {"type": "string"}}}},
    "arrays 2,000 deep": {"json": nested(2000, "items")},
    "anyOf 500 deep": {"json": nested(500, "anyOf")},
    "100,000 choices": {"choice": [f"w{i}" for i in range(100000)]},
    "8,000 choices": {"choice": [f"w{i}" for i in range(8000)]},
    "regex (a{1000}){1000}": {"regex": "(a{1000}){1000}"},
    "pattern ^(a{1000}){1000}$": {"json": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    "3,000 properties": {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                   for i in range(3000)}}},
    "an integer range of 10^300": {"json": {"type": "integer", "minimum": -10**300, "maximum": 10**300}},
    "regex nested 900 deep": {"regex": "(" * 900 + "a" + ")" * 900},
}

CHILD = textwrap.dedent("""
    import json, sys, time
    from transformers import AutoTokenizer
    from {module} import Grammars, GrammarError, grammar_of
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    grammars = Grammars(tokenizer, {{tokenizer.eos_token_id}})
    for name, spec in json.load(sys.stdin).items():
        started, cpu, outcome = time.monotonic(), time.process_time(), "served"
        try:
            grammar_of(spec)
            constraint = grammars.constraint(spec)
            constraint.allowed(len(tokenizer))
        except GrammarError as e:
            outcome = str(e)
        print(json.dumps([name, outcome, time.process_time() - cpu, time.monotonic() - started]), flush=True)
""")


def test_bombs_are_refused_or_served_and_never_crash(trained):
    """Each bomb in one child process (with the real tokenizer): it ends normally, every bomb answered within 2 s of
    CPU (the process's, all its threads: what a bomb costs, which a loaded machine does not change as it does the
    wall-clock time) — a one-line refusal without the parser's state, or a grammar that begins."""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(module=MODULE), str(trained)],
                          input=json.dumps(BOMBS, default=int), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the grammar engine died ({proc.returncode}): {proc.stderr[-2000:]}"
    answered = {name: (outcome, cpu) for name, outcome, cpu, _ in map(json.loads, proc.stdout.splitlines())}
    assert set(answered) == set(BOMBS)
    for name, (outcome, cpu) in answered.items():
        assert cpu < 2, f"{name}: {cpu:.1f} CPU s"
        assert "\n" not in outcome and "<state>" not in outcome and len(outcome) < 400, (name, outcome)
    for name in ("lark chain of 3,000 rules", "$ref chain of 10,000", "100,000 choices", "arrays 2,000 deep"):
        assert answered[name][0].startswith("structured_outputs"), (name, answered[name])  # over the bounds


STACK_CHILD = textwrap.dedent("""
    import sys, threading
    from {module} import COMPILER, MAX_RULES, _compile
    from test_grammar_bombs import lark_chain, ref_chain
    specs = [("json", ref_chain(int(sys.argv[1]), wrap=True)), ("grammar", lark_chain(10 * MAX_RULES))]
    if sys.argv[2] == "compiler":
        for kind, value in specs:
            COMPILER.run(_compile, kind, value)
    else:  # an ordinary thread (8 MiB of stack here): what the gateway and the engine compiled on before
        thread = threading.Thread(target=lambda: [_compile(kind, value) for kind, value in specs])
        thread.start()
        thread.join()
    print("compiled")
""")


def test_the_compile_threads_hold_ten_times_the_deepest_chain_the_bounds_let_through():
    """The longest `$ref` chain that fits in MAX_SPEC_BYTES is ~850 links of objects (the costliest per link
    measured, ~10 KB of stack each); ten times it, and a Lark chain of ten times MAX_RULES, compile on the grammar
    engine's threads. The same chain kills a process that compiles it on an ordinary thread."""
    from dstool.decoding.grammar import MAX_SPEC_BYTES

    links = 850
    assert len(json.dumps({"json": ref_chain(links, wrap=True)}, separators=(",", ":"))) <= MAX_SPEC_BYTES
    run = [sys.executable, "-c", STACK_CHILD.format(module=MODULE), str(10 * links)]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    ok = subprocess.run([*run, "compiler"], capture_output=True, text=True, timeout=600, env=env)
    assert ok.returncode == 0 and "compiled" in ok.stdout, ok.stderr[-2000:]
    crashed = subprocess.run([*run, "plain"], capture_output=True, text=True, timeout=600, env=env)
    assert crashed.returncode < 0, "the chain no longer overflows an ordinary stack: this test proves nothing"


def test_a_batch_rows_schema_bomb_fails_that_row_alone(trained):
    """`dstool batch --schema-column`: a row whose schema is a bomb fails alone, with the bound it broke."""
    from dstool.serve.batch import work

    plan = work.Plan(task="generate", engine="onnxruntime", output="", format="parquet", on_error="record",
                     column="prompt", ids_column=None, input_schema=b"", family="dstool_lm", version=1, models={},
                     decoder="", logits="", tokenizer=str(trained), cache_shapes={}, eos=(0,), max_positions=128,
                     max_prompt_bytes=4096, default_new_tokens=8, sampling="{}", schema_column="schema",
                     max_new_tokens=None, max_batch=1, concurrency=1, url="")
    with pytest.raises(work.RowFailed, match=r"\$refs: at most"):
        work._choices(plan, 3, {"schema": json.dumps(ref_chain(1500))})
    _, sampler, _ = work._choices(plan, 3, {"schema": json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}})})
    assert sampler.constraint is not None


# ---- on the real gateway and Triton --------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"


def _chat(**fields) -> dict:
    return {"model": "dstool_lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


ROUTES = [  # (what, path, body, the field the refusal must name)
    ("chat guided_grammar", CHAT, _chat(guided_grammar=lark_chain(3000)), "guided_grammar"),
    ("chat json_schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(10000)}}), "response_format.json_schema.schema"),
    ("chat tools", CHAT, _chat(tools=[_tool(ref_chain(1600, wrap=True))]), "tools[0].function.parameters"),
    ("chat guided_choice", CHAT, _chat(guided_choice=[f"w{i}" for i in range(100000)]), "guided_choice"),
    ("completions structured_outputs", "/v1/completions",
     {"model": "dstool_lm", "prompt": "hi", "max_tokens": 4, "structured_outputs": {"grammar": lark_chain(3000)}},
     "structured_outputs.grammar"),
    ("responses tool", "/v1/responses", {"model": "dstool_lm", "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": ref_chain(10000)}]}, "tools[0].parameters"),
    ("responses text.format", "/v1/responses", {"model": "dstool_lm", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": ref_chain(1600, wrap=True)}}}, "text.format"),
    ("chat guided_regex over the lexer's fuel", CHAT, _chat(guided_regex="(a{1000}){1000}"), "guided_regex"),
    ("128 tools of 30 KB", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": f"f{i}", "description": "x" * 30000, "parameters": {"type": "object"}}} for i in range(128)]),
     "tools"),
    ("a forced call over the lexer's fuel", CHAT, _chat(tools=[_tool({"type": "object", "properties": {"a": {
        "type": "string", "pattern": "^(a{1000}){1000}$"}}, "required": ["a"]})], tool_choice="required"), "tools"),
    ("chat guided_grammar that does not parse", CHAT, _chat(guided_grammar="start: (\n" + "r: \"x\"\n" * 50),
     "guided_grammar"),
    ("chat guided_regex that does not parse", CHAT, _chat(guided_regex="(" * 60 + "[z-a]"), "guided_regex"),
]
# as Triton's generate extension takes it: structured_outputs as JSON text, up to the engine's own size cap; the
# deepest chain the bounds let through is served, the others refused
GENERATE = [({"grammar": lark_chain(3000)}, False), ({"json": ref_chain(1500)}, False),
            ({"regex": "(a{1000}){1000}"}, False), ({"json": ref_chain(850, wrap=True)}, True)]


def test_grammar_bombs_on_every_route_leave_the_gateway_and_the_engine_serving(llm_gateway, server):
    stack = llm_gateway
    gateway, engine = psutil.Process(stack.proc.pid), stub_process(server, "dstool_lm_llm")
    wrong = []
    for what, path, body, param in ROUTES:
        started = time.monotonic()
        status, _, answer = post(stack.http_port, path, body, timeout=60)
        error = json.loads(answer).get("error", {}) if status != 200 else {}
        message = str(error.get("message", ""))  # one short line, never llguidance's internal state
        if status != 400 or not str(error.get("param", "")).startswith(param.split(".")[0]) or \
                time.monotonic() - started > 5 or "\n" in message or "<state>" in message or len(message) > 600:
            wrong.append((what, status, answer[:300]))
    for spec, served in GENERATE:
        status, _, answer = post(stack.http_port, "/v2/models/dstool_lm_llm/generate",
                                 {"text_input": "hi", "max_new_tokens": 4, "structured_outputs": json.dumps(spec)})
        if status != (200 if served else 400) or not served and (b"structured_outputs" not in answer or
                                                                 b"\\n" in answer or len(answer) > 800):
            wrong.append((f"generate {str(spec)[:40]}", status, answer[:300]))
    wrong += _grpc_stream_bombs(stack.grpc_url)
    assert not wrong, "\n".join(f"{w}: {s} {a!r}" for w, s, a in wrong)
    assert gateway.is_running() and stub_process(server, "dstool_lm_llm").pid == engine.pid
    timed_chat(stack.http_port)  # both still serve


def _grpc_stream_bombs(url: str) -> list:
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    new = grpcclient.InferInput("max_new_tokens", [1], "INT32")
    new.set_data_from_numpy(np.array([4], dtype=np.int32))
    answers: list = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.append(error))
    wrong = []
    try:
        for spec, served in GENERATE:
            answers.clear()
            client.async_stream_infer("dstool_lm_llm", [text, new], parameters={"structured_outputs": json.dumps(spec)})
            deadline = time.monotonic() + 30
            while not answers and time.monotonic() < deadline:
                time.sleep(0.01)
            if not answers or (answers[0] is None) != served or \
                    not served and "structured_outputs" not in (answers[0].message() or ""):
                wrong.append((f"gRPC stream {str(spec)[:40]}", answers[:1], b""))
    finally:
        client.stop_stream()
        client.close()
    return wrong


def test_memory_stays_bounded_after_500_hostile_requests(llm_gateway, server):
    """500 hostile structured requests, each grammar new (so none comes from a cache): costly regexes and patterns,
    long choice lists, deep chains at the bounds, bombs over them, on the OpenAI routes and the generate extension.
    The gateway and the engine's process hold at most a bounded amount more after them (before: +100 MB and +300 MB
    after 200)."""
    stack = llm_gateway
    gateway, engine = psutil.Process(stack.proc.pid), stub_process(server, "dstool_lm_llm")
    timed_chat(stack.http_port)
    rss = gateway.memory_info().rss, engine.memory_info().rss

    def hostile(i: int) -> tuple[str, dict]:
        kind = i % 5
        if kind == 0:
            return CHAT, _chat(guided_regex=f"(a{{{300 + i}}}){{{300 + i}}}x{i}")
        if kind == 1:
            return CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^(b{{{200 + i}}})+$"}},
                "required": [f"k{i}"]}}})
        if kind == 2:
            return CHAT, _chat(guided_choice=[f"w{i}-{j}" for j in range(900)])
        if kind == 3:
            return "/v2/models/dstool_lm_llm/generate", {"text_input": "hi", "max_new_tokens": 4,
                                                         "structured_outputs": json.dumps({"grammar": lark_chain(900)
                                                                                           + f"# {i}\n"})}
        return CHAT, _chat(guided_grammar=lark_chain(3000) + f"# {i}\n")

    statuses: dict[int, int] = {}
    for i in range(500):
        path, body = hostile(i)
        status, _, _ = post(stack.http_port, path, body, timeout=60)
        statuses[status] = statuses.get(status, 0) + 1
    grown = (gateway.memory_info().rss - rss[0]) >> 20, (engine.memory_info().rss - rss[1]) >> 20
    print(f"\n500 hostile structured requests: {statuses}; RSS gateway {grown[0]:+d} MB, NAME_llm {grown[1]:+d} MB")
    assert set(statuses) <= {200, 400}, statuses
    assert grown[0] < 64 and grown[1] < 128, grown
    timed_chat(stack.http_port)
