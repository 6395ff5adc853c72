"""The chat machinery's typed answer (serve/gateway/openai/answer.py) written by each frontend: OpenAI's chunks,
Anthropic's Messages events and the Responses events, each checked against that SDK's own event types, from one
stream of events and no wire format read back."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from pydantic import TypeAdapter

from dstool.serve.gateway.anthropic.messages import Writer as MessagesWriter
from dstool.serve.gateway.anthropic.messages import model_info
from dstool.serve.gateway.openai.answer import CallDelta, Delta, Event, Failed, Usage
from dstool.serve.gateway.openai.protocol import OpenAIError
from dstool.serve.gateway.openai.responses import ResponsesRequest
from dstool.serve.gateway.openai.responses import Writer as ResponsesWriter
from dstool.serve.gateway.openai.routes import sse_stream
from dstool.serve.gateway.openai.stored import _failed

USAGE = Usage({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
               "prompt_tokens_details": {"cached_tokens": 3}})
TEXT = [Delta(0, role=True), Delta(0, reasoning="let me see"), Delta(0, "Hello wor"), Delta(0, "ldEN"),
        Delta(0, "D"), Delta(0, finish_reason="stop"), USAGE]
CALL = [Delta(0, role=True), Delta(0, "Calling."), Delta(0, calls=(CallDelta(0, '{"city":', "call_1", "weather"),)),
        Delta(0, calls=(CallDelta(0, ' "Oslo"}'),)), Delta(0, finish_reason="tool_calls"), USAGE]
FAILED = [Delta(0, role=True), Delta(0, "Hel"),
          Failed(OpenAIError(500, "the model's instance stopped", kind="server_error"))]


async def _events(events: list[Event]):
    for event in events:
        yield event


def _written(stream) -> list[bytes]:
    async def drain():
        return [part async for part in stream]
    return asyncio.run(drain())


def _sse(parts: list[bytes]) -> list[dict]:
    """The JSON of each server-sent event's data line."""
    return [orjson.loads(line[len(b"data: "):]) for part in parts for line in part.split(b"\n")
            if line.startswith(b"data: {")]


def test_openai_chunks_are_the_sdks_and_end_in_done():
    from openai.types.chat import ChatCompletionChunk

    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    parts = _written(sse_stream(head, _events(CALL)))
    assert parts[-1] == b"data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(d) for d in _sse(parts)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Calling."
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert (calls[0].id, calls[0].function.name) == ("call_1", "weather")
    assert "".join(tc.function.arguments for tc in calls) == '{"city": "Oslo"}'
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3 and chunks[-2].choices[0].finish_reason == \
        "tool_calls"

    thought = _sse(_written(sse_stream(head, _events(TEXT))))[1]["choices"][0]["delta"]
    assert thought == {"reasoning_content": "let me see", "reasoning": "let me see"}

    failed = _written(sse_stream(head, _events(FAILED)))
    assert b"[DONE]" not in failed[-1] and _sse(failed)[-1]["error"]["type"] == "server_error"


