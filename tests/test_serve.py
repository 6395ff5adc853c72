"""dstool export + serve: a generated Triton repository, loaded by a real Triton 2.51 (nvidia-pytriton's
binary), queried with the real tritonclient over HTTP and gRPC."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from dstool import decoding as decoding_room
from dstool.artifacts import CompressedModel, Repository
from dstool.errors import EngineFailed, UsageError
from dstool.files import sha256_file
from dstool.proc import free_port
from dstool.serve.config.export_config import RepositorySettings, model_names
from dstool.serve.export import repository
from dstool.serve.runtime import triton
from dstool.serve.runtime.client import generate_text

from conftest import DSTOOL, cli, dstool, one_line_usage_error


def _artefacts(repo: Path, trained: Path) -> repository.Artefacts:
    """The fixture repository's graphs, to write other repositories without exporting again."""
    return repository.Artefacts(logits_onnx=repo / "dstool_lm" / "1" / "model.onnx",
                                decoder_onnx=repo / "dstool_lm_decoder" / "1" / "model.onnx",
                                tokenizer_dir=trained, eos_token_ids=[0], max_positions=1024)


def test_repository_layout_and_schema(repo, trained):
    from tritonclient.grpc import model_config_pb2

    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "dstool_lm", "dstool_lm_decoder", "dstool_lm_detokenizer", "dstool_lm_generate", "dstool_lm_llm",
        "dstool_lm_tokenizer"]
    deployed = Repository.read(repo).deployments
    assert [(d.name, d.version, d.compressed, d.recipe) for d in deployed] == [("dstool_lm", 1, None, None)]
    assert deployed[0].source.kind == "hf-model" and deployed[0].source.path == str(trained.resolve())
    assert deployed[0].graphs == {**{role: sha256_file(repo / model_names("dstool_lm")[role] / "1" / "model.onnx")
                                     for role in ("logits", "decoder")},
                                  "fused": sha256_file(repo / "dstool_lm_llm" / "1" / "fused" / "model.onnx")}
    model = repo / "dstool_lm"
    assert sorted(p.name for p in (model / "1").iterdir() if p.name != "__pycache__") == [
        "model.onnx", "model.onnx.data", "model.py", "ort_options.py"]  # (and __pycache__ once Triton loaded it)
    cfg = repository.validate(model / "config.pbtxt", model / "1" / "model.onnx")
    assert cfg.backend == "python" and cfg.max_batch_size == 8
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8] and cfg.model_warmup
    assert all(t.allow_ragged_batch for t in cfg.input)  # mixed lengths batch together (the model pads)

    decoder = repository.validate(repo / "dstool_lm_decoder" / "config.pbtxt",
                                  repo / "dstool_lm_decoder" / "1" / "model.onnx")
    past = [t for t in decoder.input if t.name.startswith("past_key_values.")]
    assert decoder.max_batch_size == 0 and len(past) == 8  # 4 layers x keys/values, [batch, kv heads 2, past, 32]
    assert all(list(t.dims) == [-1, 2, -1, 32] for t in past)
    generate = repository.read_config(repo / "dstool_lm_generate" / "config.pbtxt")
    assert [t.name for t in generate.input] == ["text_input", "max_new_tokens", "use_kv_cache", "stop_token_ids"]
    assert generate.dynamic_batching.max_queue_delay_microseconds > 0
    assert (repo / "dstool_lm_tokenizer" / "1" / "tokenizer.json").is_file()
    decoding = sorted(p.name for p in Path(decoding_room.__file__).parent.glob("*.py"))
    for role, beside in (("generate", []), ("llm", ["ort_options.py"])):
        folder = repo / f"dstool_lm_{role}" / "1"  # the decoding room whole beside both text models, as `decoding`
        assert sorted(p.name for p in folder.glob("*.py")) == sorted(["model.py", *beside])
        assert sorted(p.name for p in (folder / "decoding").iterdir() if p.name != "__pycache__") == decoding


