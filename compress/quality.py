"""A zero-shot task built from the held-out split: which word comes next (cloze, `choices` candidates).

The held-out tokens are decoded back to text. In every line of at least 4 words, one word after the third (chosen
by a seeded generator) is a candidate item if the tokenizer writes it, with its leading space, as one token;
`items` of them, evenly spaced through the text, make the task. An item is the `context` tokens before that word
and `choices` candidate words: the true one and distractors, the words of other candidate items (drawn as often as
they occur there). The logits graph scores each candidate by its log-probability after the context; an item is
right when the true word scores strictly highest. True word and distractors come from one distribution, so a scorer
that ignores the context (word frequency, say) is right about 1/`choices` of the time: chance. Accuracy above that
is what the model makes of the context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dstool.onnx_export import ort_session, run_logits

WORD = re.compile(r" ([A-Za-z]{2,})(?![A-Za-z0-9'])")
MIN_WORDS = 4


@dataclass(frozen=True)
class Cloze:
    """The task: per item, the context tokens and the candidate tokens (the true word first)."""

    contexts: np.ndarray  # [items, context]
    candidates: np.ndarray  # [items, choices]

    @property
    def items(self) -> int:
        return len(self.contexts)

    @property
    def choices(self) -> int:
        return self.candidates.shape[1]


def cloze_task(tokenizer, heldout: np.ndarray, items: int = 200, choices: int = 4, context: int = 48,
               seed: int = 0) -> Cloze:
    """The task on `heldout` (token ids); fewer items where the text holds fewer lines (possibly none)."""
    rng = np.random.default_rng(seed)
    text = tokenizer.decode(np.asarray(heldout[:200_000]).tolist(), skip_special_tokens=True)
    found, start = [], 0  # (offset of the space before the word, the word)
    for line in text.splitlines(keepends=True):
        inner = [m for m in WORD.finditer(line) if len(line[:m.start()].split()) >= 3]
        if len(line.split()) >= MIN_WORDS and inner:
            m = inner[rng.integers(len(inner))]
            found.append((start + m.start(), m[1]))
        start += len(line)
    ids = tokenizer([" " + w for _, w in found], add_special_tokens=False)["input_ids"] if found else []
    single = [(offset, t[0]) for (offset, _), t in zip(found, ids) if len(t) == 1]
    pool = np.array([token for _, token in single], dtype=np.int64)
    picked = np.unique(np.linspace(0, len(single) - 1, num=min(items, len(single))).astype(int)) if single else []
    prefixes = tokenizer([text[max(0, single[i][0] - 8 * context):single[i][0]] for i in picked],
                         add_special_tokens=False)["input_ids"] if single else []
    contexts, candidates = [], []
    for i, prefix in zip(picked, prefixes):
        true = single[i][1]
        others = list(dict.fromkeys(int(t) for t in pool[rng.permutation(len(pool))] if t != true))[:choices - 1]
        if len(prefix) < context or len(others) < choices - 1:  # too near the text's start, too few other words
            continue
        contexts.append(prefix[-context:])
        candidates.append([true, *others])
    return Cloze(np.array(contexts, dtype=np.int64).reshape(-1, context),
                 np.array(candidates, dtype=np.int64).reshape(-1, choices))


@torch.no_grad()
def cloze_accuracy(onnx_path: Path, task: Cloze, batch: int = 32) -> float | None:
    """Share of the task's items whose true word the logits graph scores strictly highest (None: no items)."""
    if not task.items:
        return None
    session, right = ort_session(onnx_path), 0
    for i in range(0, task.items, batch):
        last = torch.from_numpy(run_logits(session, task.contexts[i:i + batch])[:, -1]).float().log_softmax(-1)
        score = last.gather(1, torch.from_numpy(task.candidates[i:i + batch])).numpy()
        right += int((score[:, 0] > score[:, 1:].max(1)).sum())
    return right / task.items
