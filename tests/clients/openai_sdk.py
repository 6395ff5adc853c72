"""The official `openai` client on its default paths: chat (whole, streamed), `chat.completions.parse` with a
pydantic model, `chat.completions.stream` of one, tools (forced and automatic) with a tool loop, and Responses
(whole, streamed, `responses.parse`, a function tool fed back).

A forced `required` call sets parallel_tool_calls false: its grammar is a list of calls, and the served model (a
tiny one, writing nonsense) rarely closes a list, so it would write calls until the context is full."""

from __future__ import annotations

import json

import openai
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

client = openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0)
TOOL = openai.pydantic_function_tool(Weather, name="weather")


@check
def chat_plain():
    def answer():
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}])
        assert answer.choices[0].finish_reason in ("stop", "length"), answer
        assert answer.usage.completion_tokens > 0 and answer.model == MODEL, answer
        return answer.choices[0].message.content

    until_text(answer)


@check
def chat_stream():
    def answer():
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-3:]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    until_text(answer)


@check
def chat_parse():
    answer = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                           response_format=Speaker)
    is_speaker(answer.choices[0].message.parsed)


@check
def chat_stream_parse():
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                        response_format=Speaker) as stream:
        final = stream.get_final_completion()
    is_speaker(final.choices[0].message.parsed)


@check
def chat_tool_loop():
    """Forced: the call parses under the tool's schema; its result goes back as a tool message and the model
    answers (automatic, tools still offered)."""
    messages = [{"role": "user", "content": WEATHER_ASK}]
    answer = client.chat.completions.parse(model=MODEL, messages=messages, tools=[TOOL], tool_choice="required",
                                       parallel_tool_calls=False)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls, answer
    call = message.tool_calls[0]
    assert call.function.name == "weather" and isinstance(call.function.parsed_arguments, Weather), call
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": weather(**json.loads(call.function.arguments))})

    def answer():
        final = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL])
        choice = final.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls"), final
        return choice.message.content or choice.message.tool_calls

    until_text(answer)


@check
def chat_named_tool_streamed():
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": WEATHER_ASK}], tools=[TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "weather", chunks
    Weather.model_validate_json("".join(d.function.arguments or "" for d in deltas))


@check
def responses_plain():
    def answer():
        answer = client.responses.create(model=MODEL, input=ASK)
        assert answer.status in ("completed", "incomplete"), answer
        return answer.output_text

    until_text(answer)


@check
def responses_stream():
    def answer():
        events = list(client.responses.create(model=MODEL, input=ASK, stream=True))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text, (text, events[-1])
        return text

    until_text(answer)


@check
def responses_parse():
    answer = client.responses.parse(model=MODEL, input=ASK, text_format=Speaker)
    is_speaker(answer.output_parsed)


@check
def responses_stream_parse():
    """`responses.stream(...).get_final_response()` with a text_format (issue 41: it raised on the 16-token cut)."""
    with client.responses.stream(model=MODEL, input=ASK, text_format=Speaker) as stream:
        final = stream.get_final_response()
    assert final.status == "completed", final
    is_speaker(final.output_parsed)


@check
def responses_tool_loop():
    tool = {"type": "function", "name": "weather", "parameters": Weather.model_json_schema(), "strict": False}
    first = client.responses.create(model=MODEL, input=WEATHER_ASK, tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "weather", first
    arguments = Weather.model_validate_json(calls[0].arguments)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[tool], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": weather(**arguments.model_dump())}])
    assert second.previous_response_id == first.id and second.output, second


@check
def models_list():
    assert MODEL in [m.id for m in client.models.list()]


if __name__ == "__main__":
    run()