def test_decoder_graph_reuses_the_cache(repo, trained):
    """One prefill then single-token steps on the exported decoder give PyTorch's logits for the whole text."""
    from transformers import AutoModelForCausalLM

    from dstool.onnx_export import decoder_parity

    assert decoder_parity(AutoModelForCausalLM.from_pretrained(trained).eval(),
                          repo / "dstool_lm_decoder" / "1" / "model.onnx").diff < 1e-3


def test_onnxruntime_platform_variant_validates(repo, trained, tmp_path):
    settings = RepositorySettings(name="dstool_lm", backend="onnxruntime", instances=2, response_cache=True)
    placed = repository.write_repository(tmp_path / "r", settings, _artefacts(repo, trained))
    cfg = repository.validate(placed["logits"].parent / "config.pbtxt", placed["logits"] / "model.onnx")
    assert cfg.platform == "onnxruntime_onnx" and cfg.instance_group[0].count == 2 and cfg.response_cache.enable
    decoder = repository.validate(placed["decoder"].parent / "config.pbtxt", placed["decoder"] / "model.onnx")
    assert decoder.platform == "onnxruntime_onnx" and not (placed["decoder"] / "model.py").exists()


def test_config_that_disagrees_with_the_graph_is_refused(repo, tmp_path):
    model = repo / "dstool_lm"
    bad = tmp_path / "config.pbtxt"
    bad.write_text((model / "config.pbtxt").read_text().replace("TYPE_FP32", "TYPE_FP16"))
    with pytest.raises(UsageError, match="logits is TYPE_FP16"):
        repository.validate(bad, model / "1" / "model.onnx")
    bad.write_text((model / "config.pbtxt").read_text().replace('"attention_mask"', '"mask"'))
    with pytest.raises(UsageError, match="do not match the ONNX"):
        repository.validate(bad, model / "1" / "model.onnx")


def test_new_version_keeps_the_old_one(repo, trained, tmp_path):
    r = tmp_path / "r"
    settings = RepositorySettings(name="dstool_lm")
    repository.write_repository(r, settings, _artefacts(repo, trained))
    broken = _artefacts(repo, trained)
    broken.decoder_onnx = tmp_path / "missing.onnx"
    with pytest.raises(FileNotFoundError):
        repository.write_repository(r, settings, broken)  # a version that fails to assemble never lands
    repository.write_repository(r, settings, _artefacts(repo, trained))
    for model in model_names("dstool_lm").values():
        assert sorted(p.name for p in (r / model).iterdir()) == ["1", "2", "config.pbtxt"]


@pytest.mark.parametrize("args,needle", [
    (["--name", "bad name/x"], "not a name Triton accepts"),
    (["--max-batch-size", "0"], "cannot be on"),
    (["--instances", "0"], "greater than or equal to 1"),
])
def test_bad_export_options_leave_the_repository_untouched(trained, repo, args, needle):
    before = sorted(str(p) for p in repo.rglob("*"))
    one_line_usage_error(cli("export", str(trained), "--repository", str(repo), *args), needle)
    assert sorted(str(p) for p in repo.rglob("*")) == before


def test_bad_export_inputs(trained, int8_output, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "noweights").mkdir()
    shutil.copy(trained / "config.json", tmp_path / "noweights" / "config.json")
    old = tmp_path / "old_compress"  # what an older dstool compress wrote: no manifest
    shutil.copytree(int8_output, old)
    (old / "dstool.json").unlink()
    (old / "report.json").write_text("{}")
    tampered = tmp_path / "tampered"
    shutil.copytree(int8_output, tampered)
    graph = tampered / CompressedModel.read(tampered).graphs["decoder"].path
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 1
    graph.write_bytes(bytes(data))
    r = ["--repository", str(tmp_path / "r")]
    for args, needle in (([str(trained), "--repository", str(tmp_path / "file")], "is a file"),
                         ([str(tmp_path / "noweights"), *r], "has no weights"),
                         ([str(old), *r], "older dstool compress"),
                         ([str(tampered), *r], "fails its sha256 check"),
                         ([str(tmp_path / "file"), *r], "not a folder"),
                         ([str(tmp_path), *r], "neither a Hugging Face folder"),
                         ([str(trained.parent), *r], f"is a dstool train run; pass its model folder {trained}"),
                         ([str(trained.parent / "checkpoints"), *r], f"pass its model folder {trained}")):
        one_line_usage_error(cli("export", *args), needle)
    assert not (tmp_path / "r").exists()


