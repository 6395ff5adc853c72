"""DeepSpeed checkpoints that are atomic, hashed, and verified before they are resumed from.

Layout: checkpoints/step-00000100/ is a genuine DeepSpeed tag folder (every rank's files) plus a
dstool.json sha256 manifest; checkpoints/latest names the newest complete tag, as DeepSpeed's own
`latest` file does. A tag is written as .partial-step-…, hashed, then renamed, and only then does
`latest` move: a crash mid-save leaves a partial folder that is never resumed from.

A checkpoint saved on another world size is loaded through DeepSpeed's universal format:
`universal()` converts it once (ds_to_universal) into checkpoints/universal/step-…, atomically.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from dstool import log as dlog
from dstool.artifacts import Checkpoint, ManifestError, UniversalCheckpoint
from dstool.errors import EngineFailed, UsageError
from dstool.files import replace_folder, write_text_atomic

log = dlog.log
PARTIAL = ".partial-"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def save(engine, root: Path, step: int, client_state: dict, keep: int, shapes: dict[str, list[int]]) -> Path:
    """Every rank writes its shard under a partial tag; rank 0 hashes, renames, moves `latest`, prunes.
    `shapes`: the whole model's `model_shapes`, recorded to refuse resuming another model."""
    tag = tag_for(step)
    partial = PARTIAL + tag
    if dist.get_rank() == 0:  # a partial folder left by a killed attempt may hold other ranks' stale shards
        shutil.rmtree(root / partial, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=partial, client_state=client_state, save_latest=False)
    dist.barrier()
    final = root / tag
    if dist.get_rank() == 0:
        Checkpoint(step=step, world_size=dist.get_world_size(), zero_stage=engine.zero_optimization_stage(),
                   model_shapes=shapes).write(root / partial)
        replace_folder(root / partial, final)
        write_text_atomic(root / "latest", tag)
        for old in complete_tags(root)[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)
            shutil.rmtree(universal_dir(root / old), ignore_errors=True)
    dist.barrier()
    return final


def model_shapes(module) -> dict[str, list[int]]:
    """Every parameter's full shape (ZeRO-3 keeps it in ds_shape), to refuse a checkpoint of another model."""
    return {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}


def complete_tags(root: Path) -> list[str]:
    """Tag folders that were renamed into place, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def find_resume(root: Path, warn=log.warning) -> Path | None:
    """The newest checkpoint that passes its manifest check; damaged ones are reported and skipped."""
    for tag in reversed(complete_tags(root)):
        try:
            Checkpoint.read(root / tag, verify=True)
            return root / tag
        except ManifestError as e:
            warn(f"skipping checkpoint {tag}: {e}")
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


def needs_universal(tag_dir: Path, world: int) -> bool:
    """ZeRO-1/2/3 optimizer shards are split by world size; a different world loads the universal form."""
    saved = manifest(tag_dir)
    return saved.zero_stage > 0 and saved.world_size != world


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


def load_source(tag_dir: Path, world: int) -> tuple[Path, bool]:
    """(folder to load, whether it is universal) for resuming `tag_dir` on `world` ranks."""
    if not needs_universal(tag_dir, world):
        return tag_dir, False
    target = universal_dir(tag_dir)
    UniversalCheckpoint.read(target, verify=True)  # written by `train()` before the ranks started
    return target, True
