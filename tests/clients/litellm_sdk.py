"""litellm as an SDK on its default path for an OpenAI-compatible server (`openai/MODEL` with api_base): completion,
streaming, a pydantic response_format, a forced tool call fed back, async completion, and `litellm.responses`."""

from __future__ import annotations

import asyncio
import json

import litellm
from common import (
    ASK,
    KEY,
    MODEL,
    OPENAI_URL,
    WEATHER_ASK,
    Speaker,
    Weather,
    check,
    is_speaker,
    run,
    until_text,
    weather,
)

ARGS = {"model": f"openai/{MODEL}", "api_base": OPENAI_URL, "api_key": KEY}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": Weather.model_json_schema()}}


@check
def completion():
    def answer():
        answer = litellm.completion(messages=[{"role": "user", "content": ASK}], **ARGS)
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens > 0, answer
        return answer.choices[0].message.content

    until_text(answer)


@check
def streaming():
    def answer():
        chunks = list(litellm.completion(messages=[{"role": "user", "content": ASK}], stream=True, **ARGS))
        assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks), chunks[-3:]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    until_text(answer)


@check
def structured():
    answer = litellm.completion(messages=[{"role": "user", "content": ASK}], response_format=Speaker, **ARGS)
    is_speaker(json.loads(answer.choices[0].message.content))


@check
def tool_loop():
    messages = [{"role": "user", "content": WEATHER_ASK}]
    first = litellm.completion(messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                               **ARGS)
    calls = first.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "weather", first
    arguments = Weather.model_validate_json(calls[0].function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": weather(**arguments.model_dump())}]
    until_text(lambda: (lambda message: message.content or message.tool_calls)(
        litellm.completion(messages=messages, tools=[TOOL], **ARGS).choices[0].message))


@check
def async_completion():
    async def main():
        return await litellm.acompletion(messages=[{"role": "user", "content": ASK}], **ARGS)

    until_text(lambda: asyncio.run(main()).choices[0].message.content)


@check
def responses():
    answer = litellm.responses(input=ASK, **ARGS)
    assert answer.output and any(item.type == "message" for item in answer.output), answer


if __name__ == "__main__":
    run()
