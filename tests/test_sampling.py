"""The generation model's sampling (dstool/decoding/sampling.py) against transformers' own logits processors,
and its seeds, validation and distribution."""

from __future__ import annotations

import numpy as np
import pytest

from dstool.decoding import sampling


def _hf(logits: np.ndarray, ids: list[int], processors) -> np.ndarray:
    import torch

    scores = torch.tensor(logits[None], dtype=torch.float32)
    input_ids = torch.tensor([ids or [0]], dtype=torch.long)
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores[0].double().numpy()


def _probs(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores[np.isfinite(scores)].max())
    return e / e.sum()


@pytest.mark.parametrize("params", [
    {"temperature": 0.7}, {"temperature": 1.3, "top_k": 5}, {"top_p": 0.8}, {"temperature": 0.5, "top_p": 0.3},
    {"min_p": 0.1}, {"temperature": 2.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05}, {"top_k": 1}])
def test_warping_matches_transformers(params):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    p = sampling.SamplingParams.from_parameters(params)
    hf = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        hf.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        hf.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        hf.append(MinPLogitsWarper(p.min_p))
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = (rng.standard_normal(64) * 3).astype(np.float32)
        ours, theirs = sampling.Sampler(p).warped(logits), _hf(logits, [], hf)
        assert np.array_equal(np.isfinite(ours), np.isfinite(theirs)), params
        assert np.allclose(_probs(ours), _probs(theirs), atol=1e-6), params


def test_penalties_match_transformers_and_openai():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(32) * 3).astype(np.float32)
    prompt, output = [3, 5, 5, 9], [5, 7, 7, 7, 11]
    s = sampling.Sampler(sampling.SamplingParams.from_parameters({"repetition_penalty": 1.3}))
    assert np.allclose(s.penalized(logits, prompt, output),
                       _hf(logits, prompt + output, [RepetitionPenaltyLogitsProcessor(1.3)]), atol=1e-6)
    s = sampling.Sampler(sampling.SamplingParams.from_parameters({"presence_penalty": 0.5,
                                                                  "frequency_penalty": 0.25}))
    expected = logits.copy()
    for token, count in ((5, 1), (7, 3), (11, 1)):  # OpenAI: over the output only, count * frequency + presence
        expected[token] -= 0.5 + 0.25 * count
    assert np.allclose(s.penalized(logits, prompt, output), expected)


def test_greedy_by_default_and_seeds_repeat():
    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    greedy = sampling.Sampler(sampling.SamplingParams.from_parameters({}))
    assert greedy.params.greedy and greedy.next(logits, [], []) == 1
    assert sampling.SamplingParams.from_parameters({"temperature": 0, "top_k": 3, "seed": 1}).greedy
    assert not sampling.SamplingParams.from_parameters({"seed": 1}).greedy  # a seed alone samples at temperature 1

    def draws(seed, n=40):
        s = sampling.Sampler(sampling.SamplingParams.from_parameters({"temperature": 1.0, "seed": seed}))
        return [s.next(logits, [], []) for _ in range(n)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    top1 = sampling.Sampler(sampling.SamplingParams.from_parameters({"top_k": 1, "seed": 3}))
    assert {top1.next(logits, [], []) for _ in range(50)} == {1}


def test_sampled_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = sampling.Sampler(sampling.SamplingParams.from_parameters({"temperature": 1.0, "seed": 0}))
    counts = np.bincount([s.next(logits, [], []) for _ in range(20000)], minlength=4) / 20000
    assert np.allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.015), counts
    s = sampling.Sampler(sampling.SamplingParams.from_parameters({"top_p": 0.75, "seed": 0}))
    counts = np.bincount([s.next(logits, [], []) for _ in range(5000)], minlength=4) / 5000
    assert counts[2] == counts[3] == 0 and abs(counts[0] - 0.625) < 0.03, counts  # 0.5 / (0.5 + 0.3)


@pytest.mark.parametrize("params, needle", [
    ({"temperature": -1}, "temperature must be a number >= 0"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p must be a number > 0 and <= 1"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 1.5}, "top_k must be an integer"), ({"top_k": -1}, "top_k"), ({"seed": True}, "seed"),
    ({"seed": -3}, "seed"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty must be a number >= -2 and <= 2"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty")])
def test_bad_parameters_are_named(params, needle):
    with pytest.raises(sampling.SamplingError, match=needle):
        sampling.SamplingParams.from_parameters(params)


def test_stops_are_eos_and_stop_ids_unless_eos_is_ignored():
    from dstool.decoding.sampling import SamplingError, request_choices

    assert request_choices("{}", 3, None, 8, 64, np.array([7, 9]), {2})[2] == {2, 7, 9}
    assert request_choices('{"ignore_eos": true}', 3, np.array([5]), 8, 64, None, {2})[::2] == (5, set())
    with pytest.raises(SamplingError, match="ignore_eos must be true or false"):
        request_choices('{"ignore_eos": 1}', 3, None, 8, 64, None, {2})


@pytest.mark.parametrize("params", [
    {"temperature": 5e-324}, {"temperature": 1e-4, "seed": 1}, {"temperature": 100, "seed": 1},
    {"temperature": 1, "repetition_penalty": 1e-300, "seed": 1},
    {"temperature": 1, "repetition_penalty": 100, "seed": 2},
    {"temperature": 2, "presence_penalty": 2, "frequency_penalty": 2, "seed": 3}, {"top_p": 5e-324, "seed": 4},
    {"min_p": 1.0, "seed": 5}, {"temperature": 1e-5, "top_k": 1, "seed": 6}])
def test_every_accepted_value_chooses_a_token_of_the_vocabulary(params):
    """Extreme but accepted values (and logits at float32's limits, NaN among them) never make the arithmetic
    overflow into a choice outside the vocabulary."""
    s = sampling.Sampler(sampling.SamplingParams.from_parameters(params))
    rng = np.random.default_rng(0)
    for logits in ((rng.standard_normal(64) * 3).astype(np.float32),
                   np.array([3.4e38, -3.4e38, 1e30, 0.0, np.nan, np.inf, -np.inf] * 9, np.float32)):
        output: list[int] = []
        for _ in range(6):
            output.append(s.next(logits, [1, 2, 3], output))
            assert 0 <= output[-1] < logits.size and not np.isnan(logits[output[-1]]), (params, output)


def test_logits_without_a_finite_value_are_a_sampling_error():
    with pytest.raises(sampling.SamplingError, match="no finite value"):
        sampling.Sampler(sampling.SamplingParams()).next(np.full(8, np.nan, np.float32), [], [])
