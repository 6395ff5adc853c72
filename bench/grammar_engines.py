"""Grammar engines for JSON-schema-constrained decoding, xgrammar and llguidance, on Hugging Face tokenizers: the
one-off tokenizer-info build, schema compile, and the per-token cost of STREAMS matchers stepped together as one batch.

    python bench/grammar_engines.py --tokenizer DIR [--tokenizer DIR ...] [--streams 16] [--tokens 200]

Each step fills every unfinished stream's bitmask, applies the batch of bitmasks to random float32 logits, takes the
argmax (a uniformly random allowed token) and has each matcher accept it, until a stream's matcher accepts the stop
token (finished: its text must parse with json.loads, else it counts as failed) or TOKENS tokens (unfinished).
Reported: median microseconds per token per stream over the steps. llguidance runs on numpy (llguidance.numpy),
xgrammar on torch CPU tensors, as each documents. Both produce compact JSON: "," and ":" and no other whitespace.
An engine that does not import is skipped. Not part of the project's dependencies: run it from its own venv.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import metadata

import numpy as np

SCHEMAS = {
    "simple": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "kind": {"enum": ["book", "pen", "cup"]},
                        "price": {"type": "number"},
                        "in_stock": {"type": "boolean"},
                    },
                    "required": ["kind", "price", "in_stock"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    # any JSON object, as OpenAI's response_format json_object
    "json_object": {"type": "object"},
}


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class LLGuidance:
    """llguidance: the grammar is compiled lazily by each matcher (LLMatcher) from the schema's grammar string."""

    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.info = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = self.info.vocab_size

    def compile(self, schema: dict) -> str:
        return self.llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})

    def matcher(self, grammar: str):
        matcher = self.llg.LLMatcher(self.info, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def bitmask(self, rows: int) -> np.ndarray:
        return self.llg.numpy.allocate_token_bitmask(rows, self.vocab_size)

    def logits(self, array: np.ndarray) -> np.ndarray:
        return array

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        self.llg.numpy.fill_next_token_bitmask(matcher, bitmask, row)

    def apply(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        self.llg.numpy.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def finished(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    """xgrammar: a GrammarCompiler per tokenizer compiles each schema once; matchers share the compiled grammar."""

    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import torch
        import xgrammar

        self.torch = torch
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        # no cache: each compile is timed, not looked up
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = info.vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def logits(self, array: np.ndarray):
        return self.torch.from_numpy(array)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def finished(self, matcher) -> bool:
        return matcher.is_terminated()


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def installed_engines() -> list:
    engines = []
    for module, engine in ENGINES.items():
        try:
            __import__(module)
        except ImportError as e:
            print(f"{module}: not importable ({e}), skipped")
            continue
        engines.append(engine)
    return engines


def decode(engine, schema: dict, tokenizer, streams: int, max_tokens: int, rng: np.random.Generator) -> dict:
    """Compile `schema`, then step `streams` matchers together; timings and the outcome of each stream."""
    compile_ms = []
    for _ in range(3):
        start = time.perf_counter()
        compiled = engine.compile(schema)
        engine.matcher(compiled)
        compile_ms.append(ms_since(start))
    matcher_ms = []
    matchers = []
    for _ in range(streams):
        start = time.perf_counter()
        matchers.append(engine.matcher(compiled))
        matcher_ms.append(ms_since(start))
    bitmask = engine.bitmask(streams)
    outputs: list[list[int]] = [[] for _ in range(streams)]
    active = list(range(streams))
    fill_us, apply_us, total_us = [], [], []
    failed, errors = 0, []
    for _ in range(max_tokens):
        if not active:
            break
        n = len(active)
        logits_np = rng.random((n, engine.vocab_size), dtype=np.float32)
        logits = engine.logits(logits_np)
        start = time.perf_counter()
        for row, stream in enumerate(active):
            engine.fill(matchers[stream], bitmask, row)
        filled = time.perf_counter()
        engine.apply(logits, bitmask[:n])
        applied = time.perf_counter()
        tokens = logits_np.argmax(axis=1)
        accepted = [engine.accept(matchers[stream], int(token)) for stream, token in zip(active, tokens)]
        done = time.perf_counter()
        fill_us.append((filled - start) * 1e6 / n)
        apply_us.append((applied - filled) * 1e6 / n)
        total_us.append((done - start) * 1e6 / n)
        still = []
        for stream, token, ok in zip(active, tokens, accepted):
            outputs[stream].append(int(token))
            if not ok:
                failed += 1
                errors.append(f"token {int(token)} allowed by the mask, then refused")
            elif engine.finished(matchers[stream]):
                text = tokenizer.decode(outputs[stream], skip_special_tokens=True)
                try:
                    json.loads(text)
                except ValueError as e:
                    failed += 1
                    errors.append(f"{e}: {text!r}")
            else:
                still.append(stream)
        active = still
    return {
        "compile_ms": float(np.median(compile_ms)),
        "matcher_ms": float(np.median(matcher_ms)),
        "first_fill_us": fill_us[0],
        "fill_us": float(np.median(fill_us)),
        "apply_us": float(np.median(apply_us)),
        "total_us": float(np.median(total_us)),
        "tokens": sum(len(output) for output in outputs),
        "finished": streams - len(active) - failed,
        "unfinished": len(active),
        "failed": failed,
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", action="append", required=True, metavar="DIR",
                        help="a Hugging Face tokenizer folder (repeatable)")
    parser.add_argument("--streams", type=int, default=16, help="matchers stepped together, as a batch")
    parser.add_argument("--tokens", type=int, default=200, help="at most this many tokens per stream")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    engines = installed_engines()
    for engine in engines:
        print(f"{engine.name} {metadata.version(engine.name)}")
    rows = []
    for folder in args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for engine_class in engines:
            start = time.perf_counter()
            engine = engine_class(tokenizer)
            info_ms = ms_since(start)
            for schema_name, schema in SCHEMAS.items():
                rng = np.random.default_rng(args.seed)
                result = decode(engine, schema, tokenizer, args.streams, args.tokens, rng)
                rows.append((folder, engine.vocab_size, engine.name, info_ms, schema_name, result))
                for error in result["errors"]:
                    print(f"FAILED {engine.name} {folder} {schema_name}: {error}")

    print(f"\n{args.streams} streams, at most {args.tokens} tokens each; per-token times are per stream, medians\n")
    header = (f"{'tokenizer':<24} {'vocab':>6} {'engine':<10} {'tok-info ms':>11} {'schema':<11} {'compile ms':>10} "
              f"{'matcher ms':>10} {'1st fill us':>11} {'fill us':>8} {'apply us':>8} {'total us':>8} "
              f"{'tokens':>6} {'done/unfin/fail':>15}")
    print(header)
    print("-" * len(header))
    for folder, vocab, engine_name, info_ms, schema_name, r in rows:
        outcome = f"{r['finished']}/{r['unfinished']}/{r['failed']}"
        print(f"{folder[-24:]:<24} {vocab:>6} {engine_name:<10} {info_ms:>11.1f} {schema_name:<11} "
              f"{r['compile_ms']:>10.2f} {r['matcher_ms']:>10.3f} {r['first_fill_us']:>11.1f} {r['fill_us']:>8.1f} "
              f"{r['apply_us']:>8.1f} {r['total_us']:>8.1f} {r['tokens']:>6} {outcome:>15}")
    if any(r["failed"] for *_, r in rows):
        raise SystemExit("some outputs failed")


if __name__ == "__main__":
    main()