def test_export_of_a_compress_output_deploys_what_its_manifest_names(int8_output, tmp_path):
    """No glob, no op-type sniffing, no re-quantization: the repository holds the two graphs compress made."""
    compressed = CompressedModel.read(int8_output)
    r = tmp_path / "r"
    result = cli("export", str(int8_output), "--repository", str(r), "--name", "lm8")
    assert result.returncode == 0, result.stderr
    deployed = Repository.read(r).deployments[-1]
    assert deployed.compressed == str(int8_output.resolve()) and deployed.recipe == compressed.recipe
    assert deployed.source == compressed.source
    for role in ("logits", "decoder"):
        assert deployed.graphs[role] == compressed.graphs[role].sha256 == sha256_file(r / model_names("lm8")[role] /
                                                                                       "1" / "model.onnx")
    if "fused" in compressed.graphs:  # NAME_llm's, as compress made it
        assert deployed.graphs["fused"] == compressed.graphs["fused"].sha256 == sha256_file(
            r / "lm8_llm" / "1" / "fused" / "model.onnx")
        repository.validate(r / model_names("lm8")[role] / "config.pbtxt", r / model_names("lm8")[role] / "1" /
                            "model.onnx")
    assert "-bit" in result.stdout or "int8" in result.stdout.lower()


def _ort_logits(repo: Path, ids: np.ndarray) -> np.ndarray:
    from dstool.onnx_export import ort_session, run_logits

    return run_logits(ort_session(repo / "dstool_lm" / "1" / "model.onnx"), ids)


def test_http_and_grpc_match_onnxruntime_and_pytorch(server, repo, trained):
    import tritonclient.grpc as grpc
    import tritonclient.http as http
    from transformers import AutoModelForCausalLM

    ids = np.array([[5, 17, 300, 42, 7, 99, 1000, 3]], dtype=np.int64)
    direct = _ort_logits(repo, ids)
    with torch.no_grad():
        torch_logits = AutoModelForCausalLM.from_pretrained(trained)(input_ids=torch.from_numpy(ids)).logits.numpy()
    for client, url in ((http, server.http_url), (grpc, server.grpc_url)):
        c = client.InferenceServerClient(url)
        assert c.is_server_live() and c.is_model_ready("dstool_lm")
        inputs = []
        for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            t = client.InferInput(name, list(value.shape), "INT64")
            t.set_data_from_numpy(value)
            inputs.append(t)
        logits = c.infer("dstool_lm", inputs).as_numpy("logits")
        c.close()
        assert np.abs(logits - direct).max() < 1e-5
        assert np.abs(logits - torch_logits).max() < 1e-3


def _settled_counts(client, model: str, at_least: int = 0) -> tuple[int, int]:
    """(inference_count, execution_count) from Triton's statistics, which it updates just after answering: read
    until two reads 50 ms apart agree and reach `at_least` inferences (or 5 s pass)."""
    deadline, last = time.monotonic() + 5, None
    while True:
        s = client.get_inference_statistics(model)["model_stats"][0]
        counts = int(s["inference_count"]), int(s["execution_count"])
        if (counts == last and counts[0] >= at_least) or time.monotonic() > deadline:
            return counts
        last = counts
        time.sleep(0.05)


