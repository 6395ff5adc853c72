"""`dstool eval`: lm-evaluation-harness (in its own venv) on tasks built from registry data — the tasks are the same
documents every time, and the Hugging Face path and the ONNX path score the real model alike."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dstool.evaluation import tasks as task_defs
from dstool.files import sha256_file

from conftest import built_once, cli, dstool, lm_eval_versions, one_line_usage_error

LIMIT = 6  # documents a task in the two real runs (the docs' figures are the full tasks)


def test_tasks_are_built_from_registry_data_the_same_every_time(tmp_path):
    first = task_defs.write_tasks(list(task_defs.TASKS), tmp_path / "a")
    assert first == task_defs.write_tasks(list(task_defs.TASKS), tmp_path / "b")  # deterministic
    assert sha256_file(task_defs.SOTU.path) == task_defs.SOTU.sha256  # the cached tarball is the known one
    docs = {name: [json.loads(line) for line in (tmp_path / "a" / f"{name}.jsonl").read_text().splitlines()]
            for name in task_defs.TASKS}
    # the sizes docs/eval.md gives
    assert [len(docs[n]) for n in task_defs.TASKS] == [44, 150, 127, 127]
    # the perplexity passages are the 2021 address, whole, in order
    text = task_defs.addresses(task_defs.PPL_YEARS)["2021_joseph_r_biden_d"]
    assert " ".join(d["text"] for d in docs["sotu_ppl"]).split() == text.split()
    assert all(len(d["text"]) >= task_defs.PASSAGE_CHARS for d in docs["sotu_ppl"][:-1])
    # cloze: a word of letters that the context already holds; the context ends where the sentence's last word was
    texts = {name: " ".join(t.split()) for name, t in task_defs.addresses(task_defs.CLOZE_YEARS).items()}
    for d in docs["sotu_cloze"]:
        assert re.fullmatch(r"[A-Za-z]{3,}", d["target"]) and re.search(rf"\b{d['target']}\b", d["context"], re.I)
        assert " ".join(f"{d['context']} {d['target']}".split()) in texts[d["source"]]
    assert len({d["source"] for d in docs["sotu_cloze"]}) == 11
    # multiple choice: the conversation's own first answer among three answers of other questions of its category
    import gzip
    from importlib import resources

    rows = [json.loads(x) for x in gzip.decompress(resources.files("dstool.data").joinpath(
        task_defs.CONVERSATIONS).read_bytes()).decode().splitlines()]
    answers: dict[str, set] = {}
    for r in rows:
        answers.setdefault(r["category"], set()).add(r["messages"][1]["content"])
    first = {}
    for r in rows:
        first.setdefault((r["category"], r["messages"][0]["content"]), r["messages"][1]["content"])
    for d in docs["convo_mc"]:
        assert len(set(d["choices"])) == 4 and d["choices"][d["answer"]] == first[d["category"], d["question"]]
        assert set(d["choices"]) <= answers[d["category"]]
    assert docs["convo_mc"] == docs["convo_chat"]
    assert {d["answer"] for d in docs["convo_mc"]} == {0, 1, 2, 3}  # the true answer is not always first
    config = json.loads((tmp_path / "a" / "convo_chat.yaml").read_text())  # JSON is YAML: lm-eval reads it
    assert config["task"] == "convo_chat" and config["output_type"] == "multiple_choice"


def test_bad_input_is_one_line(real_model, tmp_path):
    one_line_usage_error(cli("eval", "--model", str(real_model), "--tasks", "sotu_ppl,wikitext"),
                         "unknown task 'wikitext'")
    one_line_usage_error(cli("eval", "--model", str(tmp_path / "nothing")), "does not exist")
    one_line_usage_error(cli("eval", "--model", str(real_model), "--url", "http://127.0.0.1:1/v1/completions"),
                         "--url needs --served-model")
    one_line_usage_error(cli("eval", "--model", str(real_model), "--url", "http://127.0.0.1:1/v1/completions",
                             "--served-model", "dstool_lm"), "is the gateway running there?")
    (tmp_path / "graph.onnx").write_bytes(b"")
    one_line_usage_error(cli("eval", "--model", str(tmp_path / "graph.onnx")), "pass --tokenizer DIR")
    one_line_usage_error(cli("eval", "--model", str(real_model), "--lm-eval-venv", str(tmp_path / "venv")),
                         "scripts/lm-eval-venv.sh")
    bare = tmp_path / "bare-venv" / "bin"  # a venv made before the onnx path needed onnxruntime there
    bare.mkdir(parents=True)
    (bare / "python").symlink_to(sys.executable)
    one_line_usage_error(cli("eval", "--model", str(tmp_path / "graph.onnx"), "--tokenizer", str(real_model),
                             "--lm-eval-venv", str(bare.parent)), "has no onnxruntime")
    plain = tmp_path / "no-template"  # a tokenizer without a chat template cannot be scored on convo_chat
    plain.mkdir()
    (plain / "tokenizer.json").write_text((real_model / "tokenizer.json").read_text())
    (plain / "tokenizer_config.json").write_text("{}")
    one_line_usage_error(cli("eval", "--model", str(tmp_path / "graph.onnx"), "--tokenizer", str(plain), "--tasks",
                             "convo_chat"), "has none")


@pytest.fixture(scope="module")
def real_graph(real_repo) -> Path:
    """The real model's ONNX logits graph (fp32, parity-checked against PyTorch by `dstool export`)."""
    return real_repo / "smol" / "1" / "model.onnx"


