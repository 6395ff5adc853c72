"""`run_batch(config)`: what `dstool batch` does — offline generation or scoring of a data set on Apache Spark.

    from dstool.serve.batch import run_batch
    from dstool.serve.config.client_config import BatchConfig
    manifest = run_batch(BatchConfig(input="prompts.jsonl", output="runs/batch"))

The driver reads the input with Spark (jsonl, parquet, csv, or the embedded held-out prompts), numbers its rows
and cuts them into `partitions` ranges of consecutive rows; each range is one task (`work.run_partition`) that
runs its rows through ONNX Runtime in the executor or through a running Triton / gateway, and writes its own
files atomically: rows/part-N.(parquet|jsonl), failures/part-N.jsonl, then _parts/part-N.json, which marks it
done. A re-run of the same job (same input, model version and options: `job` in dstool.json) skips the done
partitions, so a job killed mid-way loses nothing and duplicates nothing. The output and the repository must be
paths every executor can read and write (one machine, or a shared filesystem on a cluster).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

from dstool import log as dlog
from dstool.artifacts import (
    BatchFigures,
    BatchInput,
    BatchOutput,
    BatchPartition,
    Deployment,
    ManifestError,
    Repository,
    kind_of,
)
from dstool.config import secret_fields
from dstool.corpus import EMBEDDED_PROMPTS, heldout_prompts
from dstool.errors import UsageError
from dstool.files import sha256_file
from dstool.serve.batch import work
from dstool.serve.config.client_config import BatchConfig
from dstool.serve.config.export_config import model_names
from dstool.serve.runtime.client import refusal_hint

log = dlog.log
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}
ROWS_PER_PARTITION = 128


def run_batch(cfg: BatchConfig) -> BatchOutput:
    """Run the job (or the rest of it); returns the finished output's manifest."""
    deployment, plan_args = _model(cfg)
    out = Path(cfg.output).resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {cfg.output} is a file: pass a folder")
    source = _source(cfg)
    if (finished := _earlier_job(cfg, out, source, deployment)) is not None:
        return finished
    if cfg.engine == "triton":
        role = "logits" if cfg.task == "score" else "generate"
        _check_server(cfg.url, plan_args["models"][role], deployment.version, cfg.credentials())
    spark = _session(cfg, out)
    try:
        df = _read(spark, cfg, source)
        numbered, rows = _numbered(df)
        if rows == 0:
            raise UsageError(f"{cfg.input} holds no rows: give a file with at least one")
        partitions = _partitions(cfg, rows)
        source = source.model_copy(update={"rows": rows})
        job = _job_digest(cfg, source, deployment, partitions)
        done = _prepare_output(cfg, out, job)
        manifest = BatchOutput(job=job, status="running", input=source, task=cfg.task, engine=cfg.engine,
                               deployment=deployment,
                               settings=cfg.model_dump(mode="json", exclude=secret_fields(BatchConfig)),
                               planned_partitions=partitions)
        manifest.write(out, hash_files=False)
        log.info(f"dstool batch: {rows} rows of {cfg.input} in {partitions} partitions"
                 + (f" ({len(done)} done by an earlier run)" if done else "")
                 + f"; {cfg.task} with {deployment.name} version {deployment.version} on {cfg.engine}; master "
                 f"{spark.sparkContext.master}")
        from pyspark.sql.pandas.types import to_arrow_schema

        plan = work.Plan(**plan_args, output=str(out), input_schema=to_arrow_schema(df.schema).serialize()
                         .to_pybytes(), rows_per_partition=math.ceil(rows / partitions), done=frozenset(done))
        tasks = _ranges(spark, numbered, rows, partitions, done)
        job_began = time.monotonic()
        with _Progress(spark, partitions):
            try:
                tasks.rdd.mapPartitionsWithIndex(lambda i, rows: work.run_partition(plan, i, rows)).collect()
            except Exception as e:  # a task's error, wrapped by Spark and py4j: ours are one line
                raise _task_error(e) from None
        seconds = time.monotonic() - job_began
        return _finish(out, manifest, partitions, done, seconds)
    finally:
        spark.stop()


