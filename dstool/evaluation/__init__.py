"""dstool.evaluation: `dstool eval` — lm-evaluation-harness on tasks built from real data that installs from the
package registries (docs/eval.md), on a Hugging Face folder, an ONNX logits graph (a compress output) or a served
model, with lm-eval run in a virtual environment of its own.

    from dstool.evaluation import evaluate, recovery
    parent = evaluate("smollm2", limit=20)
    int8 = evaluate("runs/int8", limit=20)            # a compress output: its ONNX logits graph
    recovery(parent, int8)                            # {"sotu_ppl": 99.1, "sotu_cloze": 100.0, ...} (%)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstool.evaluation.config import TASK_NAMES, EvalConfig

if TYPE_CHECKING:
    from dstool.evaluation.api import EvalReport


def run_eval(cfg: EvalConfig) -> EvalReport:
    """What `dstool eval` does: the report, also written to OUTPUT/results.json."""
    from dstool.evaluation.api import run_eval as run  # noqa: PLC0415 (the engine loads on first call: the CLI's parser imports this package)

    return run(cfg)


def evaluate(model: str, tasks: list[str] | None = None, limit: int | None = None, **options) -> EvalReport:
    """Score `model` (a Hugging Face folder, .gguf, known name, compress output or .onnx graph; with url= and
    served_model=, a served model) on `tasks` (default all); `report.scores()` is {task: its summary metric}."""
    return run_eval(EvalConfig(model=model, **({"tasks": tasks} if tasks else {}), limit=limit, **options))


def recovery(parent: EvalReport, variant: EvalReport) -> dict[str, float | None]:
    """Per task, the share of the parent's score the variant keeps, in % (perplexity: parent / variant x 100)."""
    from dstool.evaluation.api import recovery as rec  # noqa: PLC0415 (the engine loads on first call: the CLI's parser imports this package)

    return rec(parent, variant)


__all__ = ["TASK_NAMES", "EvalConfig", "evaluate", "recovery", "run_eval"]
