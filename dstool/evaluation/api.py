"""`run_eval(config)`: what `dstool eval` does. The tasks are written as lm-evaluation-harness configs over local
documents (dstool.evaluation.tasks), then lm-eval scores them in a process of its own virtual environment
(dstool.evaluation.harness), on one of three paths: the Hugging Face folder in-process, the ONNX logits graph
in-process, or a served model through its OpenAI /v1/completions route."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from dstool import __version__, gguf
from dstool import log as dlog
from dstool.artifacts import CompressedModel, ManifestError, kind_of, model_hint
from dstool.errors import EngineFailed, UsageError
from dstool.evaluation import tasks as task_defs
from dstool.evaluation.config import EvalConfig
from dstool.files import cache_dir, write_text_atomic

log = dlog.log
HARNESS = Path(__file__).with_name("harness.py")
BOOTSTRAP_ITERS = 100  # lm-eval's resampling for the stderr of perplexity-like metrics (acc's is analytic)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TaskResult(BaseModel):
    """One task's scores, as lm-evaluation-harness reports them."""

    metric: str = Field(description="the metric that sums the task up (tables, recovery)")
    value: float | None
    higher_is_better: bool
    metrics: dict[str, float | None] = Field(description="every metric lm-eval reports, with its stderr (_stderr)")
    docs: int = Field(description="documents scored")
    docs_available: int = Field(description="documents the task has")
    chat_template: bool = Field(description="scored with the model's chat template (--apply_chat_template)")
    seconds: float = Field(description="lm-eval's time on it (a call's time shared by the tasks it ran)")
    documents_sha256: str = Field(description="of the task's documents file (tasks/NAME.jsonl)")
    responses: list[list[list[float]]] = Field(description="per document, per request: [log-likelihood] or "
                                               "[log-likelihood, greedy]")


class EvalReport(BaseModel):
    """What `dstool eval` writes to OUTPUT/results.json."""

    model: str = Field(description="--model as given")
    path: Literal["hf", "onnx", "completions"] = Field(description="hf: transformers in-process; onnx: the ONNX "
                                                       "logits graph in-process; completions: a served model")
    scored: str = Field(description="the folder, graph or URL that was scored")
    served_model: str | None = None
    tokenizer: str
    limit: int | None
    tasks: dict[str, TaskResult]
    lm_eval: str = Field(description="lm-evaluation-harness version")
    seconds: float = Field(description="the harness process, model load included")
    load_seconds: float
    machine: str
    dstool_version: str = __version__
    created: str = Field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def scores(self) -> dict[str, float | None]:
        """Each task's summary metric."""
        return {name: t.value for name, t in self.tasks.items()}


def recovery(parent: EvalReport, variant: EvalReport) -> dict[str, float | None]:
    """Per task both reports hold, how much of the parent's score the variant keeps, in %: variant / parent x 100
    for higher-is-better metrics, parent / variant x 100 for lower-is-better ones (perplexity); None where a score is
    missing or zero."""
    out: dict[str, float | None] = {}
    for name, p in parent.tasks.items():
        v = variant.tasks.get(name)
        if v is None:
            continue
        a, b = (v.value, p.value) if p.higher_is_better else (p.value, v.value)
        out[name] = None if a is None or not b else a / b * 100
    return out


def lm_eval_venv(given: str | None) -> Path:
    venv = Path(given or os.environ.get("DSTOOL_LM_EVAL_VENV") or cache_dir() / "lm-eval-venv")
    if not (venv / "bin" / "python").is_file():
        raise UsageError(f"no lm-evaluation-harness virtual environment at {venv}: make it with "
                         "scripts/lm-eval-venv.sh (lm-eval runs in a venv of its own), or pass --lm-eval-venv")
    return venv