def _numbered(df):
    """`df` with `_row`, each row's number in input order (0, 1, ...), and the row count — computed in the JVM
    from each input partition's size (one Spark job, no Python worker): the same input gives the same numbers."""
    from pyspark.sql import functions as F

    tagged = df.withColumn("_in", F.spark_partition_id()).withColumn("_mid", F.monotonically_increasing_id())
    sizes = sorted((r["_in"], r["count"]) for r in tagged.groupBy("_in").count().collect())
    offsets, total = {}, 0
    for part, size in sizes:
        offsets[part] = total
        total += size
    if not offsets:
        return tagged.withColumn("_row", F.lit(0).cast("long")), 0
    start = F.create_map(*[F.lit(x) for kv in offsets.items() for x in kv])
    # monotonically_increasing_id = input partition << 33 | the row's index inside it
    row = start[F.col("_in")] + F.col("_mid").bitwiseAND(F.lit((1 << 33) - 1))
    return tagged.withColumn("_row", row.cast("long")).drop("_in", "_mid"), total


def _ranges(spark, numbered, rows: int, partitions: int, done: set[int]):
    """The rows of output partition k (rows k*per ... (k+1)*per - 1, in order) in Spark partition k, the done ones
    left out — shuffled by the JVM on a key whose hash lands on k (Spark's hash partitioning: pmod(murmur3(key),
    partitions)), so the one Python stage is the one that generates."""
    from pyspark.sql import functions as F

    per = math.ceil(rows / partitions)
    landing = spark.range(0, 64 * partitions).select(
        F.col("id"), F.expr(f"pmod(hash(id), {partitions})").alias("k")).groupBy("k").agg(F.min("id").alias("key"))
    keys = {r["k"]: r["key"] for r in landing.collect()}
    if len(keys) < partitions:
        raise RuntimeError(f"no hash key lands on {partitions - len(keys)} of {partitions} partitions")
    to_key = F.create_map(*[F.lit(x) for kv in keys.items() for x in kv])
    part = F.floor(F.col("_row") / per).cast("int")
    kept = numbered.where(~part.isin(list(done))) if done else numbered
    return (kept.withColumn("_key", to_key[part].cast("long")).repartition(partitions, "_key").drop("_key")
            .sortWithinPartitions("_row"))


def _model(cfg: BatchConfig) -> tuple[Deployment, dict]:
    """The deployment to use (the repository manifest's entry) and what a task needs of it."""
    from dstool.serve.export import repository  # noqa: PLC0415 (the repository module loads onnx and tritonclient: the executors import this package)

    repo = Path(cfg.repository)
    if kind_of(repo) != "model-repository":
        raise UsageError(f"{repo} is not a model repository written by dstool export: run `dstool export MODEL "
                         f"--repository {repo}` (or `dstool pipeline`) first, or pass --repository")
    try:
        manifest = Repository.read(repo)
    except ManifestError as e:
        raise UsageError(str(e)) from None
    mine = [d for d in manifest.deployments if d.name == cfg.model]
    if not mine:
        raise UsageError(f"{repo} holds no model '{cfg.model}' (it has: "
                         f"{', '.join(sorted({d.name for d in manifest.deployments})) or 'none'}): pass --model")
    chosen = [d for d in mine if cfg.version in (None, d.version)]
    if not chosen:
        raise UsageError(f"{repo}: '{cfg.model}' has versions {sorted(d.version for d in mine)}, not "
                         f"{cfg.version}: pass one of them to --version")
    d = max(chosen, key=lambda x: x.version)
    names = model_names(d.name)
    llm = repo / names["llm"]
    params = {k: v.string_value for k, v in repository.read_config(llm / "config.pbtxt").parameters.items()}
    folder = lambda role: (repo / names[role] / str(d.version)).resolve()  # noqa: E731
    for role in ("decoder", "logits", "llm"):
        if not folder(role).is_dir():
            raise UsageError(f"{folder(role)} is missing: the repository does not hold version {d.version} whole; "
                             "re-run dstool export")
    return d, {
        "task": cfg.task, "engine": cfg.engine, "format": cfg.format, "on_error": cfg.on_error,
        "column": cfg.column, "ids_column": cfg.ids_column, "family": d.name, "version": d.version,
        "models": names, "decoder": str(folder("decoder") / "model.onnx"),
        "logits": str(folder("logits") / "model.onnx"), "tokenizer": str(folder("llm")),
        "cache_shapes": repository.cache_shapes(llm / "config.pbtxt"),
        "eos": tuple(json.loads(params["eos_token_ids"])), "max_positions": int(params["max_positions"]),
        "max_prompt_bytes": int(params.get("max_prompt_bytes", 256 * int(params["max_positions"]))),
        "default_new_tokens": int(params["default_max_new_tokens"]), "sampling": json.dumps(
            {**cfg.sampling(), **({"structured_outputs": json.dumps(cfg.structured())} if cfg.json_schema else {})}),
        "schema_column": cfg.schema_column,
        "max_new_tokens": cfg.max_new_tokens, "max_batch": cfg.max_batch, "concurrency": cfg.concurrency,
        "url": cfg.url, "headers": cfg.credentials()}