def _agree(a: float | None, b: float | None, metric: str) -> bool:
    """Within 0.5 points: accuracies 0.005 apart, perplexity-like metrics 0.5 % apart."""
    assert a is not None and b is not None, metric
    return abs(a - b) <= 0.005 if metric.startswith("acc") else abs(a - b) <= 0.005 * abs(b)


@pytest.fixture(scope="module")
def hf_eval(real_model, tmp_path_factory, worker_id) -> Path:
    """`dstool eval` of the real model on the Hugging Face path: the reference the ONNX path is held to, kept between
    runs (keyed by dstool's evaluation code and lm-eval's venv, as a trained model is by the training code)."""
    args = ("--model", str(real_model), "--limit", str(LIMIT))
    return built_once(tmp_path_factory, worker_id, "eval_real_hf",
                      lambda out: dstool("eval", *args, "--output", str(out), timeout=600),
                      ("dstool.evaluation", "dstool.gguf"), (*args, *lm_eval_versions()))


@pytest.mark.slow
def test_the_hf_and_onnx_paths_agree_on_the_real_model(real_model, real_graph, hf_eval, tmp_path):
    """SmolLM2-135M-Instruct scored by lm-eval's hf model in-process and by its onnxruntime model on the logits graph
    (the path of a compress output): every metric of every task within 0.5 points, every request's log-likelihood
    within 0.01, and the model above chance on the tasks where chance is known."""
    from dstool.evaluation.api import EvalReport, recovery

    proc = dstool("eval", "--model", str(real_graph), "--tokenizer", str(real_model), "--limit", str(LIMIT),
                  "--output", str(tmp_path / "onnx"), timeout=600)
    assert all(name in proc.stdout for name in task_defs.TASKS), proc.stdout  # the table
    runs = {}
    for path, out in (("hf", hf_eval), ("onnx", tmp_path / "onnx")):
        runs[path] = EvalReport.model_validate_json((out / "results.json").read_text())
        assert runs[path].path == path and (out / "lm_eval.log").is_file()
    hf, onnx = runs["hf"], runs["onnx"]
    assert list(hf.tasks) == list(onnx.tasks) == list(task_defs.TASKS)
    for name, h in hf.tasks.items():
        o = onnx.tasks[name]
        assert h.docs == o.docs == LIMIT and h.chat_template == o.chat_template == (name == "convo_chat")
        for metric, value in h.metrics.items():
            if not metric.endswith("_stderr"):
                assert _agree(o.metrics[metric], value, metric), (name, metric, value, o.metrics[metric])
        lls = [(x[0], y[0]) for dh, do in zip(h.responses, o.responses) for x, y in zip(dh, do)]
        assert len(lls) == LIMIT * (4 if name.startswith("convo") else 1)
        assert max(abs(x - y) for x, y in lls) < 1e-2, name
    assert all(abs(r - 100) <= 0.5 for r in recovery(hf, onnx).values() if r is not None)
    # a real model, not noise: the perplexity is a language model's, the cloze and the answers beat chance
    assert 5 < hf.tasks["sotu_ppl"].value < 500  # type: ignore[operator]
    assert hf.tasks["sotu_cloze"].value > 0.25 and hf.tasks["convo_mc"].value > 0.25  # type: ignore[operator]
    print(f"hf {hf.seconds:.0f} s, onnx {onnx.seconds:.0f} s: " + ", ".join(
        f"{n} {t.metric} {t.value:.4f}/{onnx.tasks[n].value:.4f}" for n, t in hf.tasks.items()))


def test_the_harness_runs_in_lm_evals_venv_alone():
    """dstool/evaluation/harness.py runs with lm-eval's python, where dstool is not installed: it imports no dstool,
    and nothing of dstool imports it."""
    import ast

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names} | \
            {f"{node.module}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
             for a in node.names}

    harness = Path(task_defs.__file__).with_name("harness.py")
    assert not any(n.startswith("dstool") for n in imports(harness))
    assert any(n.startswith("lm_eval") for n in imports(harness))
    for path in (Path(task_defs.__file__).parent.parent.parent / "dstool").rglob("*.py"):
        assert not any("harness" in n for n in imports(path)), path


def test_a_compress_output_is_scored_on_its_logits_graph(int8_output, tmp_path):
    """`--model` a compress output: lm-eval's onnxruntime model on the graph its manifest names (int8 weight-only
    here), the tokenizer from its model/; a tokenizer without a chat template leaves convo_chat out (a warning)."""
    from dstool.artifacts import CompressedModel
    from dstool.evaluation.api import EvalReport

    proc = dstool("eval", "--model", str(int8_output), "--limit", "3", "--output", str(tmp_path / "out"))
    report = EvalReport.model_validate_json((tmp_path / "out" / "results.json").read_text())
    manifest = CompressedModel.read(int8_output)
    assert report.path == "onnx" and Path(report.scored) == int8_output / manifest.graphs["logits"].path
    assert Path(report.tokenizer) == int8_output / manifest.model
    has_template = (int8_output / manifest.model / "chat_template.jinja").is_file()
    assert ("convo_chat" in report.tasks) == has_template
    assert has_template or "no chat template: convo_chat left out" in proc.stderr
    assert all(t.docs == 3 and t.value is not None for t in report.tasks.values())
