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
max_new_tokens) is in the grammar. A JSON answer's keys are tracked besides (`_Keys`): llguidance cannot keep a key
that a pattern lets in from coming twice in an object, so the sampler does.

A client's grammar is untrusted input to a native compiler that recurses on it (a chain of 2,500 `$ref`s or 3,000
Lark rules overflows an 8 MiB thread stack and the process dies), and some grammars cost seconds and hundreds of MB
to build. So every spec is bounded before llguidance sees it (`bounded`: bytes, JSON depth, `$ref`s, Lark rules,
choices), compiled on threads with a COMPILE_STACK stack (`COMPILER`: ten times the deepest chain the bounds let
through, measured in docs/structured-outputs.md), under llguidance's fuel and state limits (LIMITS), with its first
mask computed there too (what builds the lexer), and kept by content: a sequence joins the batch only with a grammar
known to begin, and the same grammar is compiled once.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from .errors import GrammarError

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a spec's JSON text (or a grammar's text), at most
MAX_DEPTH = 64  # JSON nesting of a schema (the 455 schemastore schemas within 64 KiB: 23 at most)
MAX_REFS = 1000  # `$ref`s in a schema (those schemas: 288 at most)
MAX_RULES = 1000  # rules and terminals of a Lark grammar
MAX_CHOICES = 1000  # strings of a choice (llguidance's parser takes 2,000 alternatives in a row)
COMPILE_STACK = 256 << 20  # bytes of stack of a compiling thread (virtual: only what recursion touches is used)
COMPILE_THREADS = 2
# compiled grammars (and their bytes) and fresh matchers kept: a matcher built to its limits holds ~8 MB
KEPT_GRAMMARS, KEPT_BYTES, KEPT_MATCHERS = 1024, 16 << 20, 8
# llguidance's own bounds on building and running a grammar (its defaults: 1M, 200k, 50k, 250k, 500k): a lexer built
# with ~1 ms of fuel (~8 MB; the 201 schemastore schemas it compiles need less than 30k), a few ms per token; errors
# without the parser's internal state.
LIMITS = {"initial_lexer_fuel": 50_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 10_000, "max_grammar_size": 200_000, "verbose_errors": False}
_LARK_RULE = None  # the compiled pattern of a Lark definition's start (made on first use)


def _llguidance():
    import llguidance  # imported on first use: a server that never gets a grammar does not load it

    return llguidance


def _limits():
    return _llguidance().LLParserLimits(**LIMITS)


class Compiler:
    """Threads with a COMPILE_STACK stack that run compilations (started on first use); `run` waits for one,
    `submit` hands back its Future."""

    def __init__(self, threads: int = COMPILE_THREADS):
        self.size = threads
        self.threads: list[threading.Thread] = []
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        if len(self.threads) < self.size:
            self._start()
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def run(self, fn: Callable, *args):
        if threading.current_thread() in self.threads:
            return fn(*args)
        return self.submit(fn, *args).result()

    def _start(self) -> None:
        with self.lock:
            while len(self.threads) < self.size:
                previous = threading.stack_size(COMPILE_STACK)
                try:
                    thread = threading.Thread(target=self._work, name="dstool-grammar", daemon=True)
                    thread.start()
                finally:
                    threading.stack_size(previous)
                self.threads.append(thread)

    def _work(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (the caller gets it)
                future.set_exception(e)


COMPILER = Compiler()


class _Kept:
    """Compiled grammars by spec text (the grammar or the GrammarError), least recently used out first, bounded in
    entries and bytes."""

    def __init__(self):
        self.items: OrderedDict[str, str | GrammarError] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> str | GrammarError | None:
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: str, value: str | GrammarError) -> None:
        with self.lock:
            if key in self.items:
                return
            self.items[key] = value
            self.bytes += len(key) + (len(value) if isinstance(value, str) else 0)
            while len(self.items) > KEPT_GRAMMARS or self.bytes > KEPT_BYTES:
                old_key, old = self.items.popitem(last=False)
                self.bytes -= len(old_key) + (len(old) if isinstance(old, str) else 0)


_KEPT = _Kept()


