"""The data users bring (shards of parquet/jsonl/csv/arrow, weighted mixtures, chats, prompt-completion pairs) and
LoRA fine-tuning, on real DeepSpeed processes."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dstool.artifacts import Checkpoint, HFModel
from dstool.errors import UsageError
from dstool.train import TrainConfig, chat, data, sources

from conftest import TRAIN_CODE, built_once, cli, dstool, losses, one_line_usage_error


def _chats(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    names = ["ROMEO", "JULIET", "HAMLET", "OPHELIA"]
    rows = []
    for i in range(n):
        who, k = names[int(rng.integers(4))], int(rng.integers(1, 50))
        msgs = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": f"Who speaks line {k}?"},
                {"role": "assistant", "content": f"{who} speaks line {k}."}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "Louder."}, {"role": "assistant", "content": f"{who}!"}]
        rows.append({"messages": msgs})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokenizer():
    tok = data.train_tokenizer([f"ROMEO speaks line {i}. Who speaks? Louder." for i in range(200)], 300)
    tok.pad_token = data.PAD
    return tok


# ---- sources ------------------------------------------------------------------------------------------------

def test_every_shard_format_reads_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    texts = [f"row {i} of the corpus" for i in range(1200)]
    table = pa.table({"text": texts, "id": list(range(1200))})
    pq.write_table(table.slice(0, 400), tmp_path / "a.parquet", row_group_size=100)
    pa_csv.write_csv(table.slice(400, 400), tmp_path / "b.csv")
    _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[800:1000]])
    ds = tmp_path / "saved"  # a `datasets` save_to_disk folder: arrow IPC stream files, state.json, dataset_info.json
    ds.mkdir()
    with pa.ipc.new_stream(ds / "data-00000-of-00001.arrow", table.schema) as w:
        w.write_table(table.slice(1000, 200), max_chunksize=64)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    srcs = sources.parse(f"{tmp_path / 'a.parquet'},{tmp_path / 'b.csv'},{tmp_path / 'c.jsonl'},{ds}")
    read = [r["text"] for s in srcs for shard in s.shards for batch in sources.rows(shard, "text") for r in batch]
    assert read == texts
    folder = sources.parse(str(tmp_path))[0]  # a folder: every shard under it, sorted
    assert [Path(f).name for f in folder.shards] == ["a.parquet", "b.csv", "c.jsonl", "data-00000-of-00001.arrow"]
    assert len(sources.parse(str(tmp_path / "*.parquet"))[0].shards) == 1


@pytest.mark.parametrize("spec,needle", [
    ("{d}/a.jsonl:0.7,{d}/b.jsonl", "every source a weight"),
    ("{d}/a.jsonl:0,{d}/b.jsonl:0", "sum to zero"),
    ("{d}/a.jsonl:-1", "zero or more"),
    ("{d}/nothing/*.parquet", "matches no file"),
    ("{d}/a.jsonl,,{d}/b.jsonl", "empty entry"),
])
def test_bad_mixtures(tmp_path, spec, needle):
    for name in ("a", "b"):
        _write_jsonl(tmp_path / f"{name}.jsonl", [{"text": "x"}])
    with pytest.raises(UsageError, match=needle):
        sources.parse(spec.format(d=tmp_path))


def test_bad_shards_are_one_line_errors(tmp_path):
    (tmp_path / "fake.parquet").write_text("this is not parquet")
    with pytest.raises(UsageError, match=r"fake.parquet is not a readable parquet file"):
        list(sources.rows(str(tmp_path / "fake.parquet"), "text"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "other.parquet")
    with pytest.raises(UsageError, match=r"other.parquet has no 'text' column \(it has: content\)"):
        list(sources.rows(str(tmp_path / "other.parquet"), "text"))
    _write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(UsageError, match=r"mixed.jsonl:2 has no 'text' field"):
        list(sources.rows(str(tmp_path / "mixed.jsonl"), "text"))


# ---- chat, prompt-completion, packing -----------------------------------------------------------------------

def test_chat_learns_the_assistant_turns_only():
    tok = _tokenizer()
    chat.set_template(tok, "default", needed=True)
    row = _chats(1)[0]
    ids, learn = chat.encode(row, "chat", tok, "row 1")
    learned = tok.decode([i for i, m in zip(ids, learn) if m])
    assert learned.startswith(row["messages"][2]["content"]) and "Louder" not in learned
    assert learned.count(tok.eos_token) == 2  # each assistant turn ends with EOS: the model learns to stop
    assert tok.decode(ids).startswith("SYSTEM:\nAnswer in one line.\n\nUSER:\n")
    with pytest.raises(UsageError, match="no assistant turn"):
        chat.encode({"messages": [{"role": "user", "content": "hi"}]}, "chat", tok, "x.jsonl row 3")
    ids, learn = chat.encode({"prompt": "Q: who?", "completion": " ROMEO"}, "prompt-completion", tok, "r")
    assert tok.decode([i for i, m in zip(ids, learn) if m]) == " ROMEO" + tok.eos_token


def test_chat_needs_a_template(tmp_path):
    tok = _tokenizer()
    with pytest.raises(UsageError, match="--chat-template default"):
        chat.set_template(tok, None, needed=True)
    with pytest.raises(UsageError, match="no such file"):
        chat.set_template(tok, str(tmp_path / "missing.jinja"), needed=True)


def test_packed_examples_restart_positions_and_pad(tmp_path):
    tok = _tokenizer()
    chat.set_template(tok, "default", needed=True)
    tok.save_pretrained(tmp_path / "tokenizer")
    rows = _chats(40)
    shard = _write_jsonl(tmp_path / "chats.jsonl", rows)
    meta = data._tokenize(data._Job(str(shard), "h", "chat", 256, str(tmp_path / "tokenizer"),
                                    str(tmp_path / "out")))
    split = data.Split([(tmp_path / "out", 0, meta["sequences"], meta["dtype"])], examples=True)
    assert meta["rows"] == 40 and meta["dropped"] == 0 and len(split) == meta["sequences"] < 40
    learned = 0
    for i in range(len(split)):
        s = split[i]
        starts = int((s["position_ids"] == 0).sum())
        assert starts >= 1 and s["labels"][0] == -100  # an example starts every segment; its first token not learned
        learned += int((s["labels"] != -100).sum())
    want = sum(sum(chat.encode(r, "chat", tok, "")[1]) for r in rows)
    assert learned == want  # every assistant token of every row, exactly once


def test_document_masking_keeps_packed_examples_apart():
    """Two examples packed in one sequence with restarted positions give the second the logits it has alone."""
    from transformers import AutoModelForCausalLM

    from dstool import models

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(models.preset_config("tiny", 300, {})).eval()
    model.config.use_cache = False  # as in training: the packed-sequence mask applies without a KV cache
    a, b = torch.randint(0, 300, (1, 10)), torch.randint(0, 300, (1, 7))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(10), torch.arange(7)]).unsqueeze(0)
    with torch.no_grad():
        alone = model(input_ids=b).logits
        together = model(input_ids=packed, position_ids=pos).logits[:, 10:]
        crossing = model(input_ids=packed).logits[:, 10:]
    assert torch.allclose(alone, together, atol=1e-5)
    assert not torch.allclose(alone, crossing, atol=1e-3)


def test_mixture_keeps_the_weights_and_is_a_function_of_the_position():
    order = data.Mixture([50, 2000, 0], [0.7, 0.3, 0.0], seed=3)
    drawn = [order.sample_at(p) for p in range(5000)]
    small = sum(d < 50 for d in drawn)
    assert small == 3500 and all(d < 2050 for d in drawn)  # 70 % from the first source (repeated), none from the third
    again = data.Mixture([50, 2000, 0], [0.7, 0.3, 0.0], seed=3)
    assert [again.sample_at(p) for p in range(4321, 4400)] == drawn[4321:4400]  # resume: position alone decides
    large = [d for d in drawn if d >= 50]
    assert len(large) == len(set(large)) == 1500  # the large source repeats nothing within its epoch


# ---- real DeepSpeed: a chat LoRA fine-tune on ZeRO-3, 2 ranks ------------------------------------------------

LORA = ["--data-format", "chat", "--chat-template", "default", "--lora", "8", "--nproc", "2", "--zero", "3",
        "--max-steps", "6", "--save-every", "3", "--micro-batch-size", "4", "--lr", "3e-3", "--trace-samples",
        "--log-every", "1", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def lora_runs(trained, tmp_path_factory, worker_id):
    """A chat LoRA fine-tune of the session's model on two weighted jsonl sources, uninterrupted; the same resumed
    in another folder from the first one's step-3 checkpoint (a run killed, then resumed: test_train_deepspeed.py's
    bf16 runs). (The runs, their stdouts, their arguments.)"""
    def args(out: Path) -> list[str]:
        spec = f"{out / 'data' / 'a.jsonl'}:0.8,{out / 'data' / 'b.jsonl'}:0.2"
        return ["--model", str(trained), "--data", spec, *LORA]

    def build(out: Path) -> None:
        (out / "data").mkdir(parents=True)
        _write_jsonl(out / "data" / "a.jsonl", _chats(240))
        _write_jsonl(out / "data" / "b.jsonl", _chats(60, seed=1))
        (out / "first.stdout").write_text(dstool("train", "--output", str(out / "ref"), *args(out), timeout=900).stdout)
        (out / "resumed.stdout").write_text(dstool(
            "train", "--output", str(out / "resumed"), *args(out), "--resume",
            str(out / "ref" / "checkpoints" / "step-00000003"), timeout=900).stdout)
    made = built_once(tmp_path_factory, worker_id, "lora_runs", build, TRAIN_CODE,
                      (trained, *LORA, inspect.getsource(_chats), inspect.getsource(args)))
    return made / "ref", made / "resumed", (made / "first.stdout").read_text(), \
        (made / "resumed.stdout").read_text(), args(made)


def test_lora_checkpoints_hold_the_adapter_only(lora_runs, trained):
    ref, _, first, _, _ = lora_runs
    tag = ref / "checkpoints" / "step-00000006"
    manifest = Checkpoint.read(tag, verify=True)
    assert {k: v for k, v in manifest.lora.items() if k != "base"} == {"rank": 8, "alpha": 16.0, "dropout": 0.0,
                                                                       "targets": ["all-linear"]}
    model_bytes = (trained / "model.safetensors").stat().st_size
    assert sum(f.stat().st_size for f in tag.rglob("*") if f.is_file()) < model_bytes / 4
    assert "LoRA rank 8" in first and "chat from" in first


def test_lora_resume_continues_exactly(lora_runs):
    ref, again, _, resumed, _ = lora_runs
    assert "resumed at step 3" in resumed
    a, b = losses(ref), losses(again)
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], abs=1e-5), (a, b)
    assert a[6] < a[1]


def test_lora_model_is_merged_and_the_adapter_beside_it(lora_runs, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = lora_runs[0]
    merged = AutoModelForCausalLM.from_pretrained(ref / "model").eval()
    base = AutoModelForCausalLM.from_pretrained(trained).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, ref / "adapter").eval()  # adds the adapter to `base`
        assert torch.allclose(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(merged(input_ids=ids).logits, before, atol=1e-3)
    assert HFModel.read(ref / "model", verify=True).parity.max_abs_logit_diff < 1e-4
    tok = AutoTokenizer.from_pretrained(ref / "model")
    assert tok.chat_template == chat.DEFAULT_TEMPLATE  # what `dstool serve` renders chats with


def test_export_carries_the_chat_template_serve_renders_with(lora_runs, tmp_path):
    ref = lora_runs[0]
    dstool("export", str(ref / "model"), "--repository", str(tmp_path / "repo"), timeout=900)
    served = tmp_path / "repo" / "dstool_lm_llm" / "1" / "chat_template.jinja"
    assert served.read_text() == (ref / "model" / "chat_template.jinja").read_text() == chat.DEFAULT_TEMPLATE


def test_mixture_draws_by_weight(lora_runs):
    ref = lora_runs[0]
    meta = json.loads((ref / "data" / "meta.json").read_text())
    first_source = sum(s["sequences"] - s["val_sequences"] for s in meta["sources"][0]["shards"])
    drawn = [i for rank in (0, 1) for line in (ref / f"samples.rank{rank}.jsonl").read_text().splitlines()
             for i in json.loads(line)["samples"]]
    assert len(drawn) == 6 * 8 and sum(i < first_source for i in drawn) >= 30  # 0.8 of 48, by 1000-blocks


def test_changed_lora_options_and_precision_are_refused(lora_runs, tmp_path):
    _, _, _, _, args = lora_runs
    ref = shutil.copytree(lora_runs[0], tmp_path / "ref")  # (a refusal is logged in the run's train.log)
    swap = list(args)
    swap[swap.index("--lora") + 1] = "4"
    one_line_usage_error(cli("train", "--output", str(ref), *swap, "--max-steps", "9"), "trained LoRA adapters")
    one_line_usage_error(cli("train", "--output", str(ref), *args, "--max-steps", "9", "--precision", "bf16"),
                         "--precision fp32")


def test_chat_data_errors_exit_2(trained, tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*_chats(3), {"messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "o"
    one_line_usage_error(cli("train", "--output", str(out), "--model", str(trained), "--data", str(bad),
                             "--data-format", "chat", "--max-steps", "1"), "needs a chat template")
    one_line_usage_error(cli("train", "--output", str(tmp_path / "o2"), "--model", str(trained), "--data", str(bad),
                             "--data-format", "chat", "--chat-template", "default", "--max-steps", "1"),
                         "row 4: the chat has no assistant turn")
    good = _write_jsonl(tmp_path / "good.jsonl", _chats(30))
    one_line_usage_error(cli("train", "--output", str(tmp_path / "o3"), "--model", str(trained), "--data", str(good),
                             "--data-format", "chat", "--chat-template", "default", "--lora", "4", "--lora-target",
                             "nope", "--max-steps", "1"), "Target modules")


def test_config_refuses_what_lora_and_chat_cannot_do():
    with pytest.raises(ValueError, match="need --lora"):
        TrainConfig(lora_alpha=8)
    with pytest.raises(ValueError, match="data parallelism"):
        TrainConfig(lora=4, tensor_parallel=2)
    with pytest.raises(ValueError, match="pipeline_stages 1"):
        TrainConfig(data_format="chat", pipeline_stages=2, zero=1)



# ---- every exported family trains and fine-tunes ------------------------------------------------------------

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}
FAMILIES = {
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}}, None),
    "qwen2": ("Qwen2Config", {}, "4"),
    "deepseek-v2": ("DeepseekV2Config", {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32,
                                         "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                         "v_head_dim": 16, "num_key_value_heads": 4, "n_group": 1,
                                         "topk_group": 1}, "4"),
    "deepseek-v3": ("DeepseekV3Config", {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32,
                                         "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                         "v_head_dim": 16, "num_key_value_heads": 4, "n_group": 1, "topk_group": 1,
                                         "rope_scaling": None}, "4"),
}


FAMILY_RUN = ("--nproc", "2", "--zero", "2", "--max-steps", "3", "--save-every", "3", "--seq-len", "32",
              "--micro-batch-size", "2", "--log-every", "1", "--eval-batches", "1", "--no-tensorboard")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_and_fine_tunes(family, trained, tmp_path_factory, worker_id):
    """A random-weight small model of each family: full training (Llama-3 rope scaling) or a LoRA fine-tune, 2 ranks
    on ZeRO-2, to a model folder transformers reloads with the engine's logits (the run kept between runs, keyed by
    the training code and the family's config)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, extra, rank = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(trained)
    config = getattr(transformers, name)(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, **{**SMALL, **extra})

    def build(made: Path) -> None:
        torch.manual_seed(0)
        folder = made / family
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tok.save_pretrained(folder)
        dstool("train", "--output", str(made / "run"), "--model", str(folder), *FAMILY_RUN,
               *(["--lora", rank] if rank else []), timeout=900)

    out = built_once(tmp_path_factory, worker_id, f"family_{family}", build, TRAIN_CODE,
                     (family, name, extra, rank, SMALL, FAMILY_RUN)) / "run"
    model = HFModel.read(out / "model", verify=True)
    assert model.parity.max_abs_logit_diff < 1e-4 and sorted(losses(out)) == [1, 2, 3]
    assert AutoModelForCausalLM.from_pretrained(out / "model").config.model_type == config.model_type
    assert (out / "adapter" / "adapter_model.safetensors").is_file() == bool(rank)


