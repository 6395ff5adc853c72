"""Make dstool/data/conversations-{train,heldout}.jsonl.gz, the real English conversations the real-model fine-tune
(`dstool pipeline --model smollm2`, docs/real-model.md) learns from and is measured on, from the PyPI wheel
chatterbot-corpus (BSD-3-Clause; downloaded with pip, never installed): every English conversation as chat messages
(user, assistant, alternating, ending on the assistant), split by a hash of its first line (1 in 5 held out).

    .venv/bin/python scripts/chat_data.py            # rewrites both files; prints their sizes and digests
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

WHEEL = "chatterbot-corpus==1.3.3"
OUT = Path(__file__).resolve().parent.parent / "dstool" / "data"


def conversations(wheel: Path) -> list[dict]:
    rows = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.startswith("chatterbot_corpus/data/english/")
                           and n.endswith(".yml")):
            for conv in yaml.safe_load(z.read(name)).get("conversations", []):
                lines = [str(t).strip() for t in conv if t is not None and str(t).strip()]
                messages = [{"role": "assistant" if i % 2 else "user", "content": t} for i, t in enumerate(lines)]
                if messages and messages[-1]["role"] == "user":
                    messages.pop()
                if messages:
                    rows.append({"messages": messages, "category": Path(name).stem})
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check",
                        WHEEL, "-d", tmp], check=True)
        rows = conversations(next(Path(tmp).glob("*.whl")))
    held = lambda r: int(hashlib.sha256(r["messages"][0]["content"].encode()).hexdigest(), 16) % 5 == 0  # noqa: E731
    for split, keep in (("train", lambda r: not held(r)), ("heldout", held)):
        path = OUT / f"conversations-{split}.jsonl.gz"
        text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows if keep(r))
        with gzip.GzipFile(path, "wb", mtime=0) as f:  # byte-identical on every run
            f.write(text.encode())
        print(f"{path.name}: {text.count(chr(10))} conversations, {path.stat().st_size:,} bytes, sha256 "
              f"{hashlib.sha256(path.read_bytes()).hexdigest()}")


if __name__ == "__main__":
    main()