def _has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _tokenizer(cfg: EvalConfig, default: Path | None) -> Path:
    folder = Path(gguf.resolve(cfg.tokenizer)) if cfg.tokenizer else default
    if folder is None:
        raise UsageError(f"--model {cfg.model} does not say which tokenizer it uses: pass --tokenizer DIR (a Hugging "
                         "Face folder holding tokenizer.json)")
    if not _has_tokenizer(folder):
        raise UsageError(f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): pass --tokenizer DIR")
    return folder


def _compressed(ref: Path) -> CompressedModel:
    try:
        return CompressedModel.read(ref)
    except ManifestError as e:
        raise UsageError(str(e)) from None


def resolve(cfg: EvalConfig) -> tuple[str, Path | str, Path]:
    """(path, what it scores, tokenizer folder) for the config, or a one-line UsageError."""
    ref = Path(cfg.model)
    if cfg.url is not None:
        url = cfg.completions_url
        assert url is not None
        if kind_of(ref) == "compressed-model":
            return "completions", url, _tokenizer(cfg, ref / _compressed(ref).model)
        folder = Path(gguf.resolve(cfg.model)) if not ref.suffix == ".onnx" else ref.parent
        return "completions", url, _tokenizer(cfg, folder if _has_tokenizer(folder) else None)
    if ref.suffix == ".onnx":
        if not ref.is_file():
            raise UsageError(f"model {cfg.model} does not exist: pass an ONNX logits graph (model.onnx)")
        return "onnx", ref, _tokenizer(cfg, ref.parent if _has_tokenizer(ref.parent) else None)
    if kind_of(ref) == "compressed-model":
        manifest = _compressed(ref)
        graph = ref / manifest.graphs["logits"].path
        if not graph.is_file():
            raise UsageError(f"{ref}: its logits graph {graph} is missing: re-run `dstool compress`")
        return "onnx", graph, _tokenizer(cfg, ref / manifest.model)
    if not ref.exists() and cfg.model not in gguf.KNOWN:
        raise UsageError(f"model {cfg.model} does not exist: pass a Hugging Face folder, a .gguf, a compress output, "
                         f"an .onnx graph or one of {', '.join(gguf.KNOWN)}")
    folder = Path(gguf.resolve(cfg.model))
    if not (folder / "config.json").is_file():
        raise UsageError(f"model {cfg.model} is no Hugging Face folder (no config.json){model_hint(folder)}")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise UsageError(f"model folder {folder} has no weights (*.safetensors or *.bin)")
    return "hf", folder, _tokenizer(cfg, folder)