def test_dynamic_batching_under_concurrency(server, repo):
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http as http

    async def load(n: int) -> list[np.ndarray]:
        client = grpc_aio.InferenceServerClient(server.grpc_url)

        async def one(i: int) -> np.ndarray:
            ids = np.array([[i % 50 + 1] * (6 + i % 5)], dtype=np.int64)
            inputs = [grpc_aio.InferInput("input_ids", list(ids.shape), "INT64"),
                      grpc_aio.InferInput("attention_mask", list(ids.shape), "INT64")]
            inputs[0].set_data_from_numpy(ids)
            inputs[1].set_data_from_numpy(np.ones_like(ids))
            return (await client.infer("dstool_lm", inputs)).as_numpy("logits")

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await client.close()

    stats_client = http.InferenceServerClient(server.http_url)
    try:
        inf0, exe0 = _settled_counts(stats_client, "dstool_lm")
        results = asyncio.run(load(48))
        inf1, exe1 = _settled_counts(stats_client, "dstool_lm", inf0 + 48)
    finally:
        stats_client.close()  # an open keep-alive connection would hold up Triton's shutdown
    assert inf1 - inf0 == 48
    assert exe1 - exe0 < 48  # requests were batched together
    ids = np.array([[3] * 8], dtype=np.int64)  # padded batching leaves each request's logits unchanged
    assert np.abs(results[2] - _ort_logits(repo, ids)).max() < 1e-4