def _check_server(url: str, model: str, version: int, headers: dict) -> None:
    """--engine triton: the server answers, takes the credentials and serves the version the output will name, else
    one line."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException


    try:
        with grpcclient.InferenceServerClient(url) as client:
            ready = client.is_model_ready(model, str(version), client_timeout=10)
            if ready:
                client.get_model_metadata(model, str(version), headers=headers, client_timeout=10)
    except InferenceServerException as e:
        hint = refusal_hint(str(e.status()))
        if hint:
            raise UsageError(f"the gateway at {url} refused {model}: {e.message()}{hint}") from None
        raise UsageError(f"no Triton or dstool gateway answers gRPC at {url} ({e.message()}): start `dstool serve` "
                         "or pass --url HOST:PORT") from None
    if not ready:
        raise UsageError(f"{url} does not serve {model} version {version}: serve the repository it comes from, or "
                         "pass --version")


def _session(cfg: BatchConfig, out: Path):
    """A Spark session: spark-submit's when this runs under it, else one on `cfg.master` (local[2] by default).
    Spark's own output (the JVM's and its Python workers' stderr) goes to OUTPUT/spark.log, or the console with -v;
    executors run this Python."""
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        raise UsageError("Spark needs Java 17: install it (Debian: openjdk-17-jre-headless) or set JAVA_HOME")
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise UsageError("dstool batch needs pyspark: pip install 'dstool[batch]'") from None
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    out.mkdir(parents=True, exist_ok=True)
    builder = SparkSession.builder.appName(f"dstool batch {out.name}")
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started this Python: its settings rule
    master = cfg.master or ("local[2]" if not under_submit else None)
    if master:
        builder = builder.master(master)
    if master and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.executorEnv.PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"],
                "spark.executorEnv.TRANSFORMERS_VERBOSITY": "error", "spark.python.worker.reuse": "true"}
    builder = builder.config(map={**settings, **cfg.spark_conf})
    if dlog.verbose() or under_submit:
        return builder.getOrCreate()
    with open(out / "spark.log", "ab") as f:  # the JVM started now keeps this file as its stderr
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            return builder.getOrCreate()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _earlier_job(cfg: BatchConfig, out: Path, source: BatchInput, deployment: Deployment) -> BatchOutput | None:
    """What an earlier run left in `out`, decided before Spark starts: the same input and --max-rows have the same
    rows, so its job digest is known now. Another job's output is refused; this job's finished output is returned
    (nothing is left to run); None when there is work to do (nothing there yet, or partitions left to resume)."""
    if cfg.overwrite or not out.is_dir() or kind_of(out) != "batch-output":
        return None
    earlier = BatchOutput.read(out)
    rows = earlier.input.rows
    partitions = _partitions(cfg, rows)
    if (earlier.input.fingerprint != source.fingerprint or earlier.settings.get("max_rows") != cfg.max_rows
            or _job_digest(cfg, source.model_copy(update={"rows": rows}), deployment, partitions) != earlier.job):
        raise _another_job(out)
    if earlier.status != "done" or earlier.figures is None or \
            len(list((out / "_parts").glob("part-*.json"))) != partitions:
        return None
    log.info(f"dstool batch: {rows} rows of {cfg.input} in {partitions} partitions ({partitions} done by an earlier "
             "run)")
    return earlier.model_copy(update={"figures": earlier.figures.model_copy(update={"partitions_skipped": partitions})})


def _another_job(out: Path) -> UsageError:
    return UsageError(f"{out} holds the results of another batch job (other input, model version or options): pass "
                      "--overwrite to replace them, or another --output")


def _partitions(cfg: BatchConfig, rows: int) -> int:
    return cfg.partitions or max(2, math.ceil(rows / ROWS_PER_PARTITION))


def _source(cfg: BatchConfig) -> BatchInput:
    """What the input is (its files checked, their fingerprint), without Spark; `rows` is counted later."""
    if cfg.input == EMBEDDED_PROMPTS:
        return BatchInput(path=EMBEDDED_PROMPTS, format="embedded", rows=0,
                          fingerprint=hashlib.sha256("\n".join(heldout_prompts()).encode()).hexdigest())
    path = Path(cfg.input)
    local = "://" not in cfg.input
    if local and not path.exists():
        raise UsageError(f"input {cfg.input} does not exist: pass a jsonl, parquet or csv file or folder (or omit "
                         "it for the embedded prompts)")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))) \
        if local and path.is_dir() else [path]
    kinds = {FORMATS.get(p.suffix.lower()) for p in files}
    if not files or None in kinds or len(kinds) != 1:
        raise UsageError(f"input {cfg.input}: name a .jsonl, .parquet or .csv file, or a folder of one kind of them "
                         f"(found: {', '.join(sorted({p.suffix or p.name for p in files})) or 'nothing'})")
    fmt = str(kinds.pop())
    if local and all(p.stat().st_size == 0 for p in files):
        raise UsageError(f"input {cfg.input} is empty: give a file with at least one row")
    digest = hashlib.sha256()
    for p in files if local else []:
        digest.update(f"{p.relative_to(path) if path.is_dir() else p.name}:{sha256_file(p)}\n".encode())
    if not local:
        digest.update(cfg.input.encode())
    return BatchInput.model_validate({"path": str(path.resolve()) if local else cfg.input, "format": fmt,
                                      "fingerprint": digest.hexdigest(), "rows": 0})


def _read(spark, cfg: BatchConfig, source: BatchInput):
    """The input as a Spark DataFrame (its first `max_rows` rows), its columns checked."""
    if source.format == "embedded":
        df = spark.createDataFrame([(p,) for p in heldout_prompts()], f"{cfg.column} string")
        return df.limit(cfg.max_rows) if cfg.max_rows else df
    reader, where = spark.read, source.path
    df = {"jsonl": lambda: reader.json(where), "parquet": lambda: reader.parquet(where),
          "csv": lambda: reader.options(header=True, multiLine=True, escape="\"").csv(where)}[source.format]()
    wanted = cfg.ids_column or cfg.column
    if wanted not in df.columns:
        flag = "--ids-column" if cfg.ids_column else "--column"
        raise UsageError(f"input {cfg.input} has no column '{wanted}' (it has: {', '.join(df.columns) or 'none'}): "
                         f"pass {flag} NAME")
    _check_column_type(cfg, df.schema[wanted].dataType)
    if cfg.schema_column is not None and cfg.schema_column not in df.columns:
        raise UsageError(f"input {cfg.input} has no column '{cfg.schema_column}' (it has: {', '.join(df.columns)}): "
                         "--schema-column names the column of JSON schemas")
    return df.limit(cfg.max_rows) if cfg.max_rows else df


def _check_column_type(cfg: BatchConfig, kind) -> None:
    """--column names text, --ids-column lists of token ids (or their text, as csv holds them): one line otherwise,
    before any row runs."""
    from pyspark.sql.types import ArrayType, IntegralType, StringType

    if cfg.ids_column is not None:
        if isinstance(kind, StringType) or (isinstance(kind, ArrayType) and isinstance(kind.elementType,
                                                                                        IntegralType)):
            return
        raise UsageError(f"input {cfg.input}: column '{cfg.ids_column}' holds {kind.simpleString()} values, not "
                         "lists of token ids: --ids-column names a column like [5, 17, 300] (a text column is "
                         "--column)")
    if not isinstance(kind, StringType):
        raise UsageError(f"input {cfg.input}: column '{cfg.column}' holds {kind.simpleString()} values, not text: "
                         "--column names a text column (lists of token ids are --ids-column)")


def _job_digest(cfg: BatchConfig, source: BatchInput, d: Deployment, partitions: int) -> str:
    """What decides the output's rows: a re-run with the same digest resumes."""
    decided = {"input": source.fingerprint, "rows": source.rows, "model": [d.name, d.version, d.graphs],
               "partitions": partitions,
               "structured": cfg.structured(),
               **cfg.model_dump(include={"task", "engine", "column", "ids_column", "schema_column", "max_new_tokens",
                                         "format", *cfg.sampling()})}
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()


