"""DeepSpeed checkpoints that are atomic, hashed, and verified before they are resumed from.

Layout: checkpoints/step-00000100/ is a genuine DeepSpeed tag folder (every rank's files) plus a
dstool.json sha256 manifest; checkpoints/latest names the newest complete tag, as DeepSpeed's own
`latest` file does. A tag is written as .partial-step-…, hashed, then renamed, and only then does
`latest` move: a crash mid-save leaves a partial folder that is never resumed from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from dstool.errors import UsageError
from dstool.manifest import ManifestError, verify_manifest, write_manifest, write_text_atomic

KIND = "deepspeed-checkpoint"
PARTIAL = ".partial-"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def save(engine, root: Path, step: int, client_state: dict, keep: int) -> Path:
    """Every rank writes its shard under a partial tag; rank 0 hashes, renames, moves `latest`, prunes."""
    tag = tag_for(step)
    partial = PARTIAL + tag
    engine.save_checkpoint(str(root), tag=partial, client_state=client_state, save_latest=False)
    dist.barrier()
    final = root / tag
    if dist.get_rank() == 0:
        write_manifest(root / partial, KIND, step=step, world_size=dist.get_world_size(),
                       zero_stage=engine.zero_optimization_stage())
        if final.exists():
            shutil.rmtree(final)
        (root / partial).rename(final)
        write_text_atomic(root / "latest", tag)
        for old in complete_tags(root)[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()
    return final


def complete_tags(root: Path) -> list[str]:
    """Tag folders that were renamed into place, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def find_resume(root: Path, warn=print) -> Path | None:
    """The newest checkpoint that passes its manifest check; damaged ones are reported and skipped."""
    for tag in reversed(complete_tags(root)):
        try:
            verify_manifest(root / tag, KIND)
            return root / tag
        except ManifestError as e:
            warn(f"dstool: skipping checkpoint {tag}: {e}")
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
        verify_manifest(p, KIND)
    except ManifestError as e:
        raise UsageError(f"refusing to resume from a damaged checkpoint: {e}") from None
    return p
