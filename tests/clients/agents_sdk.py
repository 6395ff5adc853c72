"""openai-agents on its default path: the SDK's default client pointed at the gateway (`set_default_openai_client`),
its default model (Responses) by name, tracing off (it would send traces to OpenAI). An agent answers (run, and
streamed), answers as an output_type, and runs a function_tool loop: the tool forced on the first turn (the SDK
resets tool_choice after a call, by default), its result fed back, then the final answer; the same on the SDK's chat
completions model (`set_default_openai_api("chat_completions")`).

The forced call sets parallel_tool_calls false (see openai_sdk.py)."""

from __future__ import annotations

import asyncio

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from common import ASK, KEY, MODEL, OPENAI_URL, WEATHER_ASK, Speaker, check, is_speaker, run, until_text, weather
from openai import AsyncOpenAI

set_tracing_disabled(True)
CALLED: list[dict] = []


def client() -> None:
    """A new default client for each check: an AsyncOpenAI's connections belong to the event loop that opened them,
    and each Runner.run_sync / asyncio.run is a new loop."""
    set_default_openai_client(AsyncOpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0))


@function_tool
def get_weather(city: str, unit: str) -> str:
    """The weather in a city.

    Args:
        city: The city, at most 12 characters.
        unit: celsius or fahrenheit.
    """
    CALLED.append({"city": city, "unit": unit})
    return weather(city, unit)


def fresh(fn):
    def with_client():
        client()
        fn()
    with_client.__name__ = fn.__name__
    return with_client


# bounded arguments: the grammar-forced call ends quickly
get_weather.params_json_schema["properties"]["city"]["maxLength"] = 12
get_weather.params_json_schema["properties"]["unit"]["enum"] = ["celsius", "fahrenheit"]


@check
@fresh
def run_text():
    def answer():
        result = Runner.run_sync(Agent(name="bard", instructions="Answer briefly.", model=MODEL), ASK)
        assert isinstance(result.final_output, str), result
        assert result.raw_responses and result.raw_responses[0].usage.output_tokens > 0, result
        return result.final_output

    until_text(answer)


@check
@fresh
def run_streamed():
    async def main():
        result = Runner.run_streamed(Agent(name="bard", model=MODEL), ASK)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return deltas, result.final_output

    def answer():
        deltas, final = asyncio.run(main())
        assert "".join(deltas) == final, (deltas, final)
        return final

    until_text(answer)


@check
@fresh
def output_type():
    result = Runner.run_sync(Agent(name="bard", model=MODEL, output_type=Speaker), ASK)
    assert isinstance(result.final_output, Speaker), result
    is_speaker(result.final_output)


@check
@fresh
def tool_loop():
    CALLED.clear()
    agent = Agent(name="weatherman", model=MODEL, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False))
    result = Runner.run_sync(agent, WEATHER_ASK, max_turns=4)
    assert CALLED and set(CALLED[0]) == {"city", "unit"} and CALLED[0]["unit"] in ("celsius", "fahrenheit"), CALLED
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert isinstance(result.final_output, str), result


@check
@fresh
def tool_loop_with_output_type():
    CALLED.clear()
    agent = Agent(name="weatherman", model=MODEL, tools=[get_weather], output_type=Speaker,
                  model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False))
    result = Runner.run_sync(agent, WEATHER_ASK, max_turns=4)
    assert len(CALLED) >= 1, result
    is_speaker(result.final_output)


@check
@fresh
def chat_completions_api():
    """The SDK's other model, as its docs set it for servers without Responses: text, an output_type, a tool loop."""
    set_default_openai_api("chat_completions")
    try:
        until_text(lambda: Runner.run_sync(Agent(name="bard", model=MODEL), ASK).final_output)
        client()
        is_speaker(Runner.run_sync(Agent(name="bard", model=MODEL, output_type=Speaker), ASK).final_output)
        client()
        CALLED.clear()
        agent = Agent(name="weatherman", model=MODEL, tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False))
        result = Runner.run_sync(agent, WEATHER_ASK, max_turns=4)
        assert CALLED and [item.type for item in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]
    finally:
        set_default_openai_api("responses")


if __name__ == "__main__":
    run()
