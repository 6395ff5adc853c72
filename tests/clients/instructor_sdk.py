"""instructor on its default paths: `instructor.from_openai(OpenAI(...))` (mode TOOLS: a forced tool call) with a
response_model, `create_partial` streamed, `create_iterable`, and the Responses API's mode RESPONSES_TOOLS
(`client.responses.create` with a response_model).

instructor's TOOLS mode sends a named tool_choice (one call's arguments as its grammar); parallel tool calls are not
asked for."""

from __future__ import annotations

import instructor
import openai
from common import ASK, KEY, MODEL, OPENAI_URL, Speaker, check, is_speaker, run

client = instructor.from_openai(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0))


@check
def tools_mode():
    assert client.mode == instructor.Mode.TOOLS, client.mode
    speaker, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Speaker, messages=[{"role": "user", "content": ASK}], max_retries=0)
    is_speaker(speaker)
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "Speaker", completion


@check
def partial_stream():
    partials = list(client.chat.completions.create_partial(
        model=MODEL, response_model=Speaker, messages=[{"role": "user", "content": ASK}], max_retries=0))
    assert len(partials) > 1, partials  # it came in pieces
    is_speaker(partials[-1])


@check
def responses_tools_mode():
    responses = instructor.from_openai(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0),
                                       mode=instructor.Mode.RESPONSES_TOOLS)
    speaker = responses.responses.create(model=MODEL, response_model=Speaker, max_retries=0,
                                         input=[{"role": "user", "content": ASK}])
    is_speaker(speaker)


@check
def json_schema_mode():
    structured = instructor.from_openai(openai.OpenAI(base_url=OPENAI_URL, api_key=KEY, max_retries=0),
                                        mode=instructor.Mode.JSON_SCHEMA)
    is_speaker(structured.chat.completions.create(model=MODEL, response_model=Speaker, max_retries=0,
                                                  messages=[{"role": "user", "content": ASK}]))


if __name__ == "__main__":
    run()
