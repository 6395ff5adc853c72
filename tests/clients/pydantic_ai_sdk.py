"""pydantic-ai on its default paths: `Agent("openai:MODEL")` with OPENAI_BASE_URL / OPENAI_API_KEY set (the
Responses model, pydantic-ai's default for `openai:`) and `openai-chat:MODEL` (the chat completions model, as its docs
point OpenAI-compatible servers): a text answer (run, and streamed), its default structured output (an output tool
the model must call), and a tool loop with a plain tool.

The tool loop sets parallel_tool_calls false (see openai_sdk.py)."""

from __future__ import annotations

import asyncio
import os

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

os.environ.update(OPENAI_BASE_URL=OPENAI_URL, OPENAI_API_KEY=KEY)

from pydantic_ai import Agent, ModelResponse, ModelSettings, UnexpectedModelBehavior, capture_run_messages  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.output import DEFAULT_OUTPUT_TOOL_NAME as OUTPUT_TOOL  # noqa: E402

KINDS = ("openai", "openai-chat")
ONE_CALL = ModelSettings(parallel_tool_calls=False)


def each_kind(fn):
    """The check once with each model kind; the first failure says which."""
    def both():
        for kind in KINDS:
            try:
                fn(f"{kind}:{MODEL}")
            except BaseException as e:
                raise AssertionError(f"{kind}: {e!r}") from e
    both.__name__ = fn.__name__
    return both


@check
@each_kind
def run_text(model):
    def answer():
        with capture_run_messages() as messages:
            try:
                result = Agent(model, instructions="Answer briefly.").run_sync(ASK)
            except UnexpectedModelBehavior:  # pydantic-ai asks once more after an empty answer, then gives up
                if all(not r.text for r in messages if isinstance(r, ModelResponse)):
                    return ""
                raise
        assert isinstance(result.output, str) and result.usage.output_tokens > 0, result
        return result.output

    until_text(answer)


@check
@each_kind
def run_stream(model):
    async def main():
        async with Agent(model).run_stream(ASK) as result:
            return [text async for text in result.stream_output(debounce_by=None)]

    until_text(lambda: asyncio.run(main())[-1])


@check
@each_kind
def structured_output(model):
    result = Agent(model, output_type=Speaker, model_settings=ONE_CALL).run_sync(ASK)
    assert isinstance(result.output, Speaker), result
    is_speaker(result.output)


@check
@each_kind
def tool_loop(model):
    called: list[Weather] = []

    class WeatherFirst(AbstractCapability):
        """The tool forced on the first step only (pydantic-ai's way: a capability's per-step settings)."""

        def get_model_settings(self):
            # then the output tool: the model would otherwise be free to call get_weather until the context is full
            return lambda ctx: ModelSettings(tool_choice=["get_weather"] if ctx.run_step == 1 else [OUTPUT_TOOL])

    agent = Agent(model, output_type=Speaker, model_settings=ONE_CALL, capabilities=[WeatherFirst()])

    @agent.tool_plain
    def get_weather(arguments: Weather) -> str:
        """The weather in a city."""
        called.append(arguments)
        return weather(arguments.city, arguments.unit)

    result = agent.run_sync(WEATHER_ASK)
    is_speaker(result.output)
    assert len(called) == 1 and isinstance(called[0], Weather), called
    parts = [part for message in result.all_messages() for part in message.parts]
    returns = [p.content for p in parts if p.part_kind == "tool-return" and p.tool_name == "get_weather"]
    assert returns == [weather(c.city, c.unit) for c in called], parts


if __name__ == "__main__":
    run()
