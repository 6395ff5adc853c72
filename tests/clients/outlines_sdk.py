"""outlines 1.3 on its default path for an OpenAI-compatible server: `outlines.from_openai(openai.OpenAI(...), MODEL)`
called with no output type (text), a pydantic model, a JSON schema (`outlines.types.JsonSchema`), `model.stream`,
an `outlines.Generator`, and the async model (`from_openai(openai.AsyncOpenAI(...))`). outlines' OpenAI model sends
a pydantic model or a JSON schema as `response_format` json_schema (strict, `additionalProperties: false` added).

A Literal (choice) output type, a regex or a grammar is refused by outlines' OpenAI model itself, before any request
(TypeError: "not available with OpenAI"): `choice_refused_by_from_openai` holds that. outlines' vLLM model
(`outlines.from_vllm(openai.OpenAI(...), MODEL)`, the same openai client) sends them as vLLM's `structured_outputs`
(choice as a regex), which the gateway serves: `choice_from_vllm` and `speaker_from_vllm` are that workaround."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import outlines
from common import ASK, KEY, MODEL, OPENAI_URL, Speaker, check, is_speaker, run, until_text
from outlines.types import JsonSchema

model = outlines.from_openai(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0), MODEL)
MOODS = Literal["calm", "angry", "merry"]


@check
def text():
    assert isinstance(model, outlines.models.OpenAI), model

    def answer():
        text = model(ASK)
        assert isinstance(text, str), text
        return text

    until_text(answer)


@check
def pydantic_output():
    is_speaker(json.loads(model(ASK, Speaker)))


@check
def json_schema_output():
    schema = JsonSchema(json.dumps(Speaker.model_json_schema()))
    is_speaker(json.loads(model(ASK, schema)))


@check
def generator():
    speak = outlines.Generator(model, Speaker)
    is_speaker(Speaker.model_validate_json(speak(ASK)))


@check
def stream_text():
    def answer():
        return "".join(model.stream(ASK, max_tokens=32))

    until_text(answer)


@check
def stream_pydantic():
    chunks = list(model.stream(ASK, Speaker))
    assert len(chunks) > 1, chunks  # it came in pieces
    is_speaker(json.loads("".join(chunks)))


@check
def async_model():
    async def main():
        async_model = outlines.from_openai(openai.AsyncOpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0),
                                           MODEL)
        assert isinstance(async_model, outlines.models.AsyncOpenAI), async_model
        return await async_model(ASK, Speaker)

    is_speaker(json.loads(asyncio.run(main())))


@check
def choice_refused_by_from_openai():
    try:
        model(ASK, MOODS)
    except TypeError as e:
        assert "not available with OpenAI" in str(e), e
    else:
        raise AssertionError("outlines' OpenAI model took a Literal output type")


@check
def choice_from_vllm():
    vllm = outlines.from_vllm(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0), MODEL)
    for _ in range(3):
        assert vllm(ASK, MOODS) in ("calm", "angry", "merry")


@check
def speaker_from_vllm():
    vllm = outlines.from_vllm(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0), MODEL)
    is_speaker(json.loads(vllm(ASK, Speaker)))


if __name__ == "__main__":
    run()