def bounded(spec) -> tuple[str, str, Any]:
    """A `structured_outputs` value (a dict, or its JSON text) checked against the bounds, without compiling it:
    (its JSON text, the kind, the value). GrammarError naming what is wrong or too large."""
    if isinstance(spec, str):
        text = spec
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise GrammarError(f"structured_outputs is {len(text.encode())} bytes: at most {MAX_SPEC_BYTES}")
        try:
            spec = json.loads(text)
        except RecursionError:
            raise GrammarError(f"structured_outputs is nested too deep: at most {MAX_DEPTH} levels") from None
        except ValueError:
            raise GrammarError("structured_outputs must be a JSON object of one of " + ", ".join(KINDS)) from None
    else:
        try:
            text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise GrammarError(f"structured_outputs is nested too deep: at most {MAX_DEPTH} levels") from None
        except (TypeError, ValueError):
            raise GrammarError("structured_outputs must be JSON") from None
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise GrammarError(f"structured_outputs is {len(text.encode())} bytes: at most {MAX_SPEC_BYTES}")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise GrammarError("structured_outputs must be an object with one of " + ", ".join(KINDS) +
                           f", got {_short(spec)}")
    kind, value = next(iter(spec.items()))
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise GrammarError(f"structured_outputs.json is nested too deep: at most {MAX_DEPTH} levels") from None
        except ValueError:
            raise GrammarError("structured_outputs.json: the schema is not JSON") from None
    if kind == "json":
        depth, refs = _shape(value)
        if depth > MAX_DEPTH:
            raise GrammarError(f"structured_outputs.json is nested {depth} levels deep: at most {MAX_DEPTH}")
        if refs > MAX_REFS:
            raise GrammarError(f"structured_outputs.json has {refs} $refs: at most {MAX_REFS}")
    elif kind == "choice" and isinstance(value, list) and len(value) > MAX_CHOICES:
        raise GrammarError(f"structured_outputs.choice has {len(value)} strings: at most {MAX_CHOICES}")
    elif kind == "grammar" and isinstance(value, str):
        rules = _lark_rules(value)
        if rules > MAX_RULES:
            raise GrammarError(f"structured_outputs.grammar has {rules} rules and terminals: at most {MAX_RULES}")
    return text, kind, value


def _shape(value) -> tuple[int, int]:
    """(JSON nesting depth, `$ref` keys) of a value, walked without recursion."""
    deepest, refs, todo = 0, 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            refs += "$ref" in item
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            todo.extend((v, depth + 1) for v in item)
    return deepest, refs


def _lark_rules(text: str) -> int:
    """Definitions (rules and terminals) of a Lark grammar: lines that begin with a name and a colon."""
    global _LARK_RULE
    if _LARK_RULE is None:
        _LARK_RULE = re.compile(r"^\s*[?!]?@?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?\s*:", re.MULTILINE)
    return len(_LARK_RULE.findall(text))


def grammar_of(spec) -> str:
    """llguidance's grammar for a `structured_outputs` value (a dict, or its JSON text), bounded and checked
    without a tokenizer (on COMPILER's threads, kept by content): GrammarError naming what is wrong."""
    text, kind, value = bounded(spec)
    return COMPILER.run(_compiled, text, kind, value)


def check(spec) -> Future:
    """`grammar_of` without waiting: a Future of the grammar (done at once for a grammar compiled before). The
    bounds are checked here, before anything is queued: GrammarError."""
    text, kind, value = bounded(spec)
    kept = _KEPT.get(text)
    if kept is not None:
        future: Future = Future()
        if isinstance(kept, GrammarError):
            future.set_exception(kept)
        else:
            future.set_result(kept)
        return future
    return COMPILER.submit(_compiled, text, kind, value)


def _compiled(text: str, kind: str, value) -> str:
    """The grammar of a bounded spec, compiled once (an error is kept as well)."""
    kept = _KEPT.get(text)
    if kept is None:
        try:
            kept = _compile(kind, value)
        except GrammarError as e:
            kept = e
        except RecursionError:
            kept = GrammarError(f"structured_outputs.{kind} is nested too deep")
        except Exception as e:  # noqa: BLE001 (llguidance raises what it likes: it is the client's grammar)
            kept = GrammarError(f"structured_outputs.{kind}: {_reason(str(e))}")
        _KEPT.put(text, kept)
    if isinstance(kept, GrammarError):
        raise GrammarError(str(kept))
    return kept