def test_out_of_memory_is_named_with_its_fixes(tmp_path):
    from dstool.train import api, worker

    line = worker.failure_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), "3")
    assert line.startswith("rank 3 ran out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert "--micro-batch-size" in line and "--activation-checkpointing" in line and "\n" not in line
    log = tmp_path / "launcher.log"
    log.write_text("[ERROR] failed (exitcode: -9) local_rank: 1 (pid: 77) of binary\n  exitcode  : -9 (pid: 77)\n"
                   "  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 77\n")
    assert api._killed(log)
    log.write_text("  exitcode  : 1 (pid: 77)\n")
    assert not api._killed(log)


def test_auto_micro_batch_keeps_the_global_batch():
    from dstool.train import autobatch

    cfg, sizes = autobatch.resolve(TrainConfig(micro_batch_size="auto", global_batch_size=24, nproc=2), True, 2)
    assert sizes == [12, 6, 4, 3, 2, 1] and cfg.global_batch_size == 24  # a GPU searches, largest first
    cpu, none = autobatch.resolve(TrainConfig(micro_batch_size="auto", global_batch_size=24), False, 2)
    assert none is None and cpu.micro_batch_size == 6  # CPU: no search, the largest divisor up to 8
    tried: list[int] = []
    assert autobatch.search(sizes, lambda m: tried.append(m) or m <= 4) == 4 and tried == [12, 6, 4]
    with pytest.raises(UsageError, match="even a micro batch of 1"):
        autobatch.search([2, 1], lambda m: False)
    ds = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 12}
    assert autobatch.with_micro(ds, 4)["gradient_accumulation_steps"] == 3
    assert autobatch.with_micro(ds, 4, accumulation=1)["train_batch_size"] == 8
    assert TrainConfig(micro_batch_size="4").micro_batch_size == 4
    with pytest.raises(ValueError):
        TrainConfig(micro_batch_size="lots")


