"""langchain-openai's ChatOpenAI on its default paths: invoke, stream, `with_structured_output` (its default
method), `bind_tools` with a forced and an automatic call and the tool loop LangChain's docs show (the call run, its
ToolMessage fed back), and the Responses API (`use_responses_api=True`) invoked and streamed.

A forced call sets parallel_tool_calls false (see openai_sdk.py)."""

from __future__ import annotations

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
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

llm = ChatOpenAI(model=MODEL, base_url=OPENAI_URL, api_key=KEY, max_retries=0)


@tool("weather", args_schema=Weather)  # bounded arguments: the grammar-forced call ends quickly
def weather_tool(city: str, unit: str) -> str:
    """The weather in a city ("celsius" or "fahrenheit")."""
    return weather(city, unit)


@check
def invoke():
    def answer():
        answer = llm.invoke(ASK)
        assert isinstance(answer, AIMessage) and isinstance(answer.content, str), answer
        assert answer.usage_metadata["output_tokens"] > 0, answer
        assert answer.response_metadata["finish_reason"] in ("stop", "length"), answer
        return answer.content

    until_text(answer)


@check
def stream():
    def answer():
        chunks = list(llm.stream(ASK))
        assert [c.response_metadata.get("finish_reason") for c in chunks if c.response_metadata.get(
            "finish_reason")] in (["stop"], ["length"]), chunks[-3:]
        return "".join(c.content for c in chunks)

    until_text(answer)


@check
def structured_output():
    is_speaker(llm.with_structured_output(Speaker).invoke(ASK))


@check
def structured_output_include_raw():
    out = llm.with_structured_output(Speaker, include_raw=True).invoke(ASK)
    assert out["parsing_error"] is None, out
    is_speaker(out["parsed"])


@check
def tool_loop():
    bound = llm.bind_tools([weather_tool], tool_choice="weather")
    messages = [HumanMessage(WEATHER_ASK)]
    first = bound.invoke(messages)
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["name"] == "weather", first
    assert set(first.tool_calls[0]["args"]) == {"city", "unit"}, first
    messages.append(first)
    for call in first.tool_calls:
        result = weather_tool.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"], result
        messages.append(result)
    until_text(lambda: (lambda final: final.content or final.tool_calls)(  # automatic: text, or calls of the tool
        llm.bind_tools([weather_tool]).invoke(messages)))


@check
def tool_required():
    bound = llm.bind_tools([weather_tool], tool_choice="any", parallel_tool_calls=False)
    answer = bound.invoke(WEATHER_ASK)
    assert [c["name"] for c in answer.tool_calls] == ["weather"], answer


@check
def tool_stream():
    chunks = list(llm.bind_tools([weather_tool], tool_choice="weather").stream(WEATHER_ASK))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert [c["name"] for c in whole.tool_calls] == ["weather"], whole
    assert set(whole.tool_calls[0]["args"]) == {"city", "unit"}, whole


@check
def responses_api():
    responses = ChatOpenAI(model=MODEL, base_url=OPENAI_URL, api_key=KEY, max_retries=0, use_responses_api=True)
    until_text(lambda: responses.invoke(ASK).text)
    until_text(lambda: "".join(c.text for c in responses.stream(ASK)))
    is_speaker(responses.with_structured_output(Speaker).invoke(ASK))


if __name__ == "__main__":
    run()