def _compile(kind: str, value) -> str:
    matcher = _llguidance().LLMatcher
    if kind == "json" or kind == "json_object":
        if kind == "json_object":
            if value is not True:
                raise GrammarError("structured_outputs.json_object must be true")
            value = {"type": "object", "additionalProperties": True}  # any object: closed() would allow only {}
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
    error = matcher.validate_grammar(grammar, limits=_limits())
    if error:
        raise GrammarError(f"structured_outputs.{kind}: {_reason(error)}")
    return grammar


MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def closed(schema):
    """The schema with `additionalProperties: false` on each object schema that does not say otherwise. An `allOf`
    of object schemas is closed as a whole: its members stay open (a `$ref` member points to an open copy of its
    definition) and the schema holding them allows the keys they declare; closed one by one, `allOf: [{a}, {b}]`
    could hold no object with both a and b."""
    if not isinstance(schema, dict):
        return schema
    closer = _Closer(schema)
    out = closer.closed(schema)
    if closer.copies:
        out["$defs"] = {**out.get("$defs", {}), **closer.copies}
    return out


class _Closer:
    """`closed` for one schema: local `$ref`s (`#/$defs/NAME`, `#/definitions/NAME`) resolved against it."""

    def __init__(self, root: dict):
        self.root = root
        self.opened: dict[str, str] = {}  # a $ref of an allOf member -> the name of its open copy
        self.copies: dict[str, Any] = {}  # the open copies by name (added to the root's $defs)

    def closed(self, schema, close: bool = True):
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        members = schema.get("allOf")
        declared = self._declared(members) if isinstance(members, list) else None
        for key in MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: self.closed(s) for name, s in out[key].items()}
        for key in LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self._open(s) if declared is not None and key == "allOf" else self.closed(s)
                            for s in out[key]]
        for key in ONES:
            if key in out:
                out[key] = [self.closed(s) for s in out[key]] if isinstance(out[key], list) else \
                    self.closed(out[key])
        if declared is not None:
            names, patterns, others = declared
            if not close or others or "additionalProperties" in schema:
                return out
            for key, found in (("properties", names), ("patternProperties", patterns)):
                own = out.get(key, {})
                if found and isinstance(own, dict):
                    out[key] = {**own, **{name: True for name in found if name not in own}}
            out["additionalProperties"] = False
        elif close and (schema.get("type") == "object" or "properties" in schema) and \
                "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out

    def _open(self, member):
        """An allOf member closed within but not itself (a `$ref` to a definition: to an open copy of it)."""
        out = self.closed(member, close=False)
        ref = member.get("$ref") if isinstance(member, dict) else None
        target = self._target(ref)
        if isinstance(ref, str) and target is not None and isinstance(self.root.get("$defs", {}), dict):
            if ref not in self.opened:
                name = f"dstool_open_{len(self.opened)}"
                while name in self.root.get("$defs", {}):
                    name += "_"
                self.opened[ref] = name
                self.copies[name] = self.closed(target, close=False)
            out["$ref"] = "#/$defs/" + self.opened[ref]
        return out

    def _target(self, ref) -> dict | None:
        """The definition a local `$ref` points to, or None."""
        for where in ("$defs", "definitions"):
            if isinstance(ref, str) and ref.startswith(f"#/{where}/"):
                defs = self.root.get(where)
                target = defs.get(ref[len(where) + 3:].replace("~1", "/").replace("~0", "~")) \
                    if isinstance(defs, dict) else None
                return target if isinstance(target, dict) else None
        return None

    def _declared(self, members: list) -> tuple[dict, dict, bool] | None:
        """What an allOf's members (through local `$ref`s and their own allOfs) declare: property names, property
        patterns, whether one says which other keys it allows. None when no member is an object schema, or one is a
        `$ref` this cannot follow."""
        names: dict = {}  # in order, as sets
        patterns: dict = {}
        objects = others = False
        todo, seen = list(members), set()
        while todo:
            member = todo.pop(0)
            if not isinstance(member, dict):
                continue
            ref = member.get("$ref")
            if ref is not None:
                target = self._target(ref)
                if target is None:
                    return None
                if ref not in seen:
                    seen.add(ref)
                    todo.insert(0, target)
            objects = objects or member.get("type") == "object" or "properties" in member or \
                "patternProperties" in member
            others = others or "additionalProperties" in member or "unevaluatedProperties" in member
            for key, found in (("properties", names), ("patternProperties", patterns)):
                if isinstance(member.get(key), dict):
                    found.update(dict.fromkeys(member[key], True))
            if isinstance(member.get("allOf"), list):
                todo += member["allOf"]
        return (names, patterns, others) if objects else None


