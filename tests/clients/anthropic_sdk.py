"""The official `anthropic` client on its default paths against /v1/messages: messages.create, messages.stream, and
a tool loop (a forced tool_use, its tool_result sent back, then the answer with the tool still offered).
max_tokens is the client's one required argument."""

from __future__ import annotations

import anthropic
from common import ASK, BASE, KEY, MODEL, WEATHER_ASK, Weather, check, run, until_text, weather

client = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0)
TOOL = {"name": "weather", "description": "The weather in a city", "input_schema": Weather.model_json_schema()}


@check
def create():
    def answer():
        message = client.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": ASK}])
        assert message.type == "message" and message.role == "assistant", message
        assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0, message
        assert all(block.type == "text" for block in message.content), message
        return "".join(block.text for block in message.content)

    until_text(answer)


@check
def stream():
    def answer():
        with client.messages.stream(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": ASK}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert "".join(block.text for block in final.content) == text, (text, final)
        assert final.stop_reason in ("end_turn", "max_tokens"), final
        return text

    until_text(answer)


@check
def tool_loop():
    messages = [{"role": "user", "content": WEATHER_ASK}]
    first = client.messages.create(model=MODEL, max_tokens=128, messages=messages, tools=[TOOL],
                                   tool_choice={"type": "tool", "name": "weather"})
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "weather", first
    arguments = Weather.model_validate(uses[0].input)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": weather(**arguments.model_dump())}]}]
    def answer():
        final = client.messages.create(model=MODEL, max_tokens=64, messages=messages, tools=[TOOL])
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use"), final
        return final.content

    until_text(answer)


if __name__ == "__main__":
    run()
