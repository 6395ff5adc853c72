"""The continuous-batching generation engine (dstool/decoding/engine.py) on the exported decoder graph:
greedy equal to transformers' greedy, sequences joining and leaving a running batch, seeds, the cache budget."""

from __future__ import annotations

import numpy as np
import pytest

from dstool.decoding.engine import Engine, FusedEngine, PrefixCache, Sequence, engine_for
from dstool.decoding.sampling import Sampler, SamplingParams
from dstool.serve.export.repository import cache_shapes

PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\n", "KING RICHARD:\nNow is the winter of our discontent",
           "QUEEN:\nAy", "GLOUCESTER:\nWas ever woman in this humour wooed?", "LADY ANNE:\nFoul devil"]


GRAPHS = {"exported": "dstool_lm_decoder/1/model.onnx", "fused": "dstool_lm_llm/1/fused/model.onnx"}


def _setup(repo, trained, graph: str):
    import onnxruntime as ort
    from transformers import AutoTokenizer

    session = ort.InferenceSession(str(repo / GRAPHS[graph]), providers=["CPUExecutionProvider"])
    tokenizer = AutoTokenizer.from_pretrained(trained)
    return session, cache_shapes(repo / "dstool_lm_generate" / "config.pbtxt"), tokenizer


@pytest.fixture(scope="module", params=list(GRAPHS))
def setup(repo, trained, request):
    """The engine's graph: the exported decoder (Engine), or the fused-attention one NAME_llm runs (FusedEngine)."""
    return _setup(repo, trained, request.param)


@pytest.fixture(scope="module")
def exported_setup(repo, trained):
    return _setup(repo, trained, "exported")


def _greedy(trained, prompt_ids: list[int], new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    with torch.no_grad():
        return model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)[
            0, len(prompt_ids):].tolist()


def _sequence(name: str, ids: list[int], new_tokens: int, params: dict | None = None) -> Sequence:
    return Sequence(name, ids, new_tokens, Sampler(SamplingParams.from_parameters(params or {})).next, {0})