def _reason(error: str) -> str:
    """llguidance's message on one line, short."""
    return " ".join(line.strip() for line in error.strip().splitlines() if line.strip())[:300]


def _short(value) -> str:
    try:
        return json.dumps(value)[:60] if not isinstance(value, str) else repr(value[:60])
    except (TypeError, ValueError, RecursionError):
        return f"a {type(value).__name__}"


class Grammars:
    """A tokenizer's view for llguidance (built once, on first use: tens to hundreds of milliseconds) and the
    constraints made from it. `tokenizer` is the model's fast Hugging Face tokenizer (or a `tokenizers.Tokenizer`),
    `eos` its end-of-sequence ids."""

    def __init__(self, tokenizer, eos: set[int]):
        self.tokenizer, self.eos = tokenizer, sorted(eos)
        self.built: Any = None
        self.pieces: list[bytes] = []  # each token's bytes (b"" for special tokens)
        self.by_piece: dict[bytes, list[int]] = {}  # the tokens of each piece
        self.quoted = self.commas = np.zeros(0, np.int64)  # the tokens with a '"' in them, and with a ','
        self.lock = threading.Lock()
        self.fresh: OrderedDict[str, Any] = OrderedDict()  # spec text -> a matcher at its start, first mask made
        self.thought: frozenset[int] | None = None  # the ids of `</think>` (AfterThinking), once asked

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
                self.pieces = [b"" if self.built.is_special_token(i) else self.built.decode_bytes([i])
                               for i in range(self.built.vocab_size)]
                for i, piece in enumerate(self.pieces):
                    self.by_piece.setdefault(piece, []).append(i)
                self.quoted = np.array([i for i, piece in enumerate(self.pieces) if b'"' in piece], np.int64)
                self.commas = np.array([i for i, piece in enumerate(self.pieces) if b"," in piece], np.int64)
            return self.built

    def constraint(self, spec) -> Constraint:
        """A new sequence's constraint for a `structured_outputs` value, its first mask made (so it is known to
        begin); GrammarError when it cannot be used."""
        text, kind, value = bounded(spec)
        return COMPILER.run(self._constraint, text, kind, value)

    def _constraint(self, text: str, kind: str, value) -> Constraint:
        with self.lock:
            fresh = self.fresh.get(text)
            if fresh is not None:
                self.fresh.move_to_end(text)
        if fresh is None:
            grammar = _compiled(text, kind, value)
            tokenizer = self._ll_tokenizer()
            try:
                fresh = _llguidance().LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
            except Exception as e:  # noqa: BLE001 (the client's grammar: whatever llguidance raises)
                raise GrammarError(f"structured_outputs.{kind}: {_reason(str(e))}") from None
            if fresh.is_error():
                raise GrammarError(f"structured_outputs.{kind}: {_reason(fresh.get_error())}")
            Constraint(fresh, tokenizer.vocab_size).allowed(0)  # the first mask: builds the lexer, or fails here
            with self.lock:
                self.fresh[text] = fresh
                while len(self.fresh) > KEPT_MATCHERS:
                    self.fresh.popitem(last=False)
        keys = _Keys(self.pieces, self.by_piece, self.quoted, self.commas) if kind in ("json", "json_object") \
            else None
        return Constraint(fresh.deep_copy(), self._ll_tokenizer().vocab_size, keys)

    def after_thinking(self, constraint: Constraint) -> AfterThinking:
        """`constraint` from the end of the model's thinking on (AfterThinking)."""
        vocab = self._ll_tokenizer().vocab_size
        with self.lock:
            if self.thought is None:  # the token(s) that are `</think>` (an added token's piece reads b"" here)
                own = self.tokenizer.convert_tokens_to_ids(THOUGHT.decode()) if hasattr(
                    self.tokenizer, "convert_tokens_to_ids") else self.tokenizer.token_to_id(THOUGHT.decode())
                self.thought = frozenset(self.by_piece.get(THOUGHT, ())) | (
                    {own} if isinstance(own, int) and own != getattr(self.tokenizer, "unk_token_id", None) else set())
        return AfterThinking(constraint, self.pieces, self.eos, vocab, self.thought)


THOUGHT = b"</think>"  # where a reasoning model's thinking ends (DeepSeek-R1's, V3.1's, Qwen3's)


