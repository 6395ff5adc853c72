"""How a world of ranks splits into pipeline stages, tensor-parallel groups, data-parallel replicas and expert-parallel
groups, the rule DeepSpeed (AutoEP folding) and Megatron share: each pipeline stage holds world / PP ranks; tensor
parallelism cuts a stage into TP-rank model replicas (DP = stage / TP); expert parallelism folds over the same stage
ranks (EP divides the stage), its expert-data-parallel degree being stage / EP. Importing this loads no torch."""

from __future__ import annotations

from dataclasses import dataclass

from dstool.errors import UsageError


@dataclass(frozen=True)
class Layout:
    world: int
    pipeline: int = 1
    tensor: int = 1
    expert: int = 1

    @property
    def stage(self) -> int:
        """Ranks per pipeline stage."""
        return self.world // self.pipeline

    @property
    def data(self) -> int:
        """Data-parallel replicas of the dense weights."""
        return self.stage // self.tensor

    @property
    def expert_data(self) -> int:
        """Replicas of each routed expert (its weights' data-parallel degree)."""
        return self.stage // self.expert

    def problem(self) -> str | None:
        """Why this world cannot take the layout, with the fix, in one line; None when it can."""
        if self.world % self.pipeline:
            return (f"world size {self.world} is not divisible by --pipeline-stages {self.pipeline}: use a world size "
                    f"that is a multiple of {self.pipeline}")
        for flag, n in (("--tensor-parallel", self.tensor), ("--expert-parallel", self.expert)):
            if self.stage % n:
                ranks = (f"world size {self.world}" if self.pipeline == 1 else
                         f"the {self.stage} ranks of each pipeline stage (world {self.world} / --pipeline-stages "
                         f"{self.pipeline})")
                verb = "is" if self.pipeline == 1 else "are"
                return (f"{ranks} {verb} not divisible by {flag} {n}: use a world size that is a multiple of "
                        f"{self.pipeline * n}")
        return None

    def check(self) -> Layout:
        if why := self.problem():
            raise UsageError(why)
        return self

    def describe(self) -> str:
        """E.g. 'PP2 x TP2 x DP1, EP2 (each routed expert on 1 rank(s) per stage)'."""
        text = f"PP{self.pipeline} x TP{self.tensor} x DP{self.data}"
        return text + (f", EP{self.expert} (each routed expert on {self.expert_data} rank(s) per stage)"
                       if self.expert > 1 else "")