def _run(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.busy:
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
    return out


def test_sequences_join_and_leave_a_running_batch_and_stay_exact(setup, trained):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    lengths = [12, 5, 16, 9, 14, 7]  # they finish at different steps and make room for the waiting ones
    engine = engine_for(session, shapes, max_batch=3)
    for i, (x, n) in enumerate(zip(ids, lengths)):
        engine.add(_sequence(str(i), x, n))
    sizes, out = [], {}
    while engine.busy:
        produced = engine.step()
        sizes.append(len(engine.running))
        seen = [len(s.prompt) + len(s.output) - 1 for s in engine.running]
        if isinstance(engine, FusedEngine):  # one buffer, a row each holding its own positions from the first
            assert engine.held.tolist() == seen
        else:  # one shared batch cache: each row masks exactly the tokens its sequence has seen, and no position
            # is kept that no row uses (the longest leaving shrinks it)
            assert engine.mask.sum(1).tolist() == seen
            assert engine.mask.any(0).all() and all(v.shape[2] == engine.mask.shape[1] for v in engine.cache.values())
        for s, token in produced:
            out.setdefault(s.id, []).append(token)
    assert max(sizes) == 3 and len(sizes) < sum(lengths) / 2  # batched, and no waiting for the whole batch
    for i, (x, n) in enumerate(zip(ids, lengths)):
        assert out[str(i)] == _greedy(trained, x, n), i


def test_a_newcomer_gets_its_first_token_in_the_step_it_joins(setup, trained):
    session, shapes, tokenizer = setup
    a, b = (tokenizer(p)["input_ids"] for p in PROMPTS[:2])
    engine = engine_for(session, shapes)
    engine.add(_sequence("a", a, 20))
    for _ in range(4):
        engine.step()
    engine.add(_sequence("b", b, 6))
    assert {s.id for s, _ in engine.step()} == {"a", "b"}
    out = _run(engine)
    assert len(out["a"]) == 15 and out["a"] == _greedy(trained, a, 20)[5:]


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(setup):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = {"temperature": 1.1, "top_p": 0.9, "seed": 11}
    alone = engine_for(session, shapes)
    alone.add(_sequence("x", ids[0], 16, params))
    crowd = engine_for(session, shapes, max_batch=4)
    for i, x in enumerate(ids):
        crowd.add(_sequence(str(i), x, 10 + i, {"temperature": 0.9} if i % 2 else {}))
    crowd.add(_sequence("x", ids[0], 16, params))
    assert _run(alone)["x"] == _run(crowd)["x"]


def test_the_cache_budget_makes_admission_wait(setup):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    budget = max(len(x) for x in ids) + 8 + 20  # room for about two sequences at once
    engine = engine_for(session, shapes, max_batch=8, max_cache_tokens=budget)
    for i, x in enumerate(ids):
        engine.add(_sequence(str(i), x, 8))
    held = []
    out = {}
    while engine.busy:
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
        held.append(sum(s.reserved for s in engine.running))
    assert max(held) <= budget and len(out) == len(ids)
    with pytest.raises(ValueError, match="exceed the engine's"):
        engine.add(_sequence("big", ids[0], budget))


def test_a_cancelled_sequence_leaves_and_the_others_stay_exact(setup, trained):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    engine = engine_for(session, shapes, max_batch=3)
    for i, x in enumerate(ids):
        engine.add(_sequence(str(i), x, 10))
    out: dict[str, list[int]] = {}
    for step in range(10):
        if step == 3:
            engine.cancel("1")
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
    assert len(out["1"]) == 3 and not engine.busy
    for i in (0, 2):
        assert out[str(i)] == _greedy(trained, ids[i], 10), i


def test_prefill_is_bounded_per_step_while_others_decode_and_long_prompts_go_in_chunks(setup, trained):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert max(len(x) for x in ids) > 5
    engine = engine_for(session, shapes, max_batch=8, max_prefill_tokens=5)
    engine.add(_sequence("first", ids[0], 30))
    engine.step()  # nothing was running: the whole prompt at once
    for i, x in enumerate(ids[1:], 1):
        engine.add(_sequence(str(i), x, 8))
    out: dict[str, list[int]] = {}
    while engine.busy:
        before = {s.id: s.prefilled for s in engine.prefilling + list(engine.waiting)}
        running = bool(engine.running)
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
        after = {s.id: s.prefilled for s in engine.prefilling + engine.running + list(engine.waiting)}
        spent = sum(after[k] - v for k, v in before.items())
        assert not running or spent <= 5  # the running sequence waits for 5 prompt tokens' work at most
    for i, x in enumerate(ids[1:], 1):
        assert out[str(i)] == _greedy(trained, x, 8), i  # chunked prompts: the same tokens


def test_a_prefix_cache_reuses_shared_prefixes_of_every_length_and_stays_exact(setup):
    """Prompts sharing a prefix of every length with a system prompt (and repeats of them), greedy: with the prefix
    cache each reuses the kept whole blocks of the longest prefix an earlier prompt computed, and every token is
    the one the engine gives without it; the cache never holds more than its budget, least recently used first
    out."""
    session, shapes, tokenizer = setup
    system = tokenizer("KING RICHARD:\nNow is the winter of our discontent made glorious summer by this sun of "
                       "York;")["input_ids"]
    assert len(system) > 20
    prompts = [system[:k] + [7 + k % 5, 11] for k in range(len(system) + 1)]
    prompts += prompts[-3:] + [system]  # repeats, and a prompt that is a kept prefix itself (its last token computed)

    def run(prefix_cache: PrefixCache | None) -> dict[str, list[int]]:
        engine = engine_for(session, shapes, max_batch=4, prefix_cache=prefix_cache)
        for i, x in enumerate(prompts):
            engine.add(_sequence(str(i), x, 5))
        return _run(engine)

    plain = run(None)
    cache = PrefixCache(block=4, max_tokens=4096)
    engine = engine_for(session, shapes, max_batch=1, prefix_cache=cache)
    reused = 0
    for i, x in enumerate(prompts):  # one at a time: each finds what every earlier one left
        s = _sequence(str(i), x, 5)
        engine.add(s)
        assert _run(engine)[str(i)] == plain[str(i)], i
        earlier = max((len(_common(x, y)) for y in prompts[:i]), default=0)
        assert s.cached == min(earlier, len(x) - 1) // 4 * 4, (i, s.cached, earlier)
        reused += s.cached
    assert cache.hit == reused > 0 and cache.tokens <= 4096

    small = PrefixCache(block=4, max_tokens=8)  # two blocks, in a crowd of four at a time
    assert run(small) == plain and small.tokens == 8


def test_a_scored_prompt_gets_its_own_logits_in_chunks_and_is_computed_whole(setup, trained):
    """A sequence with `score` (prompt logprobs): every prompt position's logits reach it, in order, as transformers
    computes them, whether the prompt is prefilled whole or in chunks beside running sequences, and never from the
    prefix cache (its positions have no logits); its tokens and the others' stay the greedy ones."""
    import torch
    from transformers import AutoModelForCausalLM

    session, shapes, tokenizer = setup
    ids = tokenizer(PROMPTS[2])["input_ids"]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(trained).eval()(torch.tensor([ids])).logits[0].numpy()
    cache = PrefixCache(block=4, max_tokens=4096)
    engine = engine_for(session, shapes, max_batch=4, max_prefill_tokens=5, prefix_cache=cache)
    engine.add(_sequence("warm", ids, 3))  # leaves the prompt's blocks in the prefix cache
    assert _run(engine)["warm"] == _greedy(trained, ids, 3)
    engine.add(_sequence("running", ids[:6], 12))
    engine.step()
    chunks: list[tuple[int, np.ndarray]] = []
    scored = _sequence("scored", ids, 4)
    scored.score = lambda logits, start: chunks.append((start, np.array(logits)))
    engine.add(scored)
    out = _run(engine)
    assert scored.cached == 0 and out["scored"] == _greedy(trained, ids, 4)
    assert [c[0] for c in chunks] == list(range(0, len(ids), 5))  # chunks of 5 (others were running)
    got = np.concatenate([c[1] for c in chunks])
    assert got.shape == expected.shape and np.abs(got - expected).max() < 1e-3

    def failing(logits, start):
        raise ValueError("no")

    bad = _sequence("bad", ids, 4)
    bad.score = failing
    engine.add(bad)
    engine.add(_sequence("good", ids[:5], 4))
    out = _run(engine)
    assert out["bad"] == [None] and "ValueError: no" in bad.error and out["good"] == _greedy(trained, ids[:5], 4)


def test_the_prefix_cache_keeps_the_recently_used_blocks_within_its_budget():
    cache = PrefixCache(block=2, max_tokens=6)

    def kv(ids):
        return {"past_key_values.layers.0.keys": np.asarray(ids, np.float32).reshape(1, 1, -1, 1)}

    cache.add([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # two whole blocks kept; the fifth token is no block
    assert cache.tokens == 4
    assert cache.match([1, 2, 3, 4, 9])[0] == 4 and cache.match([1, 2, 3, 4])[0] == 2  # the last token computed
    tokens, found = cache.match([1, 2, 3, 9])
    assert tokens == 2 and found["past_key_values.layers.0.keys"].ravel().tolist() == [1, 2]
    assert cache.match([9, 2, 3, 4, 5])[0] == 0 and cache.match([3, 4, 1, 2, 7])[0] == 0  # a block after its prefix
    cache.add([7, 8, 9, 10, 11], kv([7, 8, 9, 10, 11]))  # over budget: the least recently used block goes
    assert cache.tokens == 6 and cache.match([1, 2, 3, 4, 0])[0] == 2 and cache.match([7, 8, 9, 10, 0])[0] == 4
    with pytest.raises(ValueError):
        PrefixCache(block=4, max_tokens=2)


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int8", "int4", "tiny-moe"])
def test_the_engine_serves_compressed_and_moe_models(variant, trained, int8_output, int4_output, tmp_path):
    """What `dstool compress` writes and the DeepSeek-V3 preset (MLA + MoE): exported and decoded by the engine token
    for token as transformers does (MoE, in a batch of three) or as the decoder graph decoding the sequence by itself
    (int8: its activation ranges are per call, so batch mates change them; 4-bit: NAME_llm's fused-attention decoder
    by the same recipe, in a batch of three)."""
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstool import models
    from dstool.artifacts import CompressedModel
    from dstool.onnx_export import empty_cache, run_decoder

    from conftest import dstool

    tokenizer = AutoTokenizer.from_pretrained(trained)
    if variant in ("int8", "int4"):
        source = int8_output if variant == "int8" else int4_output
    else:
        source = tmp_path / "moe"
        torch.manual_seed(0)
        specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id}
        AutoModelForCausalLM.from_config(models.preset_config("tiny-moe", len(tokenizer), specials)).save_pretrained(
            source)
        tokenizer.save_pretrained(source)
    dstool("export", str(source), "--repository", str(tmp_path / "repo"), "--name", "lm")
    # a compress output's graphs are served as they are (int8 here quantizes attention scores, which the fused
    # attention op does in fp32: no fused graph); MLA is not GQA-shaped
    fused = tmp_path / "repo" / "lm_llm" / "1" / "fused" / "model.onnx"
    has_fused = variant != "tiny-moe" and "fused" in CompressedModel.read(source).graphs
    assert fused.exists() == has_fused and (has_fused or variant != "int4")
    session = ort.InferenceSession(str(tmp_path / "repo" / "lm_decoder" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    shapes = cache_shapes(tmp_path / "repo" / "lm_generate" / "config.pbtxt")
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]

    def alone(x: list[int], n: int) -> list[int]:
        logits, past = run_decoder(session, np.array([x]), empty_cache(session, 1), 0)
        out = [int(logits[0, -1].argmax())]
        while len(out) < n:
            logits, past = run_decoder(session, np.array([[out[-1]]]), past, len(x) + len(out) - 1)
            out.append(int(logits[0, -1].argmax()))
        return out

    # int8: one at a time (max_batch 1) the engine is the graph alone; in a batch each still gets its 8 tokens
    engine = Engine(session, shapes, max_batch=1 if variant == "int8" else 3) if variant != "int4" else \
        engine_for(ort.InferenceSession(str(fused), providers=["CPUExecutionProvider"]), shapes, max_batch=3)
    for i, x in enumerate(ids):
        engine.add(Sequence(str(i), x, 8, Sampler(SamplingParams()).next, set()))
    out = _run(engine)
    if variant == "int4":
        assert isinstance(engine, FusedEngine) and [out[str(i)] for i in range(3)] == [alone(x, 8) for x in ids]
    elif variant == "int8":
        assert [out[str(i)] for i in range(3)] == [alone(x, 8) for x in ids]
        batched = Engine(session, shapes, max_batch=3)
        for i, x in enumerate(ids):
            batched.add(Sequence(str(i), x, 8, Sampler(SamplingParams()).next, set()))
        assert sorted(len(v) for v in _run(batched).values()) == [8, 8, 8]
    else:
        model = AutoModelForCausalLM.from_pretrained(source).eval()
        for i, x in enumerate(ids):
            with torch.no_grad():
                expected = model.generate(torch.tensor([x]), max_new_tokens=8, do_sample=False, eos_token_id=None)
            assert out[str(i)] == expected[0, len(x):].tolist(), i


def test_a_failing_choice_ends_its_sequence_alone(setup, trained):
    """A choice rule that raises, or picks an id outside the vocabulary, ends that sequence with its error; the
    sequences beside it stay exact and the engine goes on."""
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    engine = engine_for(session, shapes)
    greedy = Sampler(SamplingParams()).next

    def broken(logits, prompt, output):
        if len(output) == 2:
            raise FloatingPointError("sampling went wrong")
        return greedy(logits, prompt, output)

    engine.add(_sequence("a", ids[0], 8))
    engine.add(Sequence("broken", ids[1], 8, broken, {0}))
    engine.add(Sequence("outside", ids[2], 8, lambda logits, p, o: logits.shape[-1], {0}))
    out = _run(engine)
    assert out["a"] == _greedy(trained, ids[0], 8)
    assert out["broken"][-1] is None and len(out["broken"]) == 3 and out["outside"] == [None]
    engine.add(_sequence("after", ids[0], 4))
    assert _run(engine)["after"] == _greedy(trained, ids[0], 4)


class _Failing:
    """The decoder session, failing the next decoding step whose batch has `rows` rows (run as the exported graph
    is, or with IO binding as the fused one is)."""

    def __init__(self, session, rows: int):
        self.session, self.rows = session, rows
        self.get_inputs = session.get_inputs

    def _fail(self, ids) -> None:
        if self.rows and ids.shape == (self.rows, 1):
            self.rows = 0
            raise RuntimeError("the runtime failed")

    def run(self, names, feeds):
        self._fail(feeds["input_ids"])
        return self.session.run(names, feeds)

    def io_binding(self):
        return _Binding(self.session.io_binding())

    def run_with_iobinding(self, binding):
        self._fail(binding.ids)
        self.session.run_with_iobinding(binding.binding)


class _Binding:
    def __init__(self, binding):
        self.binding = binding

    def bind_cpu_input(self, name, value):
        if name == "input_ids":
            self.ids = value
        self.binding.bind_cpu_input(name, value)

    def __getattr__(self, name):
        return getattr(self.binding, name)


def test_a_failed_graph_run_ends_its_batch_and_the_engine_goes_on(setup, trained):
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    engine = engine_for(_Failing(session, 2), shapes)
    engine.add(_sequence("a", ids[0], 6))
    engine.add(_sequence("b", ids[1], 6))
    out = _run(engine)
    assert out["a"][-1] is None and out["b"][-1] is None
    assert engine.running == [] and engine.cache[next(iter(engine.cache))].shape[0] == 0
    engine.add(_sequence("c", ids[2], 6))
    assert _run(engine)["c"] == _greedy(trained, ids[2], 6)


class _LastPositionOnly:
    """A runner whose graph gives the last position's logits only (as an edge package's head may)."""

    def __init__(self, session):
        self.session = session

    def run(self, names, feeds):
        values = self.session.run(names, feeds)
        return [v[:, -1:] if name == "logits" else v for name, v in zip(names, values)]


def test_a_runner_with_last_position_logits_serves_one_prompt_at_a_time(exported_setup, trained):
    session, shapes, tokenizer = exported_setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    alone = Engine(_LastPositionOnly(session), shapes, max_batch=1)
    for i, x in enumerate(ids):
        alone.add(_sequence(str(i), x, 8))
    out = _run(alone)
    assert all(out[str(i)] == _greedy(trained, x, 8) for i, x in enumerate(ids))
    together = Engine(_LastPositionOnly(session), shapes, max_batch=2)  # the shorter prompt is padded: refused
    for i, x in enumerate(ids):
        together.add(_sequence(str(i), x, 8))
    failed = [s for s, token in together.step() if token is None]
    assert [s.id for s in failed] == [str(min(range(2), key=lambda i: len(ids[i])))]
    assert "last position" in failed[0].error


def test_a_tenants_newcomer_begins_at_once_while_another_fills_the_batch_and_paused_ones_stay_exact(setup, trained):
    """Tenant A fills the batch with long sequences; B's request begins within two steps (A's latest is paused for
    it), and every sequence's tokens — A's paused and resumed ones included — are those of an engine that ran each
    alone (greedy)."""
    session, shapes, tokenizer = setup
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    alone = {}
    for i, x in enumerate(ids):
        single = engine_for(session, shapes, max_batch=1)
        single.add(_sequence(str(i), x, 24))
        alone[str(i)] = _run(single)[str(i)]
    engine = engine_for(session, shapes, max_batch=3)
    for i in range(4):
        s = _sequence(str(i), ids[i], 24)
        s.tenant = "A"
        engine.add(s)
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
    assert [s.tenant for s in engine.running] == ["A"] * 3
    newcomer = _sequence("4", ids[4], 24)
    newcomer.tenant = "B"
    engine.add(newcomer)
    arrived = engine.steps_started
    while "4" not in out:
        for s, token in engine.step():
            out.setdefault(s.id, []).append(token)
    assert engine.steps_started - arrived <= 2, "B waited for A's sequences to end"
    second = _sequence("5", ids[5], 24)
    second.tenant = "B"
    engine.add(second)
    out_rest = _run(engine)
    for k, v in out_rest.items():
        out.setdefault(k, []).extend(v)
    assert out == alone