def thought_over(prompt: str) -> bool:
    """Whether a prompt leaves the model's thinking closed: its last think tag is </think> (V3.1's template with
    thinking off); a prompt that opens one (R1's `<think>\n`) or has none lets the model think first (vLLM's rule)."""
    return prompt.rfind("</think>") > prompt.rfind("<think>")


class AfterThinking:
    """A grammar that begins where the model's thinking ends (the gateway's --reasoning-parser, as vLLM's structured
    outputs with a reasoning parser): every token but the end of the sequence may come until the answer's text holds
    `</think>` (one token in DeepSeek's tokenizers, or spelled by several), then `constraint` rules from the next
    token on. So the model thinks freely, and what follows its thinking is in the grammar: an answer cannot end while
    thinking (vLLM lets it, and the answer is then no JSON at all)."""

    def __init__(self, constraint: Constraint, pieces: list[bytes], eos: list[int], vocab: int, ends: frozenset[int]):
        self.constraint, self.pieces, self.eos, self.vocab, self.ends = constraint, pieces, eos, vocab, ends
        self.thinking, self.tail = True, b""
        self.row: np.ndarray | None = None

    def allowed(self, size: int) -> np.ndarray:
        if not self.thinking:
            return self.constraint.allowed(size)
        if self.row is None or self.row.size != size:
            self.row = np.arange(size) < self.vocab
            self.row[[i for i in self.eos if i < size]] = False
        return self.row

    def accept(self, token: int) -> None:
        if not self.thinking:
            self.constraint.accept(token)
            return
        self.tail = (self.tail + (self.pieces[token] if token < len(self.pieces) else b""))[-64:]
        self.thinking = token not in self.ends and THOUGHT not in self.tail


