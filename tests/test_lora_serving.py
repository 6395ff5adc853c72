"""Multi-LoRA serving: the fused decoder graph with LoRA inputs (dstool/fused_decoder.py), the adapters packed per
batch (dstool/decoding/adapters.py), the engine running rows of different adapters in one step, `dstool export
--adapter`, and NAME_llm on a real Triton: a request's `adapter`, adapters loaded and unloaded at run time, refusals."""

from __future__ import annotations

import http.client
import json
import shutil
import threading

import numpy as np
import pytest

from dstool.decoding.adapters import Adapter, RowWeights, graph_layout
from dstool.decoding.engine import Sequence, engine_for
from dstool.decoding.errors import AdapterError, UnknownAdapter

from llmlib import run_to_end

PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\n", "KING RICHARD:\nNow is the winter", "HAMLET:\nTo be"]


@pytest.fixture(scope="module")
def graphs(lora_repo):
    """(the LoRA graph's session, the layout of its LoRA inputs, the cache shapes, the tokenizer)."""
    import onnxruntime as ort
    from transformers import AutoTokenizer

    from dstool.serve.export.repository import cache_shapes

    folder = lora_repo / "lora_llm" / "1"
    session = ort.InferenceSession(str(folder / "fused" / "model.onnx"), providers=["CPUExecutionProvider"])
    return (session, graph_layout(session.get_inputs()), cache_shapes(lora_repo / "lora_generate" / "config.pbtxt"),
            AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def adapters(graphs, lora_adapters) -> dict[str, Adapter]:
    return {name: Adapter.load(name, folder, graphs[1], 64) for name, folder in lora_adapters.items()}


def _greedy(logits, prompt, output) -> int:
    return int(np.argmax(logits))


def _decode(graphs, jobs: list[tuple[str, Adapter | None]], max_batch: int = 8, new: int = 12,
            prefix_cache=None, ignore_eos: bool = False) -> list[list[int]]:
    """Each (prompt, adapter)'s greedy tokens (to the end of sequence), all in one engine's batch."""
    session, _, shapes, tokenizer = graphs
    engine = engine_for(session, shapes, max_batch=max_batch, prefix_cache=prefix_cache)
    eos = set() if ignore_eos else {tokenizer.eos_token_id} - {None}  # where NAME_llm stops, too
    sequences = [Sequence(str(i), tokenizer(p)["input_ids"], new, _greedy, eos, adapter=a)
                 for i, (p, a) in enumerate(jobs)]
    return run_to_end(engine, sequences)


def test_an_adapters_logits_equal_its_merged_models(trained, lora_repo, lora_adapters, adapters, tmp_path):
    """The graph with an adapter in use gives the logits of PEFT's merge of it (its own fused graph) to 1e-4 +
    1e-4 x the largest logit, in fp32; and an adapter changes them (the test could fail)."""
    import torch
    from lorautil import merged

    from dstool.fused_decoder import export_fused_decoder, prefill
    from dstool.onnx_export import RELATIVE, ort_session

    ids = np.random.default_rng(0).integers(0, 1000, (2, 13))
    session = ort_session(lora_repo / "lora_llm" / "1" / "fused" / "model.onnx")
    base = prefill(session, ids)
    for name, adapter in adapters.items():
        model = merged(trained, lora_adapters[name])
        export_fused_decoder(model, tmp_path / name)
        want = prefill(ort_session(tmp_path / name / "model.onnx"), ids)
        got = prefill(session, ids, adapter)
        # export's parity rule (numpy's allclose on the worst logit): a merged W + BA rounds unlike x A B added
        # after, by a CPU's kernels (1.07e-4 on a Xeon, under 1e-4 on an EPYC)
        assert np.abs(got - want).max() <= 1e-4 + RELATIVE * np.abs(want).max(), (name, np.abs(got - want).max())
        with torch.no_grad():
            torch_logits = model(input_ids=torch.from_numpy(ids)).logits.numpy()
        assert np.abs(got - torch_logits).max() <= 1e-3
        assert np.abs(got - base).max() > 1e-2, name


def test_rows_of_different_adapters_in_one_batch_decode_as_each_alone(graphs, adapters):
    jobs = [(PROMPTS[0], adapters["sql"]), (PROMPTS[1], None), (PROMPTS[2], adapters["chat"]),
            (PROMPTS[0], None), (PROMPTS[3], adapters["sql"]), (PROMPTS[0], adapters["chat"])]
    together = _decode(graphs, jobs)
    alone = [_decode(graphs, [job])[0] for job in jobs]
    assert together == alone
    assert len({tuple(together[i]) for i in (0, 3, 5)}) == 3  # one prompt, three models: three answers


def test_a_batch_whose_adapters_change_as_sequences_come_and_go(graphs, adapters):
    """Sequences of other lengths end at other steps, so the adapters in use (and their packing) change while the
    others decode: each still decodes as alone."""
    session, _, shapes, tokenizer = graphs
    engine = engine_for(session, shapes, max_batch=3)
    lengths = [3, 9, 5, 12, 7]
    names = [adapters["sql"], adapters["chat"], None, adapters["chat"], adapters["sql"]]
    sequences = [Sequence(str(i), tokenizer(PROMPTS[i % 4])["input_ids"], n, _greedy, set(), adapter=a)
                 for i, (n, a) in enumerate(zip(lengths, names))]
    for s in sequences:
        engine.add(s)
    batches = set()
    while engine.busy:
        engine.step()
        batches.add(tuple(a and a.name for a in engine.lora.at[:len(engine.running)]))
    assert len(batches) >= 3
    for s, n, a in zip(sequences, lengths, names):
        assert s.output == _decode(graphs, [(PROMPTS[int(s.id) % 4], a)], new=n)[0]


def test_the_prefix_cache_is_never_shared_between_adapters(graphs, adapters):
    from dstool.decoding.engine import PrefixCache

    session, _, shapes, tokenizer = graphs
    cache = PrefixCache(block=4, max_tokens=4096)
    prompt = tokenizer(PROMPTS[2] * 3)["input_ids"]
    runs = []
    for adapter in (adapters["sql"], adapters["chat"], None, adapters["sql"]):
        engine = engine_for(session, shapes, max_batch=2, prefix_cache=cache)
        s = Sequence("x", prompt, 6, _greedy, set(), adapter=adapter)
        engine.add(s)
        while engine.busy:
            engine.step()
        runs.append((s.cached, s.output))
    assert [c for c, _ in runs] == [0, 0, 0, runs[3][0]] and runs[3][0] > 0  # only the same adapter's prefix
    assert runs[3][1] == runs[0][1]


def test_an_engine_without_lora_inputs_refuses_an_adapters_sequence(repo, adapters, graphs):
    import onnxruntime as ort

    session = ort.InferenceSession(str(repo / "dstool_lm_llm" / "1" / "fused" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    engine = engine_for(session, graphs[2])
    with pytest.raises(ValueError, match="no LoRA inputs"):
        engine.add(Sequence("x", [1, 2], 2, _greedy, set(), adapter=adapters["sql"]))


def test_row_weights_hold_each_rows_adapter_and_are_written_only_when_it_changes(graphs, adapters):
    sql, chat = adapters["sql"], adapters["chat"]
    weights = RowWeights(graphs[1])
    kept = weights.batch([chat, None, sql], capacity=4)
    q, k = kept["lora.layers.0.q.A"], kept["lora.layers.0.k.A"]
    assert q.shape == (3, q.shape[1], 8)  # the highest rank among the rows
    assert np.array_equal(q[0, :, :4], chat.weights[(0, "q")][0]) and not q[0, :, 4:].any() and not q[1].any()
    assert np.array_equal(q[2], sql.weights[(0, "q")][0]) and not k[0].any()  # chat adapts q and v only
    q[2] += 1.0  # a mark: a row whose adapter did not change is not written again
    again = weights.batch([None, None, sql, chat], capacity=4)
    assert again["lora.layers.0.q.A"][2].sum() == pytest.approx(sql.weights[(0, "q")][0].sum() + q[2].size, rel=1e-4)
    assert not again["lora.layers.0.q.A"][0].any() and again["lora.layers.0.q.A"][3, :, :4].any()
    assert weights.batch([None, None], capacity=4)["lora.layers.0.q.A"].shape[2] == 0  # base rows only: rank 0
    run = weights.rows([chat])
    assert run["lora.layers.0.q.A"].shape[2] == 4
    assert np.array_equal(run["lora.layers.0.v.B"][0], chat.weights[(0, "v")][1])


def _rewrite(source, target, config=None, tensors=None, drop=()):
    """A copy of adapter folder `source` with its config updated and tensors replaced / dropped."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    if config:
        cfg = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None or drop:
        weights = load_file(str(target / "adapter_model.safetensors"))
        weights = {k: v for k, v in {**weights, **(tensors or {})}.items() if not any(d in k for d in drop)}
        save_file(weights, str(target / "adapter_model.safetensors"))
    return target


def test_an_adapter_the_graph_cannot_apply_is_refused_naming_why(graphs, lora_adapters, tmp_path):
    layout, sql = graphs[1], lora_adapters["sql"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "rank": (_rewrite(sql, tmp_path / "rank", {"r": 128}), "ranks 1..64"),
        "dora": (_rewrite(sql, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "bias": (_rewrite(sql, tmp_path / "bias", {"bias": "all"}), "trains biases"),
        "save": (_rewrite(sql, tmp_path / "save", {"modules_to_save": ["lm_head"]}), "modules saved whole"),
        "prefix": (_rewrite(sql, tmp_path / "prefix", {"peft_type": "PREFIX_TUNING"}), "not a LoRA adapter"),
        "shape": (_rewrite(sql, tmp_path / "shape", tensors={key: np.zeros((8, 7), np.float32)}),
                  "another base model"),
        "layer": (_rewrite(sql, tmp_path / "layer", tensors={key.replace("layers.0", "layers.99"):
                                                             np.zeros((8, 64), np.float32)}), "another base"),
        "embed": (_rewrite(sql, tmp_path / "embed", tensors={
            "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 4), np.float32)}),
            "q, k, v, o, gate, up and down projections only"),
        "half": (_rewrite(sql, tmp_path / "half", drop=("layers.1.mlp.up_proj.lora_B",)), "lora_B missing"),
    }
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text("{}")
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"x")
    cases["pickle"] = (tmp_path / "pickle", "a pickle")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (tmp_path / "garbage" / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    cases["garbage"] = (tmp_path / "garbage", "cannot be read")
    for case, (folder, needle) in cases.items():
        with pytest.raises(AdapterError, match=None) as e:
            Adapter.load(case, folder, layout, 64)
        assert needle in str(e.value) and "\n" not in str(e.value), (case, str(e.value))
    with pytest.raises(AdapterError, match="adapter name"):
        Adapter.load("../x", sql, layout, 64)


def test_an_unknown_adapter_reads_back_from_its_message():
    said = str(UnknownAdapter("sql", ["chat"]))
    assert said.startswith("adapter 'sql' is not loaded") and "chat" in said
    back = UnknownAdapter.read(said)
    assert back is not None and back.name == "sql" and back.code == "model_not_found" and str(back) == said
    assert UnknownAdapter.read("adapter must be a string") is None


def test_export_records_serves_and_refuses_adapters(lora_repo, lora_adapters, adapters, trained, tmp_path):
    from dstool.artifacts import Repository

    from conftest import cli, one_line_usage_error

    deployment = Repository.read(lora_repo).deployments[-1]
    assert deployment.adapters == {name: a.sha256 for name, a in adapters.items()}
    config = (lora_repo / "lora_llm" / "config.pbtxt").read_text()
    assert '"adapters": ["chat", "sql"]' in config.replace('\\"', '"')
    assert sorted(p.name for p in (lora_repo / "lora_llm" / "1" / "adapters").iterdir()) == ["chat", "sql"]
    one_line_usage_error(cli("export", str(trained), "--repository", str(tmp_path / "r"), "--adapter", "sql"),
                         "give NAME=FOLDER")
    one_line_usage_error(cli("export", str(trained), "--repository", str(tmp_path / "r"), "--adapter",
                             f"a={lora_adapters['sql']}", "--no-fused-attention"), "fused-attention decoder")
    one_line_usage_error(cli("export", str(trained), "--repository", str(tmp_path / "r"), "--adapter",
                             f"a={tmp_path}"), "has no adapter_config.json")
    assert not (tmp_path / "r").exists()


# ---- NAME_llm on a real Triton ----

@pytest.fixture(scope="module")
def lora_server(lora_repo, lora_adapters, session_tmp):
    """A real Triton serving lora_llm alone, with a third adapter (`sql` again, under another name) in its repository
    to be loaded at run time."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    repo = session_tmp / "lora_serving_repository"
    shutil.copytree(lora_repo / "lora_llm", repo / "lora_llm")
    shutil.copytree(lora_adapters["sql"], repo / "lora_llm" / "adapters" / "sql2")  # (Triton skips it)
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "lora-triton.log")
    yield srv, repo
    assert srv.stop() == 0, srv.log_tail(30)


def _generate(srv, body: dict) -> tuple[int, dict]:
    from llmlib import post

    status, _, raw = post(srv.http_port, "/v2/models/lora_llm/generate", body)
    return status, json.loads(raw)


def _admin(srv, **action) -> tuple[int, dict]:
    status, answer = _generate(srv, {"text_input": "", "parameters": {"adapter_admin": json.dumps(action)}})
    return status, (json.loads(answer["text_output"]) if status == 200 else answer)


def test_triton_serves_each_requests_adapter(lora_server, graphs, adapters):
    srv, _ = lora_server
    status, listed = _admin(srv, action="list")
    assert status == 200 and {a["name"]: a["sha256"] for a in listed["adapters"]} == {
        n: a.sha256 for n, a in adapters.items()}
    tokenizer = graphs[3]
    for adapter in (None, "sql", "chat"):
        body = {"text_input": PROMPTS[0], "max_new_tokens": 12,
                "parameters": {"adapter": adapter} if adapter else {}}
        status, answer = _generate(srv, body)
        assert status == 200, answer
        want = _decode(graphs, [(PROMPTS[0], adapters.get(adapter or ""))])[0]
        assert answer["output_ids"] == want, adapter
        assert answer["text_output"] == tokenizer.decode(want, skip_special_tokens=True)


def test_adapters_load_and_unload_at_run_time_without_disturbing_a_stream(lora_server, graphs, adapters):
    from llmlib import sse_events

    srv, repo = lora_server
    body = {"text_input": PROMPTS[1], "max_new_tokens": 900, "stream": True,
            "parameters": {"adapter": "sql", "ignore_eos": True}}
    streamed: dict = {}
    started = threading.Event()

    def stream() -> None:  # the first tokens read before the adapters change, the rest after
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=300)
        conn.request("POST", "/v2/models/lora_llm/generate_stream", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        chunks = [r.read1(1 << 16)]
        started.set()
        while chunk := r.read1(1 << 16):
            chunks.append(chunk)
        streamed.update(code=r.status, raw=b"".join(chunks))

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120)
    status, left = _admin(srv, action="unload", name="sql")  # while the stream on it runs: one admin call after its
    assert status == 200 and "sql" not in [a["name"] for a in left["adapters"]]  # first tokens, 900 to make
    assert thread.is_alive()
    status, loaded = _admin(srv, action="load", name="sql2", path="lora_llm/adapters/sql2")
    assert status == 200 and "sql2" in [a["name"] for a in loaded["adapters"]], loaded
    status, answer = _generate(srv, {"text_input": PROMPTS[0], "max_new_tokens": 12,
                                     "parameters": {"adapter": "sql2"}})
    assert status == 200 and answer["output_ids"] == _decode(graphs, [(PROMPTS[0], adapters["sql"])])[0]
    thread.join(300)
    code, raw = streamed["code"], streamed["raw"]
    ids = [i for e in sse_events(raw) for i in (e["output_ids"] if isinstance(e["output_ids"], list)
                                                  else [e["output_ids"]])]
    assert code == 200 and ids == _decode(graphs, [(PROMPTS[1], adapters["sql"])], new=900, ignore_eos=True)[0]
    status, answer = _generate(srv, {"text_input": "x", "parameters": {"adapter": "sql"}})
    assert status == 400 and answer["error"].startswith("adapter 'sql' is not loaded") and "sql2" in answer["error"]
    status, _ = _admin(srv, action="load", name="sql", path=str(repo / "lora_llm" / "1" / "adapters" / "sql"))
    assert status == 200
    status, answer = _admin(srv, action="load", name="sql", path="lora_llm/adapters/sql2")
    assert status == 400 and "loaded already" in answer["error"]


@pytest.mark.parametrize("action, needle", [
    ({"action": "load", "name": "x", "path": "/etc"}, "outside the model repository"),
    ({"action": "load", "name": "x", "path": "../../.."}, "outside the model repository"),
    ({"action": "load", "name": "x", "path": "lora_llm/1/fused"}, "has no adapter_config.json"),
    ({"action": "load", "name": "a/b", "path": "lora_llm/adapters/sql2"}, "adapter name"),
    ({"action": "unload", "name": "nope"}, "adapter 'nope' is not loaded"),
    ({"action": "drop"}, "adapter_admin must be"),
    ({"action": "load", "name": 3}, "adapter_admin must be"),
])
def test_a_refused_adapter_action_is_a_400_naming_why(lora_server, action, needle):
    status, answer = _admin(lora_server[0], **action)
    assert status == 400 and needle in answer["error"], answer


@pytest.mark.parametrize("value, needle", [("nope", "adapter 'nope' is not loaded"), (3, "adapter must be a string"),
                                           ("x" * 300, "is not loaded")])
def test_a_request_naming_no_loaded_adapter_is_a_400(lora_server, value, needle):
    status, answer = _generate(lora_server[0], {"text_input": "JULIET:", "max_new_tokens": 2,
                                                "parameters": {"adapter": value}})
    assert status == 400 and needle in answer["error"] and len(answer["error"]) < 400, answer