@pytest.mark.parametrize("events,stops,content,reason,stop", [
    (TEXT, ["END"], [{"type": "text", "text": "Hello world"}], "stop_sequence", "END"),
    (TEXT, [], [{"type": "text", "text": "Hello worldEND"}], "end_turn", None),
    (CALL, [], [{"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}], "tool_use", None),
])
def test_anthropic_events_are_the_sdks_and_make_the_message(events, stops, content, reason, stop):
    """The events, validated as the `anthropic` SDK's RawMessageStreamEvent, put together as its stream helper does:
    the held-back stop sequence is not sent, the tool's input arrives as JSON parts."""
    from anthropic.types import RawMessageStreamEvent

    sent = _sse(_written(MessagesWriter("m", stops).events(_events(events))))
    assert [d["type"] for d in sent].count("ping") == 1 and sent[2]["type"] == "ping"
    parsed = [TypeAdapter(RawMessageStreamEvent).validate_python(d) for d in sent if d["type"] != "ping"]
    blocks: list[dict] = []
    for e in parsed:
        if e.type == "content_block_start":
            blocks.append(e.content_block.model_dump(exclude_none=True))
            blocks[-1].pop("citations", None)
            blocks[-1]["partial"] = ""
        elif e.type == "content_block_delta":
            blocks[e.index]["partial"] += e.delta.text if e.delta.type == "text_delta" else e.delta.partial_json
    for b in blocks:
        partial = b.pop("partial")
        if b["type"] == "text":
            b["text"] += partial
        else:
            b["input"] = orjson.loads(partial)
    assert blocks == content
    assert [e.type for e in parsed][:2] == ["message_start", "content_block_start"]
    end = parsed[-2]
    assert (end.type, end.delta.stop_reason, end.delta.stop_sequence) == ("message_delta", reason, stop)
    assert (end.usage.input_tokens, end.usage.cache_read_input_tokens, end.usage.output_tokens) == (4, 3, 5)
    assert parsed[-1].type == "message_stop"


def test_anthropic_stream_ending_in_an_error_says_so_in_its_shape():
    last = _sse(_written(MessagesWriter("m", []).events(_events(FAILED))))[-1]
    assert last == {"type": "error", "error": {"type": "api_error", "message": "the model's instance stopped"}}


@pytest.mark.parametrize("events,kinds,final", [
    (TEXT, ["reasoning", "message"], "completed"),
    (CALL, ["message", "function_call"], "completed"),
])
def test_responses_events_are_the_sdks_and_make_the_response(events, kinds, final):
    from openai.types.responses import ResponseStreamEvent

    request = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    writer = ResponsesWriter(request, request.chat())
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(d) for d in _sse(_written(writer.events(
        _events(events))))]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    response = parsed[-1].response
    assert (parsed[-1].type, response.status) == (f"response.{final}", final)
    assert [item.type for item in response.output] == kinds
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 5)
    deltas = "".join(e.delta for e in parsed if e.type in ("response.output_text.delta",
                                                            "response.function_call_arguments.delta"))
    if kinds[-1] == "function_call":
        call = response.output[-1]
        assert (call.call_id, call.name, call.arguments) == ("call_1", "weather", '{"city": "Oslo"}')
        assert deltas == 'Calling.{"city": "Oslo"}'
    else:
        assert response.output[0].content[0].text == "let me see" and deltas == "Hello worldEND"


def test_responses_stream_ending_in_an_error_says_so():
    request = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    last = _sse(_written(ResponsesWriter(request, request.chat()).events(_events(FAILED))))[-1]
    assert (last["type"], last["message"]) == ("error", "the model's instance stopped")


COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": "Calling.", "reasoning_content": "let me see", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}}],
    "usage": USAGE.usage}


def test_whole_answers_are_the_sdks_types():
    """The same completion written whole by each frontend validates as the SDK's own type, field for field; so does
    a model as Anthropic's models API lists it."""
    from anthropic.types import Message, ModelInfo
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    assert ChatCompletion.model_validate(COMPLETION).choices[0].message.tool_calls[0].id == "call_1"
    message = Message.model_validate(MessagesWriter("m", []).whole(COMPLETION))
    assert (message.stop_reason, [b.type for b in message.content]) == ("tool_use", ["text", "tool_use"])
    request = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    response = Response.model_validate(ResponsesWriter(request, request.chat()).whole(COMPLETION))
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.usage.input_tokens_details.cached_tokens == 3
    assert ModelInfo.model_validate(model_info("dstool_lm")).lifecycle == "active"
    writer = ResponsesWriter(request, request.chat())
    for failed in (_failed(writer, "invalid_prompt", "'input' is too long"), writer.response("queued", [])):
        assert Response.model_validate(failed).status == failed["status"]