class Constraint:
    """One sequence's grammar state: which tokens may come next (`allowed`), then the one chosen (`accept`)."""

    def __init__(self, matcher, vocab: int, keys: _Keys | None = None):
        self.matcher, self.keys = matcher, keys
        self.bits = np.zeros((vocab + 31) // 32, np.int32)

    def allowed(self, size: int) -> np.ndarray:
        """A boolean row of `size` ids: True where the grammar lets the token come next (ids beyond the tokenizer's
        vocabulary never). GrammarError when the matcher cannot go on."""
        flags = _flags(self.matcher, self.bits)
        if self.keys is not None:
            self.keys.rule_out(flags, self.matcher)
        if flags.size >= size:
            return flags[:size]
        return np.concatenate([flags, np.zeros(size - flags.size, np.bool_)])

    def accept(self, token: int) -> None:
        if self.keys is not None:
            self.keys.take(token)
        if not self.matcher.consume_token(token):
            raise GrammarError(f"structured_outputs: token {token} is not in the grammar: "
                               f"{_reason(self.matcher.get_error())}")


def _flags(matcher, bits: np.ndarray) -> np.ndarray:
    """The tokens `matcher` allows next, a boolean row over the vocabulary (its mask made in `bits`)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if matcher.is_error():
        raise GrammarError(f"structured_outputs: the grammar cannot go on: {_reason(matcher.get_error())}")
    if not bits.any():
        raise GrammarError("structured_outputs: the grammar allows no token here (it is too large for the grammar "
                           "engine's limits, or allows nothing): simplify it")
    return np.unpackbits(bits.view(np.uint8), bitorder="little").view(np.bool_)


class _Keys:
    """The keys of each JSON object open in an answer, read from its tokens' bytes as they come, so that a token
    that would repeat one is ruled out: llguidance cannot (a key that `patternProperties` or `additionalProperties`
    lets in is free text to it), and `{"x3":true,"x3":true}` is one key to a JSON reader, under `minProperties: 2`.
    A token that begins or goes on with a key its object holds is taken only if the grammar lets that key still end
    as a new one (`"x` when x0 to x9 are all there could not), looked ahead along the keys held, LOOKAHEAD matchers
    at most a step."""

    LOOKAHEAD = 64

    def __init__(self, pieces: list[bytes], by_piece: dict[bytes, list[int]], quoted: np.ndarray,
                 commas: np.ndarray):
        self.pieces, self.by_piece, self.quoted, self.commas = pieces, by_piece, quoted, commas
        self.state = _Json((), False, False, False, b"")
        self.budget = 0

    def take(self, token: int) -> None:
        self.state = self.state.read(self.pieces[token])[0]

    def rule_out(self, flags: np.ndarray, matcher) -> None:
        """Set False in `flags` (the grammar's row over the vocabulary) each token that would repeat a key, or lead
        into one that can only end as a key its object holds; GrammarError when none is left."""
        self.budget = self.LOOKAHEAD
        for token in self._risky(flags, self.state):
            if not self._new(self.state, token, matcher):
                flags[token] = False
        if not flags.any():
            raise GrammarError("structured_outputs: every key the schema allows here is in the object already: "
                               "bound the object with maxProperties, or let more keys in")

    def _risky(self, flags: np.ndarray, state: _Json) -> list[int]:
        """The tokens `flags` allows that may end a key, begin one, or go on along one the object holds: those with
        a quote, those with a comma (outside a string), and (in a key) those that make it a longer prefix of one
        held."""
        risky = set(self.quoted[flags[self.quoted]].tolist())
        if not state.string:
            risky.update(self.commas[flags[self.commas]].tolist())
        for held in state.held():
            for end in range(1, len(held) + 1):
                risky.update(t for t in self.by_piece.get(held[:end], ()) if flags[t])
        return sorted(risky)

    def _new(self, state: _Json, token: int, matcher) -> bool:
        """Whether `token`, next after `state`, repeats no key and leaves a key that can still end as a new one."""
        after, repeated = state.read(self.pieces[token])
        if repeated:
            return False
        if not after.held() or self.budget <= 0:
            return True
        self.budget -= 1
        ahead = matcher.deep_copy()
        if not ahead.consume_token(token):
            return False
        flags = _flags(ahead, np.zeros((len(self.pieces) + 31) // 32, np.int32))
        risky = self._risky(flags, after)
        return np.count_nonzero(flags) > len(risky) or any(self._new(after, t, ahead) for t in risky)


_MOVES = re.compile(rb'["\\{}\[\],]')  # the bytes that move a _Json on: quotes, backslashes, brackets, commas


class _Json(NamedTuple):
    """Where an answer's JSON is, as far as its keys go: the containers open (innermost last: an object's keys, as
    read and as written, and whether a key comes next; None for an array), and the string being read."""

    frames: tuple[tuple[frozenset | None, tuple[bytes, ...], bool], ...]
    string: bool
    escaped: bool
    key: bool
    text: bytes  # the key so far, as written

    def held(self) -> list[bytes]:
        """The rest of each key its object holds (as written) that the key being written begins (all of them where
        a key comes next)."""
        if self.key:
            return [raw[len(self.text):] for raw in self.frames[-1][1] if raw.startswith(self.text)]
        return list(self.frames[-1][1]) if not self.string and self.frames and self.frames[-1][2] else []

    def read(self, data: bytes) -> tuple[_Json, bool]:
        """This after `data`, and whether `data` ends a key its object holds already."""
        if not data:
            return self, False
        if not _MOVES.search(data):  # a number, a literal, or text within a string
            return self._replace(escaped=False, text=self.text + data if self.key else self.text), False
        frames, (string, escaped, key, text), repeated = list(self.frames), self[1:], False
        for byte in data:
            if string:
                if escaped:
                    escaped = False
                elif byte == 0x5C:  # backslash
                    escaped = True
                elif byte == 0x22:  # the string's end
                    string = False
                    if key:
                        names, raws, _ = frames[-1]
                        name = _key(text)
                        repeated = repeated or name in (names or ())
                        frames[-1] = ((names or frozenset()) | {name}, (*raws, text), False)
                    continue
                if key:
                    text += bytes((byte,))
            elif byte == 0x22:
                string, escaped, text = True, False, b""
                key = bool(frames) and frames[-1][2]
            elif byte == 0x7B:  # {
                frames.append((frozenset(), (), True))
            elif byte == 0x5B:  # [
                frames.append((None, (), False))
            elif byte in (0x7D, 0x5D) and frames:  # } ]
                frames.pop()
            elif byte == 0x2C and frames and frames[-1][0] is not None:  # a comma in an object: a key next
                frames[-1] = (*frames[-1][:2], True)
        return _Json(tuple(frames), string, escaped, key and string, text), repeated


def _key(text: bytes) -> str:
    """A key as a JSON reader has it (escapes read)."""
    try:
        return json.loads(b'"' + text + b'"')
    except ValueError:
        return text.decode("utf-8", "replace")
