"""Structured outputs: what a request's answer must be — JSON under a schema, any JSON object, text matching a
regular expression, one of a list of strings, or a Lark grammar — enforced while sampling by llguidance (why this
engine: docs/structured-outputs.md). Beside sampling.py in Triton's python backend; numpy and llguidance only.

A request asks with the parameter `structured_outputs`, a JSON object of one kind (vLLM's names):
`{"json": SCHEMA}`, `{"json_object": true}`, `{"regex": "..."}`, `{"choice": ["a", "b"]}`, `{"grammar": "LARK"}`.
JSON comes compact (no whitespace between tokens, keys in the schema's order), so a model cannot spend its tokens on
spaces, and an object schema that does not say `additionalProperties` allows no other keys (xgrammar's strict mode,
vLLM's default, and what OpenAI's `strict` requires), so a model cannot wander off into keys of its own. Each step
the sequence's matcher says which tokens may come next; the others are ruled out before sampling, and the
end-of-sequence token is allowed only where the grammar may end, so every answer that ends (not cut by
max_new_tokens) is in the grammar.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a grammar's text, at most


class GrammarError(ValueError):
    """The client's grammar cannot be used (the message names the part and what to do)."""


def _llguidance():
    import llguidance  # imported on first use: a server that never gets a grammar does not load it

    return llguidance


def grammar_of(spec) -> str:
    """llguidance's grammar for a `structured_outputs` value (a dict, or its JSON text), checked without a tokenizer:
    GrammarError naming what is wrong."""
    try:
        return _grammar_of(spec)
    except RecursionError:
        raise GrammarError("structured_outputs is nested too deep") from None


def _grammar_of(spec) -> str:
    if isinstance(spec, str):
        if len(spec) > MAX_SPEC_BYTES:
            raise GrammarError(f"structured_outputs is {len(spec)} bytes: at most {MAX_SPEC_BYTES}")
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError):
            raise GrammarError("structured_outputs must be a JSON object of one of " + ", ".join(KINDS)) from None
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise GrammarError("structured_outputs must be an object with one of " + ", ".join(KINDS) +
                           f", got {_short(spec)}")
    kind, value = next(iter(spec.items()))
    matcher = _llguidance().LLMatcher
    if kind == "json" or kind == "json_object":
        if kind == "json_object":
            if value is not True:
                raise GrammarError("structured_outputs.json_object must be true")
            value = {"type": "object"}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise GrammarError("structured_outputs.json: the schema is not JSON") from None
        if not isinstance(value, dict):
            raise GrammarError(f"structured_outputs.json must be a JSON schema (an object), got {_short(value)}")
        grammar = matcher.grammar_from_json_schema(closed(value), overrides=COMPACT)
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise GrammarError("structured_outputs.regex must be a non-empty regular expression")
        grammar = matcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError("structured_outputs.choice must be a non-empty list of non-empty strings")
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            raise GrammarError("structured_outputs.grammar must be a Lark grammar (text)")
        grammar = matcher.grammar_from_lark(value)
    error = matcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"structured_outputs.{kind}: {_reason(error)}")
    return grammar


MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def closed(schema):
    """The schema with `additionalProperties: false` on each object schema that does not say otherwise."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in ONES:
        if key in out:
            out[key] = [closed(s) for s in out[key]] if isinstance(out[key], list) else closed(out[key])
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _reason(error: str) -> str:
    """llguidance's message on one line, short."""
    return " ".join(line.strip() for line in error.strip().splitlines() if line.strip())[:300]


def _short(value) -> str:
    text = json.dumps(value)[:60] if not isinstance(value, str) else repr(value[:60])
    return text


class Grammars:
    """A tokenizer's view for llguidance (built once, on first use: tens to hundreds of milliseconds) and the
    constraints made from it. `tokenizer` is the model's fast Hugging Face tokenizer (or a `tokenizers.Tokenizer`),
    `eos` its end-of-sequence ids."""

    def __init__(self, tokenizer, eos: set[int]):
        self.tokenizer, self.eos = tokenizer, sorted(eos)
        self.built: Any = None
        self.lock = threading.Lock()

    def _ll_tokenizer(self):
        with self.lock:
            if self.built is None:
                import llguidance.hf

                if not self.eos:
                    raise GrammarError("structured outputs need the model's end-of-sequence token, and it has none")
                if hasattr(self.tokenizer, "backend_tokenizer"):  # a Hugging Face fast tokenizer
                    self.built = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos)
                else:  # the `tokenizers` library's own
                    self.built = llguidance.LLTokenizer(self.tokenizer.to_str(), eos_token=self.eos)
            return self.built

    def constraint(self, spec) -> Constraint:
        """A new sequence's constraint for a `structured_outputs` value; GrammarError when it cannot be used."""
        grammar = grammar_of(spec)
        tokenizer = self._ll_tokenizer()
        matcher = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs: {_reason(matcher.get_error())}")
        return Constraint(matcher, tokenizer.vocab_size)


class Constraint:
    """One sequence's grammar state: which tokens may come next (`allowed`), then the one chosen (`accept`)."""

    def __init__(self, matcher, vocab: int):
        self.matcher = matcher
        self.bits = np.zeros((vocab + 31) // 32, np.int32)

    def allowed(self, size: int) -> np.ndarray:
        """A boolean row of `size` ids: True where the grammar lets the token come next (ids beyond the tokenizer's
        vocabulary never). GrammarError when the matcher cannot go on."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {_reason(self.matcher.get_error())}")
        flags = np.unpackbits(self.bits.view(np.uint8), bitorder="little").view(np.bool_)
        if flags.size >= size:
            return flags[:size]
        return np.concatenate([flags, np.zeros(size - flags.size, np.bool_)])

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not in the grammar: {_reason(self.matcher.get_error())}")