def _prepare_output(cfg: BatchConfig, out: Path, job: str) -> set[int]:
    """The partitions an earlier run of this job finished; refuses a folder holding something else."""
    ours = ("rows", "failures", "_parts", "failures.jsonl", "dstool.json")
    kind = kind_of(out)
    if kind == "batch-output":
        earlier = BatchOutput.read(out)
        if earlier.job == job and not cfg.overwrite:
            for stale in out.glob("*/.part-*.tmp*"):  # a killed task's unfinished file
                stale.unlink()
            return {int(p.stem.removeprefix("part-")) for p in (out / "_parts").glob("part-*.json")}
        if not cfg.overwrite:
            raise _another_job(out)
    elif any(p.name != "spark.log" for p in out.iterdir()) and not cfg.overwrite:
        raise UsageError(f"{out} is not empty and not a dstool batch output: pass another --output (or --overwrite "
                         "to write into it)")
    for name in ours:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return set()


def _task_error(e: Exception) -> Exception:
    """A task's failure as the error to show: a row's problem (exit 2) in one line, else the Python error."""
    text = str(e)
    row = re.search(rf"{work.ROW_ERROR}: (row \d+: [^\n]*)", text)
    if row:
        return UsageError(f"{row.group(1)} (--on-error record keeps going and lists such rows in failures.jsonl)")
    python = re.findall(r"\n(\w+(?:Error|Exception)[^\n]*)", text)
    return RuntimeError(python[-1] if python else text.splitlines()[0] if text else type(e).__name__)


