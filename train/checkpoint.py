"""DeepSpeed checkpoints that are atomic, hashed, and verified before they are resumed from.

Layout: checkpoints/step-00000100/ is a genuine DeepSpeed tag folder (every rank's files) plus a
dstool.json sha256 manifest; checkpoints/latest names the newest complete tag, as DeepSpeed's own
`latest` file does. A tag is written as .partial-step-…, hashed, then renamed, and only then does
`latest` move: a crash mid-save leaves a partial folder that is never resumed from.

A checkpoint saved on another world size is loaded through DeepSpeed's universal format:
`universal()` converts it once (ds_to_universal) into checkpoints/universal/step-…, atomically.

Checkpoints older than the newest --keep-checkpoints are deleted, or with --archive URL copied there first (verified
against their manifest, in a background thread of rank 0 that the next prune waits for: train/archive.py), and
`find_resume` then looks in both tiers. checkpoints/index.json lists every checkpoint of the run and where it lives.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from dstool import log as dlog
from dstool.artifacts import MANIFEST, Checkpoint, ManifestError, UniversalCheckpoint
from dstool.errors import EngineFailed, UsageError
from dstool.files import replace_folder, sha256_file, write_json_atomic, write_text_atomic
from dstool.train.archive import Archive

log = dlog.log
PARTIAL = ".partial-"
INDEX = "index.json"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def save(engine, root: Path, step: int, client_state: dict, keep: int, shapes: dict[str, list[int]],
         adapter: dict | None = None, archive: str | None = None, last: bool = False,
         model_parallel: tuple[int, int] = (1, 1)) -> Path:
    """Every rank writes its shard under a partial tag; rank 0 hashes, renames, moves `latest`, prunes (to
    `archive` when given; the `last` save waits for that copy). `shapes`: the whole model's `model_shapes`, recorded
    to refuse resuming another model; `adapter`: the LoRA adapter's shape when only it trains (the frozen weights
    are then left out); `model_parallel`: (pipeline stages, tensor-parallel ranks), whose files load on that layout
    only."""
    tag = tag_for(step)
    partial = PARTIAL + tag
    if dist.get_rank() == 0:  # a partial folder left by a killed attempt may hold other ranks' stale shards
        shutil.rmtree(root / partial, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=partial, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=adapter is not None)
    dist.barrier()
    final = root / tag
    if dist.get_rank() == 0:
        Checkpoint(step=step, world_size=dist.get_world_size(), zero_stage=engine.zero_optimization_stage(),
                   model_shapes=shapes, lora=adapter, precision=precision(engine),
                   expert_parallel=expert_parallel_size(engine), pipeline_stages=model_parallel[0],
                   tensor_parallel=model_parallel[1]).write(root / partial)
        replace_folder(root / partial, final)
        write_text_atomic(root / "latest", tag)
        prune(root, keep, archive, wait=last)
    dist.barrier()
    return final


class _Background:
    """Rank 0's archive copies: one thread at a time, which the next prune (and the last save) waits for."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def start(self, work: Callable[[], object]) -> None:
        self.wait()
        self.thread = threading.Thread(target=work, name="dstool-archive")
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


_archiving = _Background()


def prune(root: Path, keep: int, archive: str | None = None, wait: bool = False, warn=log.warning) -> None:
    """Checkpoints older than the newest `keep` leave checkpoints/: deleted, or with `archive` copied there, verified
    against their manifest and only then deleted, in a background thread (waited for first by the next prune, and
    at once when `wait`). A copy that fails keeps its checkpoint here, to be tried again at the next prune."""
    _archiving.wait()
    old = complete_tags(root)[:-keep]
    if archive is None:
        for tag in old:
            _drop(root, tag)
        record(root, None)
        return
    record(root, archive)
    if old:
        _archiving.start(lambda: archive_tags(root, old, archive, warn))
        if wait:
            _archiving.wait()


def wait_archived() -> None:
    """Wait for rank 0's archive copy in progress, if any."""
    _archiving.wait()