def _check_served(url: str, name: str) -> None:
    """The server answers GET /v1/models and lists `name`, else a one-line UsageError."""
    models_url = url.removesuffix("/completions") + "/models"
    try:
        with urllib.request.urlopen(models_url, timeout=30) as r:
            listed = [m.get("id") for m in json.loads(r.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UsageError(f"--url {url}: GET {models_url} failed ({getattr(e, 'reason', e)}): is the gateway "
                         "running there?") from None
    if name not in listed:
        raise UsageError(f"--served-model {name} is not served at {models_url} (it lists: "
                         f"{', '.join(map(str, listed)) or 'nothing'})")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def _run_harness(venv: Path, spec: dict, out: Path) -> dict:
    """The harness in lm-eval's venv; its output to OUTPUT/lm_eval.log (and the console with -v)."""
    spec_file, logfile = out / "harness-spec.json", out / "lm_eval.log"
    write_text_atomic(spec_file, json.dumps(spec, indent=1) + "\n")
    with tempfile.TemporaryDirectory(prefix="dstool-eval-") as datasets_cache:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": datasets_cache, "PYTHONUNBUFFERED": "1"}
        with open(logfile, "w", encoding="utf-8") as f:
            proc = subprocess.Popen([str(venv / "bin" / "python"), str(HARNESS), str(spec_file)], cwd=out, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                if dlog.verbose():
                    sys.stderr.write(line)
            code = proc.wait()
    if code:
        lines = [x for x in logfile.read_text(errors="replace").splitlines() if x.strip()]
        raise EngineFailed(f"lm-evaluation-harness exited with code {code}: {lines[-1] if lines else '(no output)'}",
                           log=logfile)
    return json.loads(Path(spec["output"]).read_text())


def run_eval(cfg: EvalConfig) -> EvalReport:
    """Score the model on the tasks; the report is also written to OUTPUT/results.json."""
    path, scored, tokenizer = resolve(cfg)
    venv = lm_eval_venv(cfg.lm_eval_venv)
    if path == "onnx" and not any(venv.glob("lib/python*/site-packages/onnxruntime/__init__.py")):
        raise UsageError(f"lm-eval's venv {venv} has no onnxruntime (made before `dstool eval` needed it): run "
                         "scripts/lm-eval-venv.sh again")
    names = list(cfg.tasks)
    if "convo_chat" in names and not _has_chat_template(tokenizer):
        if "tasks" in cfg.model_fields_set:
            raise UsageError(f"task convo_chat renders a chat template, and {tokenizer} has none: leave it out of "
                             "--tasks")
        log.warning(f"{tokenizer} has no chat template: convo_chat left out")
        names.remove("convo_chat")
    if path == "completions":
        assert cfg.served_model is not None
        _check_served(str(scored), cfg.served_model)
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file: pass a folder for --output")
    out.mkdir(parents=True, exist_ok=True)
    dlog.to_file(out / "eval.log")
    folder = out / "tasks"
    shutil.rmtree(folder, ignore_errors=True)
    digests = task_defs.write_tasks(names, folder)
    spec = {"backend": path, "model": str(scored), "tokenizer": str(tokenizer), "url": str(scored),
            "served_model": cfg.served_model, "max_length": cfg.max_length, "batch_size": cfg.batch_size,
            "include_path": str(folder.resolve()), "limit": cfg.limit, "bootstrap_iters": BOOTSTRAP_ITERS,
            "tasks": [n for n in names if not task_defs.TASKS[n].chat],
            "chat_tasks": [n for n in names if task_defs.TASKS[n].chat],
            "output": str((out / "harness-results.json").resolve())}
    log.info(f"dstool eval: {', '.join(names)} on {scored} ({path}) with lm-evaluation-harness"
             f"{f', {cfg.limit} documents a task' if cfg.limit else ''}")
    raw = _run_harness(venv, spec, out)
    results = {}
    for name in names:
        task, got = task_defs.TASKS[name], raw["tasks"][name]
        results[name] = TaskResult(metric=task.primary, value=got["metrics"].get(task.primary),
                                   higher_is_better=task.higher_is_better, metrics=got["metrics"], docs=got["docs"],
                                   docs_available=got["docs_available"], chat_template=got["chat_template"],
                                   seconds=got["seconds"], documents_sha256=digests[name],
                                   responses=got["responses"])
    report = EvalReport(model=cfg.model, path=path, scored=str(scored),
                        served_model=cfg.served_model, tokenizer=str(tokenizer), limit=cfg.limit, tasks=results,
                        lm_eval=raw["lm_eval"], seconds=raw["seconds"], load_seconds=raw["load_s"],
                        machine=_machine())
    write_text_atomic(out / "results.json", report.model_dump_json(indent=1) + "\n")
    return report


def table(report: EvalReport) -> str:
    """The report as a table: a row per task and metric (the summary metric first), stderr beside each."""
    rows = [("task", "metric", "value", "± stderr", "docs", "seconds")]
    for name, t in report.tasks.items():
        metrics = [t.metric] + [m for m in t.metrics if m != t.metric and not m.endswith("_stderr")]
        for i, m in enumerate(metrics):
            v, se = t.metrics.get(m), t.metrics.get(f"{m}_stderr")
            rows.append((name if i == 0 else "", m, "-" if v is None else f"{v:.4f}",
                         "" if se is None else f"{se:.4f}", f"{t.docs}/{t.docs_available}" if i == 0 else "",
                         f"{t.seconds:.1f}" if i == 0 else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)
