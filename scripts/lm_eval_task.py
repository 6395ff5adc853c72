"""A small lm-evaluation-harness task made from dstool's own corpus (tiny Shakespeare), for scoring a model served on
the gateway's /v1/completions with lm_eval's `local-completions` (which asks for `echo` and the prompt's logprobs)
without fetching a data set: each document is a speech's first line, and the choices are its true next line and three
next lines of other speeches (multiple choice: acc, acc_norm).

    .venv/bin/python scripts/lm_eval_task.py OUT [--docs 40]      # writes OUT/dstool_plays.yaml, OUT/plays.jsonl
    VENV/bin/lm_eval --model local-completions --include_path OUT --tasks dstool_plays \\
        --model_args model=dstool_lm,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=MODEL_DIR,\\
    tokenizer_backend=huggingface,batch_size=8

(VENV: scripts/lm-eval-venv.sh makes it.) Standard library only: it runs in either virtual environment.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "dstool" / "data" / "tinyshakespeare.txt.gz"
YAML = """task: dstool_plays
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: "\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def documents(count: int, seed: int = 0) -> list[dict]:
    """`count` documents: a speech's speaker and first line as the context, its next line among three others."""
    speeches = [block.split("\n") for block in gzip.open(CORPUS, "rt").read().split("\n\n")]
    speeches = [s for s in speeches if len(s) >= 3 and s[0].endswith(":") and all(len(x) > 8 for x in s[1:3])]
    rng = random.Random(seed)
    picked = rng.sample(speeches, count * 4)
    docs = []
    for i in range(count):
        speech, others = picked[i], picked[count + 3 * i:count + 3 * i + 3]
        choices = [speech[2]] + [o[2] for o in others]
        rng.shuffle(choices)
        docs.append({"context": f"{speech[0]}\n{speech[1]}", "choices": choices, "answer": choices.index(speech[2])})
    return docs


def write(out: Path, count: int = 40) -> Path:
    """The task's folder (for lm_eval's --include_path): its YAML and its documents."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "plays.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in documents(count)))
    (out / "dstool_plays.yaml").write_text(YAML.format(data=json.dumps(str(data))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the task's folder")
    parser.add_argument("--docs", type=int, default=40, help="documents (default 40)")
    args = parser.parse_args()
    print(write(args.out, args.docs))


if __name__ == "__main__":
    main()