def archive_tags(root: Path, tags: list[str], archive: str, warn=log.warning) -> list[str]:
    """Copy each tag to the archive, verified, then delete it here; returns the tags archived. A failure is
    reported (`warn`) and keeps that checkpoint hot; it never raises (it runs in a background thread)."""
    done: list[str] = []
    try:
        store = Archive(archive)
    except Exception as e:  # noqa: BLE001
        warn(f"checkpoints {', '.join(tags)} not archived, kept in {root}: {e}")
        return done
    def note(tag: str, **fields) -> None:  # the index is a report: failing to write it stops no copy
        try:
            record(root, archive, tag, **fields)
        except OSError as e:
            warn(f"{root / INDEX} not updated: {e}")

    for tag in tags:
        note(tag, archive=None, archive_status="copying")
        try:
            store.put(root / tag)
        except Exception as e:  # noqa: BLE001 - a network error as much as a damaged file: keep it hot
            warn(f"checkpoint {tag} not archived, kept in {root} (tried again at the next save): {e}")
            note(tag, archive=None, archive_status=f"failed: {e}")
            continue
        _drop(root, tag)
        note(tag, archive=store.where(tag), archive_status="verified")
        log.debug(f"dstool: checkpoint {tag} archived to {store.where(tag)} (verified) and deleted here")
        done.append(tag)
    return done


def settle(root: Path, keep: int, archive: str, warn=log.warning) -> list[str]:
    """Archive what is left outside the window (a copy rank 0 was still making when it exited); returns the tags
    archived. For the launching process, after the ranks are gone."""
    _archiving.wait()
    old = complete_tags(root)[:-keep]
    return archive_tags(root, old, archive, warn) if old else []


def _drop(root: Path, tag: str) -> None:
    shutil.rmtree(root / tag, ignore_errors=True)
    shutil.rmtree(universal_dir(root / tag), ignore_errors=True)


_index_lock = threading.Lock()


def record(root: Path, archive: str | None, tag: str | None = None, /, **fields) -> None:
    """Rewrite checkpoints/index.json (atomically): every checkpoint of the run, step -> `hot` (its folder here,
    relative to the index) and/or `archive` (the URL of its verified copy), `archive_status` (copying, verified,
    failed: why) and `manifest_sha256` (of its dstool.json: which checkpoint it is). `fields` update `tag`'s entry;
    whether each is hot is read from the folder."""
    with _index_lock:
        try:
            raw = json.loads((root / INDEX).read_text())
            entries = {e["tag"]: e for e in raw["checkpoints"]}
        except (OSError, ValueError, KeyError, TypeError):
            entries = {}
        if tag is not None:
            entries.setdefault(tag, {}).update(fields)
        for t in complete_tags(root):
            entries.setdefault(t, {})
        rows = []
        for t, e in sorted(entries.items()):
            hot = (root / t).is_dir()
            row = {"step": int(t.rsplit("-", 1)[1]), "tag": t, "hot": t if hot else None,
                   "archive": e.get("archive"), "archive_status": e.get("archive_status"),
                   "manifest_sha256": e.get("manifest_sha256")}
            if hot and (root / t / MANIFEST).is_file():  # a step saved again is another checkpoint
                row["manifest_sha256"] = sha256_file(root / t / MANIFEST)
            if row["hot"] or row["archive"]:
                rows.append(row)
        root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(root / INDEX, {"archive": archive, "checkpoints": rows})


def precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def expert_parallel_size(engine_or_config) -> int | None:
    """AutoEP's expert-parallel size in an engine's DeepSpeed config (or the config); None without AutoEP."""
    ds = engine_or_config if isinstance(engine_or_config, dict) else engine_or_config.config
    section = ds.get("expert_parallel") or {}
    return section.get("autoep_size", 1) if section.get("enabled") else None


def model_shapes(module) -> dict[str, list[int]]:
    """Every parameter's full shape (ZeRO-3 keeps it in ds_shape), to refuse a checkpoint of another model."""
    return {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}


