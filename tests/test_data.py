from __future__ import annotations

import json

import numpy as np

from dstool.corpus import read_documents
from dstool.train import data, sources


def test_embedded_corpus_is_shakespeare():
    docs = read_documents(None)
    text = "\n\n".join(docs)
    assert 900_000 < len(text) < 1_200_000 and "First Citizen" in text


def test_folder_of_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}))
    src = sources.parse(str(tmp_path))[0]
    rows = [r for shard in src.shards for batch in sources.rows(shard, "text") for r in batch]
    assert [r["text"] for r in rows if r["text"]] == ["alpha beta", "gamma", "delta"]


def test_tokenizer_packing_and_split(tmp_path):
    docs = read_documents(None)[:400]
    tok = data.train_tokenizer(docs, vocab_size=512)
    assert len(tok) <= 512 and tok.eos_token_id is not None
    tok.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = data._tokenize(data._Job(str(tmp_path / "c.jsonl"), "h", "text", 32, str(tmp_path / "tokenizer"),
                                    str(tmp_path / "d")))
    split = data.Split([(tmp_path / "d", 0, meta["sequences"], meta["dtype"])], examples=False)
    assert len(split) == meta["sequences"] == meta["tokens"] // 32 and split[0]["input_ids"].shape == (32,)
    assert meta["rows"] == 400 and meta["tail_tokens"] < 32
    all_ids = np.fromfile(tmp_path / "d" / "tokens.bin", dtype=meta["dtype"])
    assert (all_ids == tok.eos_token_id).sum() >= 300  # documents separated by EOS
    assert tok.decode(all_ids[:20].tolist()).strip() in "\n\n".join(docs)


def _consume(order, steps, world, micro, accum, start=0):
    return [[order.micro_batch(s, m, r, world, micro, accum) for m in range(accum) for r in range(world)]
            for s in range(start, steps)]


def test_global_order_no_repeats_and_world_size_independent():
    n = 100
    order = data.GlobalOrder(n, seed=7)
    two = _consume(order, steps=6, world=2, micro=4, accum=2)  # 16 samples/step, 96 in 6 steps
    flat = [i for step in two for mb in step for i in mb]
    assert len(flat) == 96 and len(set(flat)) == 96  # within an epoch nothing repeats
    one = _consume(data.GlobalOrder(n, seed=7), steps=6, world=1, micro=4, accum=4)
    for a, b in zip(two, one):  # the same global batch whatever the world size
        assert sorted(i for mb in a for i in mb) == sorted(i for mb in b for i in mb)
    resumed = _consume(data.GlobalOrder(n, seed=7), steps=6, world=2, micro=4, accum=2, start=3)
    assert resumed == two[3:]  # the position is one number: samples consumed
    epoch0 = [order.sample_at(p) for p in range(n)]
    epoch1 = [order.sample_at(p) for p in range(n, 2 * n)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0  # each epoch a fresh permutation