def test_review_findings_on_sources_and_chat(tmp_path):
    """Defects a review found: each a one-line error or the right tokens now."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    with pytest.raises(UsageError, match="finite"):
        sources.parse(f"{_write_jsonl(tmp_path / 'a.jsonl', [{'text': 'x'}])}:1e999")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(UsageError, match="not a readable jsonl"):
        list(sources.rows(str(tmp_path / "broken.jsonl.gz"), "text"))
    saved = tmp_path / "ds"
    saved.mkdir()
    (saved / "state.json").write_text("[]")
    (saved / "dataset_info.json").write_text("{}")
    with pytest.raises(UsageError, match="state.json"):
        sources.parse(str(saved))
    # a CSV column that looks numeric at first is still text
    pa_csv.write_csv(pa.table({"prompt": ["1", "2", "three"], "completion": ["a", "b", "c"]}), tmp_path / "p.csv")
    rows = [r for b in sources.rows(str(tmp_path / "p.csv"), "prompt-completion") for r in b]
    assert [r["prompt"] for r in rows] == ["1", "2", "three"]
    tok = _tokenizer()
    chat.set_template(tok, "default", needed=True)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ids, learn = chat.encode({"messages": [{"role": "user", "content": "hi"}, call], "tools": tools}, "chat", tok, "r")
    text = tok.decode(ids)
    assert text.startswith("SYSTEM:\nYou may call these tools") and '"name": "f"' in tok.decode(
        [i for i, m in zip(ids, learn) if m])
    ids, learn = chat.encode({"messages": json.dumps([{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yo"}])}, "chat", tok, "r")
    assert sum(learn) > 0  # messages as JSON text (a CSV cell)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(UsageError, match="roles must alternate"):
        chat.encode(_chats(1)[0], "chat", tok, "x.jsonl row 1")
    with pytest.raises(ValueError):
        TrainConfig(distill_from="teacher", data_format="chat")
    with pytest.raises(ValueError):
        TrainConfig(seed=-1)


def test_small_shards_hold_out_a_fraction_and_say_what_they_cannot_use(tmp_path):
    described = [{"spec": "s", "weight": None, "shards": [{"sequences": 2}, {"sequences": 3}, {"sequences": 40}]}]
    data._hold_out(described, 0.05)
    assert [s["val_sequences"] for s in described[0]["shards"]] == [0, 0, 2]
    described = [{"spec": "s", "weight": None, "shards": [{"sequences": 2}, {"sequences": 3}]}]
    data._hold_out(described, 0.05)
    assert [s["val_sequences"] for s in described[0]["shards"]] == [0, 1]  # none by the fraction: one, of the largest