def complete_tags(root: Path) -> list[str]:
    """Tag folders that were renamed into place, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def find_resume(root: Path, warn=log.warning, archive: str | None = None) -> Path | None:
    """The newest checkpoint that passes its manifest check; damaged ones are reported and skipped. With `archive`,
    archived checkpoints count too (the hot one first at the same step): the one chosen is copied back into
    `root` and verified there, and that folder is returned."""
    store = Archive(archive) if archive else None
    cold: list[str] = []
    if store is not None:
        try:
            cold = store.tags()
        except Exception as e:  # noqa: BLE001
            warn(f"archive {archive} could not be listed ({type(e).__name__}: {e}): resuming from {root} only")
    # newest first; at the same step the hot copy (archived=False) first
    for tag, archived in sorted([(t, False) for t in complete_tags(root)] + [(t, True) for t in cold],
                                key=lambda c: (c[0], not c[1]), reverse=True):
        if not archived:
            try:
                Checkpoint.read(root / tag, verify=True)
                return root / tag
            except ManifestError as e:
                warn(f"skipping checkpoint {tag}: {e}")
            continue
        assert store is not None
        try:
            restored = store.restore(tag, root)
        except Exception as e:  # noqa: BLE001 - a damaged copy as much as one that cannot be read: the next one
            warn(f"skipping archived checkpoint {tag}: {e}")
            continue
        log.info(f"  restored {tag} from the archive {store.where(tag)} (every file's sha256 verified)")
        if tag == complete_tags(root)[-1]:
            write_text_atomic(root / "latest", tag)
        record(root, archive, tag, archive=store.where(tag), archive_status="verified")
        return restored
    return None


def resolve_explicit(path: str) -> Path:
    """A user-named checkpoint (a tag folder, or a checkpoints/ or run folder): verified, else UsageError."""
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        if candidate.is_dir() and (candidate / "latest").is_file():
            p = candidate / (candidate / "latest").read_text().strip()
            break
    if not p.is_dir():
        raise UsageError(f"checkpoint {path} does not exist")
    try:
        Checkpoint.read(p, verify=True)
    except ManifestError as e:
        raise UsageError(f"refusing to resume from a damaged checkpoint: {e}") from None
    return p


def manifest(tag_dir: Path) -> Checkpoint:
    """The checkpoint's manifest (already verified when it was chosen)."""
    return Checkpoint.read(tag_dir)


def saved_world_size(tag_dir: Path) -> int:
    return manifest(tag_dir).world_size


def universal_dir(tag_dir: Path) -> Path:
    return tag_dir.parent / "universal" / tag_dir.name


def needs_universal(tag_dir: Path, world: int, expert_parallel: int | None = None) -> bool:
    """ZeRO-1/2/3 optimizer shards are split by world size, and experts by the expert-parallel size: another world or
    expert sharding loads the universal form."""
    saved = manifest(tag_dir)
    resharded = (saved.expert_parallel or 1) != (expert_parallel or 1)
    return saved.zero_stage > 0 and (saved.world_size != world or resharded)


def universal(tag_dir: Path) -> Path:
    """Convert a verified checkpoint to DeepSpeed's universal format (once; temp folder + rename)."""
    target = universal_dir(tag_dir)
    try:
        UniversalCheckpoint.read(target, verify=True)
        return target
    except ManifestError:
        pass
    tmp = target.with_name(PARTIAL + target.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log.info(f"  converting {tag_dir.name} (saved on {saved_world_size(tag_dir)} ranks) to a universal checkpoint")
    # --inject_missing_state: plain (non-Megatron) ZeRO-1/2 checkpoints lack the universal info block.
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                           "--output_folder", str(tmp), "--inject_missing_state", "--num_extract_workers", "2",
                           "--num_merge_workers", "1"], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EngineFailed(f"ds_to_universal failed on {tag_dir}: {tail[0]}")
    UniversalCheckpoint(**manifest(tag_dir).model_dump(include={"step", "world_size", "zero_stage",
                                                                 "model_shapes"})).write(tmp)
    replace_folder(tmp, target)
    return target


def load_source(tag_dir: Path, world: int, expert_parallel: int | None = None) -> tuple[Path, bool]:
    """(folder to load, whether it is universal) for resuming `tag_dir` on `world` ranks (experts sharded over
    `expert_parallel`)."""
    if not needs_universal(tag_dir, world, expert_parallel):
        return tag_dir, False
    target = universal_dir(tag_dir)
    UniversalCheckpoint.read(target, verify=True)  # written by `train()` before the ranks started
    return target, True
