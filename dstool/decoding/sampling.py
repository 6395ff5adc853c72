"""Choosing the next token from a row of logits, with the parameters users know from vLLM and OpenAI (numpy only:
it runs inside Triton's python backend, next to the generation model).

Greedy (argmax) unless sampling is asked for: `temperature` > 0, or `top_k` / `top_p` / `min_p` / `seed` given
(temperature 1 then); a `temperature` under 1e-5 is greedy whatever else is set (vLLM's rule: dividing by less
overflows). Applied in the order of transformers' `generate`: repetition penalty (over prompt and output, as
transformers does), presence and frequency penalties (over the output, as OpenAI and vLLM do), then temperature,
top-k, top-p, min-p. The arithmetic is float64 and clipped to finite values, so every accepted value chooses a token
of the vocabulary. `seed` makes a request's choices its own: the same seed gives the same tokens, whatever other
requests share its batch.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .errors import ContextTooLong, SamplingError

MAX_LOGPROBS = 20  # alternatives reported per token, at most (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS)
FINITE = 1e300  # scores are clipped to +-FINITE after each operation, so none overflows to inf or NaN
SEEDS = 2**63  # seeds are 0 .. SEEDS - 1


def _quiet(method):
    """The method with numpy's overflow warnings off: what overflows is clipped by _finite right after."""
    @functools.wraps(method)
    def quiet(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore"):
            return method(*args, **kwargs)
    return quiet


def shown(value) -> str:
    """A client's value as an error message quotes it: short, whatever its size or depth."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"a {type(value).__name__} nested too deep"
    return text if len(text) <= 60 else text[:57] + "..."


def _number(params: dict, name: str, default: float, low: float, high: float = math.inf,
            low_open: bool = False) -> float:
    value = _optional(params, name, low, high, low_open)
    return default if value is None else value


def _optional(params: dict, name: str, low: float, high: float = math.inf, low_open: bool = False) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < low or value > high or (low_open and value == low):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        if high != math.inf:
            bound += f" and <= {high:g}"
        raise SamplingError(f"{name} must be a number {bound}, got {shown(value)}")
    return float(value)


def _integer(params: dict, name: str, low: int, high: int) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SamplingError(f"{name} must be an integer from {low} to {high}, got {shown(value)}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "seed")

    @classmethod
    def from_parameters(cls, params: dict) -> SamplingParams:
        """From a request's parameters (other keys are ignored); SamplingError naming a bad value."""
        temperature = _optional(params, "temperature", 0.0, 100.0)
        top_k = _integer(params, "top_k", 0, 2**31 - 1)
        top_p = _optional(params, "top_p", 0.0, 1.0, low_open=True)
        min_p = _optional(params, "min_p", 0.0, 1.0)
        seed = _integer(params, "seed", 0, SEEDS - 1)
        sampled = temperature is None and any(v is not None for v in (top_k, top_p, min_p, seed))
        if temperature is not None and temperature < GREEDY_BELOW:
            temperature = 0.0
        return cls(temperature=1.0 if sampled else temperature or 0.0, top_k=top_k or 0,
                   top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0,
                   repetition_penalty=_number(params, "repetition_penalty", 1.0, 0.0, 100.0, low_open=True),
                   presence_penalty=_number(params, "presence_penalty", 0.0, -2.0, 2.0),
                   frequency_penalty=_number(params, "frequency_penalty", 0.0, -2.0, 2.0), seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One request's choices: `next(logits, prompt, output)` -> token id; with `logprobs` (K), `ranked(logits,
    token)` -> the token's log-probability, and the K most likely tokens' ids and log-probabilities. With a
    `constraint` (grammar.Constraint: structured outputs), only the tokens its grammar allows are chosen from, after
    the penalties and before temperature and the rest."""

    def __init__(self, params: SamplingParams, logprobs: int | None = None, constraint=None,
                 bias: dict[int, float] | None = None, min_tokens: int = 0, stops: Iterable[int] = ()):
        self.params = params
        self.logprobs = logprobs
        self.constraint = constraint
        # OpenAI's logit_bias (added to the logits first), and vLLM's min_tokens (no stop token before that many)
        self.bias = (np.fromiter(bias, np.int64), np.fromiter(bias.values(), np.float64)) if bias else None
        self.min_tokens, self.held = min_tokens, np.fromiter(stops, np.int64) if min_tokens else None
        self.rng = np.random.default_rng(params.seed) if not params.greedy else None
        self.unpenalized_greedy = self.rng is None and params.repetition_penalty == 1.0 and not (
            params.presence_penalty or params.frequency_penalty)

    def ranked(self, logits: np.ndarray, token: int) -> tuple[float, np.ndarray, np.ndarray]:
        """Log-probabilities under the model's own distribution (the raw logits, before penalties and temperature:
        vLLM's default), the K most likely first."""
        scores = _finite(np.array(logits, np.float64))
        logp = scores - scores.max()
        logp -= np.log(np.exp(logp).sum())
        np.maximum(logp, -1e30, out=logp)  # finite in float32 and in JSON
        k = min(self.logprobs or 0, logp.size)
        top = np.argpartition(-logp, k - 1)[:k] if k else np.zeros(0, np.int64)
        top = top[np.argsort(-logp[top], kind="stable")]
        return float(logp[token]), top, logp[top].astype(np.float32)

    @_quiet
    def penalized(self, logits: np.ndarray, prompt: list[int], output: list[int]) -> np.ndarray:
        """The logits (float64, finite: NaN counts as ruled out) after the repetition, presence and frequency
        penalties. SamplingError when no token is left (the model's logits are all NaN or infinite)."""
        p = self.params
        logits = _finite(np.array(logits, np.float64))
        if p.repetition_penalty != 1.0 and (prompt or output):
            seen = np.unique(np.asarray(prompt + output, np.int64))
            scores = logits[seen]
            logits[seen] = _finite(np.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty))
        if (p.presence_penalty or p.frequency_penalty) and output:
            tokens, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
            logits[tokens] -= p.presence_penalty + p.frequency_penalty * counts
        if not logits.max() > -FINITE:
            raise SamplingError("the model's logits hold no finite value")
        return logits

    @_quiet
    def warped(self, logits: np.ndarray) -> np.ndarray:
        """Temperature, top-k, top-p and min-p on penalized logits (-inf where a token is ruled out)."""
        p = self.params
        scores = _finite(logits / p.temperature)
        if 0 < p.top_k < scores.size:
            kth = np.partition(scores, -p.top_k)[-p.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        if p.top_p < 1.0:
            order = np.argsort(scores, kind="stable")  # ascending, as transformers sorts
            probs = _softmax(scores[order])
            drop = np.cumsum(probs) <= 1.0 - p.top_p
            drop[-1] = False  # the most likely token always stays
            scores[order[drop]] = -np.inf
        if p.min_p > 0.0:
            probs = _softmax(scores)
            scores = np.where(probs < p.min_p * probs.max(), -np.inf, scores)
        return scores

    def next(self, logits: np.ndarray, prompt: list[int], output: list[int]) -> int:
        if self.bias is not None or (self.held is not None and len(output) < self.min_tokens):
            logits = np.array(logits, np.float64)
            if self.bias is not None:
                ids, values = self.bias
                inside = ids < logits.size
                logits[ids[inside]] += values[inside]
            if self.held is not None and len(output) < self.min_tokens:
                logits[self.held[self.held < logits.size]] = -np.inf
        allowed = None if self.constraint is None else self.constraint.allowed(logits.size)
        if self.unpenalized_greedy:  # argmax stops at the first NaN: a finite pick means no NaN and no inf, as below
            scores = logits if allowed is None else np.where(allowed, logits, -np.inf)
            token = int(np.argmax(scores))
            if np.isfinite(scores[token]):
                if self.constraint is not None:
                    self.constraint.accept(token)
                return token
        logits = self.penalized(logits, prompt, output)
        if allowed is not None:
            logits[~allowed] = -np.inf
        if self.rng is None:
            token = int(np.argmax(logits))
        else:
            cumulative = np.cumsum(_softmax(self.warped(logits)))
            # the first token whose cumulative probability exceeds a uniform draw (never one with probability 0)
            token = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        if self.constraint is not None:
            self.constraint.accept(token)
        return token


READ = frozenset({*SamplingParams.NAMES, "logprobs", "ignore_eos", "structured_outputs", "fill_context", "logit_bias",
                  "min_tokens", "max_total_tokens"})  # request_choices reads these
INPUTS = ("max_new_tokens", "stop_token_ids", "stream", "text_input", "messages")  # inputs, never parameters
ELSEWHERE = {"max_tokens": "max_new_tokens (an input)", "max_completion_tokens": "max_new_tokens (an input)"}


def unread(params: dict, also: frozenset[str] = frozenset()) -> None:
    """SamplingError for a parameter the model does not read (besides READ and `also`): a client's mistake never goes
    silently. Names Triton or a forwarded header gives (id, triton_*, names with '-') pass."""
    for name in params:
        if not name.isidentifier() or name.startswith("triton_") or name == "id" or name in READ or name in also:
            continue
        fix = f"send it as the input {name}" if name in INPUTS else f"send {ELSEWHERE[name]}" if name in ELSEWHERE \
            else "leave it out"
        raise SamplingError(f"{name} is not a parameter this model reads: {fix}")


def request_choices(parameters: str, prompt_tokens: int, max_new_tokens: np.ndarray | None, default_new_tokens: int,
                    max_positions: int, stop_token_ids: np.ndarray | None,
                    eos: set[int], grammars=None, also: frozenset[str] = frozenset(), vocab: int | None = None
                    ) -> tuple[int, Sampler, set[int]]:
    """What one generation request asks for, checked: how many new tokens (its max_new_tokens, or the default;
    prompt and new tokens within `max_positions`), its sampler (from its parameters, the JSON text Triton gives),
    and where it stops (its stop_token_ids and, unless `ignore_eos` as in vLLM, the model's end-of-sequence ids);
    the `logprobs` parameter (alternatives per token, 0-20) is the sampler's, and so is `structured_outputs` (a
    grammar the answer must follow, made by `grammars`, grammar.Grammars: a caller without one refuses it); any other
    parameter (but `also`, those the caller reads) is refused by name. With the `fill_context` parameter true, the
    answer may run to the end of the positions (as vLLM's max_tokens unset), max_new_tokens then being a cap only.
    `logit_bias` (JSON text: token id -> -100..100, ids within `vocab`) and `min_tokens` (no stop before) are the
    sampler's too. SamplingError names a mistake."""
    params = json.loads(parameters or "{}")
    unread(params, also)
    fill = params.get("fill_context", False)
    if not isinstance(fill, bool):
        raise SamplingError(f"fill_context must be true or false, got {shown(fill)}")
    asked = int(np.asarray(max_new_tokens).reshape(-1)[0]) if max_new_tokens is not None else None
    new_tokens = asked if asked is not None else default_new_tokens
    if fill:
        new_tokens = max_positions - prompt_tokens if asked is None else min(asked, max_positions - prompt_tokens)
        total = _integer(params, "max_total_tokens", 1, 2**31 - 1)  # what a tenant's token limits have left
        if total is not None and total - prompt_tokens < min(new_tokens, 1):
            raise SamplingError(f"max_total_tokens ({total}: what the token limits have left) is used up by the "
                                f"prompt's {prompt_tokens} tokens: ask later, or with a shorter prompt")
        if total is not None:
            new_tokens = min(new_tokens, total - prompt_tokens)
        if new_tokens < 1:
            raise ContextTooLong(prompt_tokens, 1, max_positions, "shorten the prompt")
    if new_tokens < 1:
        raise SamplingError(f"max_new_tokens must be at least 1, got {new_tokens}")
    if prompt_tokens + new_tokens > max_positions:
        raise ContextTooLong(prompt_tokens, new_tokens, max_positions, "shorten the prompt or ask for fewer tokens")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise SamplingError(f"ignore_eos must be true or false, got {shown(ignore_eos)}")
    constraint = None
    if params.get("structured_outputs") is not None:
        if grammars is None:
            raise SamplingError("structured_outputs: this model does not enforce grammars; ask the streaming model "
                                "(NAME_llm) or the gateway's OpenAI route")
        if ignore_eos:
            raise SamplingError("ignore_eos cannot go with structured_outputs: the grammar decides where the answer "
                                "ends; leave ignore_eos out")
        try:
            constraint = grammars.constraint(params["structured_outputs"])
        except ValueError as e:  # grammar.GrammarError: the grammar cannot be used
            raise SamplingError(str(e)) from None
    stops = set() if ignore_eos else set(eos)
    if stop_token_ids is not None:
        stops |= set(np.asarray(stop_token_ids).reshape(-1).tolist())
    min_tokens = _integer(params, "min_tokens", 0, new_tokens) or 0
    sampler = Sampler(SamplingParams.from_parameters(params), _integer(params, "logprobs", 0, MAX_LOGPROBS),
                      constraint, _bias(params.get("logit_bias"), vocab), min_tokens, stops)
    return new_tokens, sampler, stops


def _bias(text, vocab: int | None) -> dict[int, float] | None:
    """The logit_bias parameter (JSON text of OpenAI's map), checked."""
    if text is None:
        return None
    try:
        value = json.loads(text) if isinstance(text, str) and len(text) <= 65536 else None
    except ValueError:
        value = None
    high = (vocab or 2**31) - 1
    if not isinstance(value, dict) or len(value) > 300 or not all(
            k.isdigit() and len(k) <= 10 and int(k) <= high and isinstance(b, (int, float)) and
            not isinstance(b, bool) and -100 <= b <= 100 for k, b in value.items()):
        raise SamplingError(f"logit_bias must be the JSON text of at most 300 token ids (0-{high}, as strings) to "
                            f"numbers from -100 to 100, got {shown(text)}")
    return {int(k): float(b) for k, b in value.items()} or None


def _finite(scores: np.ndarray) -> np.ndarray:
    """Scores clipped to +-FINITE, NaN as -FINITE (a token ruled out), in place."""
    np.nan_to_num(scores, copy=False, nan=-FINITE)
    return np.clip(scores, -FINITE, FINITE, out=scores)



def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max())
    return e / e.sum()
