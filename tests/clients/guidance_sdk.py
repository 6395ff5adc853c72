"""guidance 0.3 on its default path for an OpenAI-compatible server: `guidance.models.OpenAI(MODEL, api_key=...,
base_url=...)` (its keyword arguments go to `openai.OpenAI`) with chat blocks: `gen()` of text (with and without
max_tokens, sent as max_completion_tokens), two turns (the first answer sent back as an assistant message), and
`guidance.json` with a pydantic model or a JSON schema (sent as `response_format` json_schema, strict). Every call
guidance's OpenAI backend makes is a stream (`stream_options.include_usage`) asking `logprobs` with `top_logprobs` 5
(and `tools: null`).

guidance's OpenAI backend itself refuses the rest of its grammar before any request: `select`, `gen(regex=...)` and
`regex` (UnsupportedNodeError / "Regex not yet supported for OpenAI"), `gen(stop=...)` ("Stop condition not yet
supported for OpenAI"): `grammar_refused_by_the_backend` holds that. Those need guidance's own engine over the
model's logits (a local model), not a server."""

from __future__ import annotations

import json

import guidance
from common import ASK, KEY, MODEL, OPENAI_URL, Speaker, check, is_speaker, run, until_text
from guidance import assistant, gen, models, select, user

lm = models.OpenAI(MODEL, api_key=KEY, base_url=OPENAI_URL, max_retries=0)


def asked():
    out = lm
    with user():
        out += ASK
    return out


@check
def gen_text():
    def answer():
        out = asked()
        with assistant():
            out += gen("answer", max_tokens=32)
        assert isinstance(out["answer"], str), out
        assert out._get_usage().input_tokens > 0, out._get_usage()
        return out["answer"]

    until_text(answer)


@check
def gen_default():
    def answer():
        out = asked()
        with assistant():
            out += gen("answer")
        return out["answer"]

    until_text(answer)


@check
def two_turns():
    out = asked()
    with assistant():
        out += gen("first", max_tokens=16)
    with user():
        out += "And then?"
    with assistant():
        out += gen("second", max_tokens=16)
    assert isinstance(out["first"], str) and isinstance(out["second"], str), out


@check
def json_pydantic():
    out = asked()
    with assistant():
        out += guidance.json("speaker", schema=Speaker)
    is_speaker(json.loads(out["speaker"]))


@check
def json_schema():
    out = asked()
    with assistant():
        out += guidance.json("speaker", schema=Speaker.model_json_schema())
    is_speaker(json.loads(out["speaker"]))


@check
def grammar_refused_by_the_backend():
    for grammar, said in ((select(["calm", "angry", "merry"], name="mood"), "SelectNode"),
                          (gen("mood", regex="calm|angry|merry"), "Regex not yet supported"),
                          (gen("line", stop="."), "Stop condition not yet supported")):
        out = asked()
        try:
            with assistant():
                out += grammar
        except Exception as e:  # noqa: BLE001 - whichever the backend raises, its words are checked
            assert said in f"{type(e).__name__}: {e}", repr(e)
        else:
            raise AssertionError(f"guidance's OpenAI backend ran {grammar!r}")


if __name__ == "__main__":
    run()
