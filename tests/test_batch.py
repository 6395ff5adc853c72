"""`dstool batch` on a real local Spark (pyspark, Java 17): the embedded prompts, the ONNX Runtime engine against
Triton and `dstool infer`, the Triton engine through the cache gateway, scoring against PyTorch, a job killed and
resumed (by spark-submit), bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from dstool.errors import UsageError

from conftest import DSTOOL, cli, one_line_usage_error


def _batch(**options):
    from dstool.serve.batch import run_batch
    from dstool.serve.config.client_config import BatchConfig

    return run_batch(BatchConfig(**options))


def _rows(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "rows").sort_values("row").reset_index(drop=True)


def _session_alive(sid: int) -> bool:
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return False


@pytest.mark.slow
def test_killed_job_resumes_under_spark_submit_without_losing_or_repeating_rows(repo, tmp_path):
    out = tmp_path / "out"
    args = ["batch", "--repository", str(repo), "--output", str(out), "--max-new-tokens", "8", "--partitions", "10",
            "--max-rows", "300"]
    proc = subprocess.Popen([*DSTOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while len(list((out / "_parts").glob("*.json"))) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its Spark JVM and the Python workers
    proc.wait()
    # A Python worker the kill missed for a moment may still finish the partition it was writing: wait until no
    # process of the job's session is left. Done = a partition whose summary (_parts/, written last) is there; one
    # killed between its rows file and its summary is redone.
    while _session_alive(proc.pid):
        assert time.time() < deadline + 60, "a process of the killed job is still running"
        time.sleep(0.1)
    done = {p.stem for p in (out / "_parts").glob("part-*.json")}
    finished = {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir() if p.name.split(".")[0] in done}
    assert 2 <= len(finished) < 10
    assert json.loads((out / "dstool.json").read_text())["status"] == "running"

    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    from dstool.cli import commands as cli_module

    rerun = subprocess.run([str(submit), "--master", "local[2]", cli_module.__file__, *args], capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, PYSPARK_PYTHON=sys.executable))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"({len(finished)} partitions done by an earlier run)" in rerun.stdout
    rows = _rows(out)
    assert rows["row"].tolist() == list(range(300))  # each of the first 300 embedded prompts once
    assert {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir() if p.name in finished} == finished
    assert not list(out.glob("*/.*.tmp*"))
    manifest = json.loads((out / "dstool.json").read_text())
    assert manifest["status"] == "done" and manifest["figures"]["partitions_skipped"] == len(finished)
    assert len(manifest["partitions"]) == 10 and sum(p["rows"] for p in manifest["partitions"]) == 300
    assert (rows["model"] == "dstool_lm").all() and (rows["model_version"] == manifest["deployment"]["version"]).all()
    assert rows["prompt"].str.contains(":\n").all() and (rows["generated_tokens"] >= 1).all()

    spark_log = (out / "spark.log").stat()
    again = cli(*args)  # the whole job done: nothing is recomputed, and no Spark starts to find that out
    assert again.returncode == 0 and "nothing left to do: all 300 rows" in again.stdout
    assert (out / "spark.log").stat() == spark_log
    one_line_usage_error(cli(*args[:-2]), "holds the results of another batch job")  # all 1,000 rows: not done
    assert (out / "spark.log").stat() == spark_log  # refused before Spark starts, too


def test_onnx_engine_equals_infer_and_the_triton_engine_shares_the_gateway_cache(repo, server, redis_server,
                                                                                 tmp_path):
    from dstool.serve.runtime import client

    from gatewaylib import GatewayProcess

    _batch(repository=str(repo), output=str(tmp_path / "onnx"), max_rows=40, max_new_tokens=12, partitions=2)
    offline = _rows(tmp_path / "onnx")
    for i in (0, 17, 39):  # dstool infer through Triton itself: the same text
        text, ids = client.generate_text(server.grpc_url, "grpc", "dstool_lm", offline.prompt[i], 12)
        assert text == offline.text[i] and len(ids) == offline.generated_tokens[i]

    gw = GatewayProcess(tmp_path / "gateway.log", argv=["--upstream", server.http_url, "--upstream-grpc",
                                                        server.grpc_url, "--cache", redis_server.url])
    try:
        _batch(repository=str(repo), output=str(tmp_path / "triton"), max_rows=40, max_new_tokens=12, engine="triton",
               url=gw.grpc_url, concurrency=4)
        through_triton = _rows(tmp_path / "triton")
        assert through_triton.text.tolist() == offline.text.tolist()
        misses = gw.metric("dstool_gateway_cache_misses_total", model="dstool_lm_generate")
        assert misses >= 1
        hits = gw.metric("dstool_gateway_cache_hits_total", model="dstool_lm_generate")
        text, _ = client.generate_text(gw.grpc_url, "grpc", "dstool_lm", offline.prompt[5], 12)  # online, after
        assert text == offline.text[5]
        assert gw.metric("dstool_gateway_cache_hits_total", model="dstool_lm_generate") == hits + 1
        assert gw.metric("dstool_gateway_cache_misses_total", model="dstool_lm_generate") == misses
    finally:
        gw.stop()


@pytest.mark.slow
def test_scores_equal_pytorch_in_every_input_format_and_jsonl_output(trained, repo, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = ["ROMEO:\nBut soft, what light through yonder window breaks?", "JULIET:\nO Romeo", "A"]
    pd.DataFrame({"text": texts, "id": [10, 11, 12]}).to_parquet(tmp_path / "in.parquet")
    pd.DataFrame({"text": texts, "id": [10, 11, 12]}).to_csv(tmp_path / "in.csv", index=False)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    results = {}
    for fmt in ("parquet", "csv", "jsonl"):
        out = tmp_path / f"score-{fmt}"
        _batch(input=str(tmp_path / f"in.{fmt}"), repository=str(repo), output=str(out), task="score",
               column="text", format="jsonl" if fmt == "jsonl" else "parquet")
        read = (lambda p: pd.read_json(p, lines=True)) if fmt == "jsonl" else pd.read_parquet
        results[fmt] = pd.concat(read(p) for p in sorted((out / "rows").glob("part-*"))).sort_values("row")
    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    tok = AutoTokenizer.from_pretrained(trained)
    for i, text in enumerate(texts):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        want = float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].sum())
        for fmt, got in results.items():
            row = got.iloc[i]
            assert row["tokens"] == ids.shape[1] and abs(row["logprob"] - want) < 1e-3 * max(1, abs(want)), fmt
    one_token = results["parquet"].iloc[2]
    assert one_token["tokens"] == 1 and one_token["logprob"] == 0 and pd.isna(one_token["perplexity"])
    assert results["csv"]["id"].astype(int).tolist() == [10, 11, 12]  # the input columns come along


@pytest.mark.slow
def test_bad_input_is_one_line_or_recorded_per_row(repo, tmp_path):
    result = cli("batch", str(tmp_path / "missing.jsonl"), "--repository", str(repo), "--output", str(tmp_path / "o"))
    one_line_usage_error(result, "does not exist")
    one_line_usage_error(cli("batch", "--repository", str(tmp_path), "--output", str(tmp_path / "o")),
                         "not a model repository")
    one_line_usage_error(cli("batch", "--repository", str(repo), "--engine", "triton", "--url", "127.0.0.1:1",
                             "--output", str(tmp_path / "o")), "no Triton or dstool gateway answers gRPC")
    (tmp_path / "a-file").write_text("")
    one_line_usage_error(cli("batch", "--repository", str(repo), "--output", str(tmp_path / "a-file")), "is a file")
    one_line_usage_error(cli("batch", "--repository", str(repo), "--conf", "spark.x"), "--conf takes KEY=VALUE")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UsageError, match="is empty"):
        _batch(input=str(tmp_path / "empty.jsonl"), repository=str(repo), output=str(tmp_path / "o1"))
    rows = [{"prompt": "ROMEO:\nHello"}, {"prompt": "word " * 1100}, {"prompt": ""}, {"other": 1},
            {"prompt": "JULIET:\nGood night"}, {"prompt": "To be. " * 50_000}]  # the last refused untokenized
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError, match="no column 'text'.*--column"):
        _batch(input=str(tmp_path / "in.jsonl"), repository=str(repo), output=str(tmp_path / "o2"), column="text")
    with pytest.raises(UsageError, match=r"row 1: prompt \(\d+ tokens\) \+ max_new_tokens .*--on-error record"):
        _batch(input=str(tmp_path / "in.jsonl"), repository=str(repo), output=str(tmp_path / "o3"), partitions=1)
    m = _batch(input=str(tmp_path / "in.jsonl"), repository=str(repo), output=str(tmp_path / "o3"), partitions=1,
               on_error="record")  # the same job, resumed: the failed run wrote nothing
    assert m.figures.rows == 2 and m.figures.failed == 4
    assert _rows(tmp_path / "o3")["row"].tolist() == [0, 4]
    failures = [json.loads(line) for line in (tmp_path / "o3" / "failures.jsonl").read_text().splitlines()]
    assert [f["row"] for f in failures] == [1, 2, 3, 5]
    assert "exceed the model's" in failures[0]["error"] and "empty" in failures[1]["error"]
    assert "missing" in failures[2]["error"] and failures[2]["other"] == 1
    assert "more than the model's 1024 positions can hold" in failures[3]["error"]
    with pytest.raises(UsageError, match="another batch job.*--overwrite"):
        _batch(input=str(tmp_path / "in.jsonl"), repository=str(repo), output=str(tmp_path / "o3"), partitions=1,
               max_new_tokens=3)
    numbers = [{"id": 1, "prompt": "KING:"}, {"id": 2, "prompt": "QUEEN:"}]
    (tmp_path / "numbers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in numbers))
    for flag, column, needle in (("--ids-column", "id", "column 'id' holds bigint values, not lists of token ids"),
                                 ("--column", "id", "column 'id' holds bigint values, not text")):
        one_line_usage_error(cli("batch", str(tmp_path / "numbers.jsonl"), "--repository", str(repo), flag, column,
                                 "--output", str(tmp_path / "o5")), needle)
    ids = [{"ids": [5, 6, 7]}, {"ids": [1, 10 ** 9]}]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids))
    m = _batch(input=str(tmp_path / "ids.jsonl"), repository=str(repo), output=str(tmp_path / "o4"),
               ids_column="ids", on_error="record", max_new_tokens=4)
    assert m.figures.rows == 1 and "outside the vocabulary" in (tmp_path / "o4" / "failures.jsonl").read_text()


def test_a_json_schema_per_job_and_per_row(repo, tmp_path):
    """Every answer follows its row's schema, or the job's (the grammar runs in the executors' sampler)."""
    import jsonschema

    job = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "required": ["name", "age"]}
    own = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    rows = [{"prompt": f"KING {i}:", "schema": json.dumps(own) if i % 2 else None} for i in range(6)]
    rows.append({"prompt": "QUEEN:", "schema": "{not json"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = _batch(input=str(tmp_path / "in.jsonl"), repository=str(repo), output=str(tmp_path / "o"), partitions=1,
               json_schema=str(tmp_path / "job.json"), schema_column="schema", max_new_tokens=120, temperature=1.0,
               seed=4, on_error="record")
    assert m.figures.rows == 6 and m.figures.failed == 1
    for _, row in _rows(tmp_path / "o").iterrows():
        assert row["finish_reason"] == "stop", row["text"]
        jsonschema.validate(json.loads(row["text"]), own if row["row"] % 2 else job)
    assert "schema is not a JSON schema" in (tmp_path / "o" / "failures.jsonl").read_text()
    (tmp_path / "bad.json").write_text('{"type": "integr"}')
    one_line_usage_error(cli("batch", "--repository", str(repo), "--json-schema", str(tmp_path / "bad.json")),
                         "integr")
    one_line_usage_error(cli("batch", "--repository", str(repo), "--json-schema", str(tmp_path / "job.json"),
                             "--engine", "triton"), "--engine onnx")