def test_serve_reports_a_server_that_never_becomes_ready(tmp_path):
    bad = tmp_path / "repo" / "broken"
    (bad / "1").mkdir(parents=True)
    (bad / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 0\n')  # no model.py
    proc = dstool("serve", "--repository", str(tmp_path / "repo"), "--http-port", str(free_port()), "--grpc-port",
                  str(free_port()), "--metrics-port", str(free_port()), "--log-file", str(tmp_path / "t.log"),
                  "--timeout", "5", check=False, timeout=120)
    assert proc.returncode == 1 and "last log lines" in proc.stderr, proc.stderr  # an engine failure, not usage
    assert len(proc.stderr.strip().splitlines()) == 1 and str(tmp_path / "t.log") in proc.stderr


def test_serve_exits_nonzero_when_triton_dies(repo, tmp_path):
    """A supervisor that restarts a service on failure must see Triton's death: `dstool serve` exits 1."""
    small = tmp_path / "repo"
    shutil.copytree(repo / "dstool_lm", small / "dstool_lm")  # the tensor model alone starts fast
    log = tmp_path / "serve.out"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*DSTOOL, "serve", "--repository", str(small), "--http-port", str(free_port()),
                                 "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--log-file",
                                 str(tmp_path / "t.log")], stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Triton ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        tritons = [p for p in psutil.Process(proc.pid).children() if "tritonserver" in p.name()]
        assert len(tritons) == 1
        tritons[0].send_signal(signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Triton exited on its own" in log.read_text()


def test_triton_stops_cleanly_right_after_it_is_ready(repo, tmp_path):
    """No connection of dstool's own is left open to hold up Triton's shutdown (it waits for open HTTP
    connections until --exit-timeout-secs runs out, then exits 1); garbage collection is off so that a
    leaked client is not closed by chance."""
    small = tmp_path / "repo"
    shutil.copytree(repo / "dstool_lm", small / "dstool_lm")  # the tensor model alone starts fast
    gc.disable()
    try:
        srv = triton.start(small, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                           tmp_path / "triton.log")
        code = srv.stop()
    finally:
        gc.enable()
    log = srv.log_path.read_text()
    assert code == 0 and "Exit timeout expired" not in log, srv.log_tail(30)
    assert "Timeout 9: Found 1 HTTP service connections" not in log


def _aborting(real: triton.TritonBinary, folder: Path, message: str, times: int) -> triton.TritonBinary:
    """The real tritonserver behind a script that, its first `times` runs, writes `message` and aborts (SIGABRT)."""
    runs, script = folder / "runs", folder / "tritonserver"
    script.write_text(f"""#!/bin/bash
echo run >> {runs}
if [ "$(wc -l < {runs})" -le {times} ]; then echo "{message}"; kill -ABRT $$; fi
exec {real.executable} "$@"
""")
    script.chmod(0o755)
    return triton.TritonBinary(script, real.backend_dir, real.cache_dir, real.env)


def test_a_start_aborted_as_a_stub_starts_is_made_again_and_no_other_failure_is(repo, tmp_path):
    """Triton 2.51 aborts when it killed a python-backend stub that was not up within 10 s (a loaded machine): that
    start is made once more; any other death before ready is the error it was, at once."""
    small = tmp_path / "repo"
    shutil.copytree(repo / "dstool_lm", small / "dstool_lm")
    real = triton.find_tritonserver()
    lock = "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"
    (tmp_path / "a").mkdir()
    srv = triton.start(small, _aborting(real, tmp_path / "a", lock, 1), free_port(), free_port(), free_port(),
                       tmp_path / "a" / "triton.log")
    try:
        assert srv.proc.poll() is None and (tmp_path / "a" / "runs").read_text().count("run") == 2
    finally:
        assert srv.stop() == 0
    (tmp_path / "b").mkdir()
    with pytest.raises(EngineFailed, match="code -6"):
        triton.start(small, _aborting(real, tmp_path / "b", "Segmentation fault", 1), free_port(), free_port(),
                     free_port(), tmp_path / "b" / "triton.log")
    assert (tmp_path / "b" / "runs").read_text().count("run") == 1
    (tmp_path / "c").mkdir()
    with pytest.raises(EngineFailed, match="lock_exception"):  # twice: the second is the error
        triton.start(small, _aborting(real, tmp_path / "c", lock, 2), free_port(), free_port(), free_port(),
                     tmp_path / "c" / "triton.log")
    assert (tmp_path / "c" / "runs").read_text().count("run") == 2


def _torch_greedy(trained: Path, prompt: str, new_tokens: int) -> tuple[str, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(trained).eval().generate(
            ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    return tokenizer.decode(out, skip_special_tokens=True), out.tolist()


def test_generated_text_equals_pytorch_greedy(server, trained):
    prompt = "ROMEO:\nBut soft, what light"
    expected = _torch_greedy(trained, prompt, 20)
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        for use_kv_cache in (True, False):
            assert generate_text(url, protocol, "dstool_lm", prompt, 20, use_kv_cache) == expected
    proc = dstool("infer", prompt, "--max-new-tokens", "20", "--url", server.grpc_url, "--protocol", "grpc")
    assert proc.stdout == prompt + expected[0] + "\n"


def test_concurrent_prompts_are_batched_and_each_stays_exact(server, trained):
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http as http

    prompts = [f"{name}:\n" + "Now is the winter " * (1 + i % 3) for i, name in
               enumerate(["GLOUCESTER", "KING RICHARD", "QUEEN", "LADY ANNE", "BUCKINGHAM", "HASTINGS"])]

    async def load() -> list[list[int]]:
        client = grpc_aio.InferenceServerClient(server.grpc_url)

        async def one(prompt: str) -> list[int]:
            inputs = [grpc_aio.InferInput("text_input", [1, 1], "BYTES"),
                      grpc_aio.InferInput("max_new_tokens", [1, 1], "INT32")]
            inputs[0].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
            inputs[1].set_data_from_numpy(np.array([[12]], dtype=np.int32))
            return (await client.infer("dstool_lm_generate", inputs)).as_numpy("output_ids")[0].tolist()

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    stats = http.InferenceServerClient(server.http_url)
    try:
        before = _settled_counts(stats, "dstool_lm_generate")
        results = asyncio.run(load())
        after = _settled_counts(stats, "dstool_lm_generate", before[0] + len(prompts))
    finally:
        stats.close()
    assert after[0] - before[0] == len(prompts)
    assert after[1] - before[1] < len(prompts)  # decoded as batches
    assert results == [_torch_greedy(trained, p, 12)[1] for p in prompts]


def test_seeded_sampling_repeats_alone_and_in_a_batch(server, trained):
    """A seeded request gives the same tokens alone, again, and batched with other (seeded and unseeded)
    requests; other seeds give other text; the generate extension takes the same parameters; stop_token_ids stop."""
    import urllib.request

    import tritonclient.grpc.aio as grpc_aio

    prompt = "ROMEO:\nBut soft, what light"

    async def generate(jobs: list[tuple[str, dict, list[int] | None]]) -> list[list[int]]:
        client = grpc_aio.InferenceServerClient(server.grpc_url)

        async def one(text: str, parameters: dict, stop: list[int] | None) -> list[int]:
            values = {"text_input": np.array([[text.encode()]], dtype=np.object_),
                      "max_new_tokens": np.array([[16]], dtype=np.int32)}
            if stop is not None:
                values["stop_token_ids"] = np.array([stop], dtype=np.int64)
            inputs = []
            for name, value in values.items():
                inputs.append(grpc_aio.InferInput(name, list(value.shape), {np.object_: "BYTES", np.int32: "INT32",
                                                                             np.int64: "INT64"}[value.dtype.type]))
                inputs[-1].set_data_from_numpy(value)
            result = await client.infer("dstool_lm_generate", inputs, parameters=parameters)
            return result.as_numpy("output_ids")[0].tolist()

        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            await client.close()

    sampled = {"temperature": 1.2, "top_p": 0.95, "top_k": 200}
    alone = [asyncio.run(generate([(prompt, {**sampled, "seed": seed}, None)]))[0] for seed in (1, 2, 3)]
    again = [asyncio.run(generate([(prompt, {**sampled, "seed": seed}, None)]))[0] for seed in (1, 2, 3)]
    crowd = asyncio.run(generate([(prompt, {**sampled, "seed": 1}, None), ("QUEEN:\n", sampled, None),
                                  (prompt, {**sampled, "seed": 2}, None), ("KING:\nNow", {}, None),
                                  (prompt, {**sampled, "seed": 3}, None), (prompt, sampled, None)]))
    assert alone == again == [crowd[0], crowd[2], crowd[4]]
    greedy = _torch_greedy(trained, prompt, 16)[1]
    assert len({tuple(a) for a in alone}) == 3 and greedy not in alone
    assert crowd[3] == _torch_greedy(trained, "KING:\nNow", 16)[1]  # greedy beside sampled requests

    stop_at = max(i for i, t in enumerate(greedy) if t not in greedy[:i])  # the last token new to the output
    assert asyncio.run(generate([(prompt, {}, [greedy[stop_at]])]))[0] == greedy[:stop_at + 1]

    body = json.dumps({"text_input": prompt, "max_new_tokens": 16, **sampled, "seed": 2}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/dstool_lm_generate/generate", body)
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert json.loads(answer.read())["output_ids"] == alone[1]


def test_llm_model_streams_tokens_and_batches_continuously(server, trained):
    """NAME_llm (decoupled, the continuous-batching engine): over a gRPC stream each token comes as its own
    response, the text adding up to transformers' greedy text; six concurrent streams each stay exact; without
    `stream` one response; the generate extension streams server-sent events; seeds and bad values as NAME_generate."""
    import queue
    import urllib.request

    import tritonclient.grpc as grpc

    prompts = [f"{name}:\n" + "Now is the winter " * (1 + i % 3) for i, name in
               enumerate(["GLOUCESTER", "KING RICHARD", "QUEEN", "LADY ANNE", "BUCKINGHAM", "HASTINGS"])]
    expected = [_torch_greedy(trained, p, 12 + 2 * i) for i, p in enumerate(prompts)]

    def inputs(prompt: str, new_tokens: int, stream: bool):
        values = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                  ("max_new_tokens", np.array([new_tokens], np.int32), "INT32"),
                  ("stream", np.array([stream]), "BOOL")]
        made = []
        for name, value, datatype in values:
            made.append(grpc.InferInput(name, list(value.shape), datatype))
            made[-1].set_data_from_numpy(value)
        return made

    c = grpc.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, p in enumerate(prompts):
            c.async_stream_infer("dstool_lm_llm", inputs(p, 12 + 2 * i, True), request_id=str(i))
        texts, ids, finals = [""] * 6, [[] for _ in prompts], 0
        while finals < 6:
            result, error = answers.get(timeout=120)
            assert error is None, error
            i = int(result.get_response().id)
            texts[i] += result.as_numpy("text_output")[0].decode()
            ids[i] += result.as_numpy("output_ids").tolist()
            finals += result.get_response().parameters["triton_final_response"].bool_param
        assert [(t, x) for t, x in zip(texts, ids)] == expected
        c.async_stream_infer("dstool_lm_llm", inputs(prompts[0], 12, False), request_id="whole")
        result, error = answers.get(timeout=120)
        assert error is None and result.as_numpy("output_ids").tolist() == expected[0][1]
        assert result.as_numpy("text_output")[0].decode() == expected[0][0]
        seeded = []
        for _ in range(2):
            c.async_stream_infer("dstool_lm_llm", inputs(prompts[0], 12, False),
                                 parameters={"temperature": 1.2, "seed": 4})
            result, error = answers.get(timeout=120)
            assert error is None
            seeded.append(result.as_numpy("output_ids").tolist())
        assert seeded[0] == seeded[1] != expected[0][1]
        for parameters, prompt, needle in (({"top_p": 0}, prompts[0], "top_p must be"),
                                           ({}, "", "text_input is empty")):
            c.async_stream_infer("dstool_lm_llm", inputs(prompt, 4, True), parameters=parameters)
            result, error = answers.get(timeout=120)
            assert error is not None and needle in error.message(), error
    finally:
        c.stop_stream()
        c.close()

    body = json.dumps({"text_input": prompts[1], "max_new_tokens": 14, "stream": True}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/dstool_lm_llm/generate_stream", body)
    with urllib.request.urlopen(request, timeout=120) as answer:
        events = [json.loads(line[len(b"data: "):]) for line in answer.read().splitlines() if line.startswith(b"data")]
    assert len(events) == len(expected[1][1]) and "".join(e["text_output"] for e in events) == expected[1][0]
    # the generate extension writes a one-element tensor as a scalar
    assert [e["output_ids"] for e in events] == expected[1][1]


def test_infer_streams_and_samples_from_the_cli(server, trained):
    prompt = "ROMEO:\nBut soft, what light"
    text, _ = _torch_greedy(trained, prompt, 12)
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        proc = dstool("infer", prompt, "--stream", "--max-new-tokens", "12", "--url", url, "--protocol", protocol)
        assert proc.stdout == prompt + text + "\n" and not proc.stderr, proc.stderr
    sampled = [dstool("infer", prompt, "--max-new-tokens", "12", "--temperature", "1.2", "--seed", "9", "--url",
                      server.http_url, *extra).stdout for extra in ([], [], ["--stream"])]
    assert sampled[0] == sampled[1] == sampled[2] != prompt + text + "\n"  # MODEL_generate and MODEL_llm alike
    bad = dstool("infer", "--ids", "1,2", "--stream", "--url", server.http_url, check=False)
    assert bad.returncode == 2 and "give a PROMPT" in bad.stderr


def test_bad_generation_requests_are_one_line_errors(server):
    proc = dstool("infer", "x", "--max-new-tokens", "5000", "--url", server.http_url, check=False)
    assert proc.returncode == 2 and "exceed the model's 1024 positions" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = dstool("infer", "--url", f"127.0.0.1:{free_port()}", "hello", check=False)
    assert proc.returncode == 2 and "dstool serve" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = dstool("infer", "hello", "--ids", "1,2", check=False)
    assert proc.returncode == 2 and "one of the two" in proc.stderr


def test_the_models_answer_client_mistakes_as_client_errors(server):
    """Out-of-vocabulary ids, text that is not UTF-8, an empty or too long prompt: 400 / INVALID_ARGUMENT with a
    message that names the limit, not a 500."""
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
    from tritonclient.utils import InferenceServerException

    def ids_request(module, ids):
        arr = np.asarray([ids], dtype=np.int64)
        inputs = [module.InferInput("input_ids", list(arr.shape), "INT64"),
                  module.InferInput("attention_mask", list(arr.shape), "INT64")]
        inputs[0].set_data_from_numpy(arr)
        inputs[1].set_data_from_numpy(np.ones_like(arr))
        return inputs

    def text_request(module, text: bytes, new_tokens: int = 4):
        inputs = [module.InferInput("text_input", [1, 1], "BYTES"),
                  module.InferInput("max_new_tokens", [1, 1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([[text]], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([[new_tokens]], dtype=np.int32))
        return inputs

    cases = [("dstool_lm", lambda m: ids_request(m, [5, 99999]), "outside the vocabulary 0..4095"),
             ("dstool_lm", lambda m: ids_request(m, [-3, 5]), "outside the vocabulary"),
             ("dstool_lm_generate", lambda m: text_request(m, b"caf\xe9 au lait"), "not valid UTF-8"),
             ("dstool_lm_generate", lambda m: text_request(m, b""), "is empty"),
             ("dstool_lm_generate", lambda m: text_request(m, b"ROMEO:", 5000), "exceed the model's 1024 positions")]
    sampling = [({"temperature": -1}, "temperature must be a number >= 0"),
                ({"top_p": 0.0}, "top_p must be a number > 0 and <= 1"), ({"seed": -5}, "seed must be an integer")]
    for module, url, code in ((thttp, server.http_url, "400"), (tgrpc, server.grpc_url, "INVALID_ARGUMENT")):
        client = module.InferenceServerClient(url)
        try:
            for model, make, needle in cases:
                with pytest.raises(InferenceServerException) as e:
                    client.infer(model, make(module))
                assert needle in e.value.message() and code in str(e.value.status()), (model, str(e.value))
            for parameters, needle in sampling:
                with pytest.raises(InferenceServerException) as e:
                    client.infer("dstool_lm_generate", text_request(module, b"ROMEO:"), parameters=parameters)
                assert needle in e.value.message() and code in str(e.value.status()), (parameters, str(e.value))
        finally:
            client.close()


def test_llm_model_reports_its_queue_and_tokens_on_tritons_metrics(server):
    """NAME_llm's own figures on Triton's /metrics (python-backend custom metrics): the queue wait in decoding
    steps and seconds, time to first token, tokens, sequences by state."""
    import urllib.request

    from llmlib import llm_metrics

    labels = '{model="dstool_lm_llm",version="1"}'
    before = llm_metrics(server)
    body = json.dumps({"text_input": "HASTINGS:\n", "max_new_tokens": 5, "ignore_eos": True}).encode()
    for _ in range(3):
        urllib.request.urlopen(urllib.request.Request(
            f"http://{server.http_url}/v2/models/dstool_lm_llm/generate", body), timeout=120).read()
    running = 'dstool_llm_sequences{model="dstool_lm_llm",state="running",version="1"}'
    deadline = time.monotonic() + 10  # the step's figures are set after its last response went out
    while (after := llm_metrics(server))[running] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f"dstool_llm_generated_tokens_total{labels}") == 15  # ignore_eos: max_new_tokens each
    assert grew(f"dstool_llm_queue_steps_count{labels}") == 3
    assert grew(f"dstool_llm_time_to_first_token_seconds_count{labels}") == 3
    # one request at a time: each joined the next step
    assert grew('dstool_llm_queue_steps_bucket{model="dstool_lm_llm",version="1",le="0"}') == 3
    assert after[running] == 0