def _finish(out: Path, manifest: BatchOutput, partitions: int, done_before: set[int], seconds: float) -> BatchOutput:
    """Gather the partitions' summaries and failures; the manifest, with every file hashed, says the job is done."""
    parts = sorted((BatchPartition.model_validate_json(p.read_text()) for p in (out / "_parts").glob("part-*.json")),
                   key=lambda p: p.index)
    if len(parts) != partitions:
        raise RuntimeError(f"{partitions - len(parts)} of {partitions} partitions have no results after the job")
    failures = sorted((out / "failures").glob("part-*.jsonl"))
    if failures:
        with open(out / "failures.jsonl", "w") as f:
            for p in failures:
                f.write(p.read_text())
    here = [p for p in parts if p.index not in done_before]
    per_s = lambda n: round(n / seconds, 2) if seconds > 0 else 0.0  # noqa: E731
    figures = BatchFigures(rows=sum(p.rows for p in parts), failed=sum(p.failed for p in parts),
                           prompt_tokens=sum(p.prompt_tokens for p in parts),
                           generated_tokens=sum(p.generated_tokens for p in parts), seconds=round(seconds, 3),
                           rows_per_s=per_s(sum(p.rows + p.failed for p in here)),
                           generated_tokens_per_s=per_s(sum(p.generated_tokens for p in here)),
                           partitions_skipped=len(done_before))
    manifest = manifest.model_copy(update={"status": "done", "partitions": parts, "figures": figures,
                                           "failures": "failures.jsonl" if failures else None})
    manifest.write(out)
    return manifest


class _Progress:
    """One line each time more partitions are done (Spark's status tracker, polled every 2 s)."""

    def __init__(self, spark, total: int):
        self.tracker, self.total = spark.sparkContext.statusTracker(), total
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _poll(self):
        shown = 0
        while not self.stop.wait(2.0):
            stages = [self.tracker.getStageInfo(s) for s in self.tracker.getActiveStageIds()]
            stages = [s for s in stages if s is not None and s.numTasks == self.total]
            if stages and stages[0].numCompletedTasks != shown:
                shown = stages[0].numCompletedTasks
                log.info(f"dstool batch: {shown}/{self.total} partitions done, {stages[0].numActiveTasks} running")
