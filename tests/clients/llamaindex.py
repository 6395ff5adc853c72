"""LlamaIndex's OpenAILike on its default paths: as constructed with only model, api_base and api_key
(is_chat_model false: `complete` and `chat` go to /v1/completions) and with is_chat_model=True (/v1/chat/completions),
each whole and streamed, sync and async; and OpenAILikeResponses (/v1/responses: it always sends `tools: []`, which
issue 41 found refused)."""

from __future__ import annotations

import asyncio

from common import ASK, KEY, MODEL, OPENAI_URL, check, run, until_text
from llama_index.core.llms import ChatMessage, ChatResponse, CompletionResponse
from llama_index.llms.openai_like import OpenAILike, OpenAILikeResponses

plain = OpenAILike(model=MODEL, api_base=OPENAI_URL, api_key=KEY, max_retries=0)
chat_model = OpenAILike(model=MODEL, api_base=OPENAI_URL, api_key=KEY, max_retries=0, is_chat_model=True)
responses_model = OpenAILikeResponses(model=MODEL, api_base=OPENAI_URL, api_key=KEY, max_retries=0)
MESSAGES = [ChatMessage(role="user", content=ASK)]


@check
def complete_default():
    assert not plain.metadata.is_chat_model

    def answer():
        answer = plain.complete(ASK)
        assert isinstance(answer, CompletionResponse), answer
        assert answer.raw.object == "text_completion", answer.raw  # the legacy route, as OpenAILike defaults
        return answer.text

    until_text(answer)


@check
def stream_complete_default():
    def answer():
        pieces = list(plain.stream_complete(ASK))
        assert pieces and pieces[-1].text == "".join(p.delta for p in pieces), pieces[-3:]
        return pieces[-1].text

    until_text(answer)


@check
def chat_default():
    def answer():
        answer = plain.chat(MESSAGES)  # a completion of the messages' text, under the default is_chat_model=False
        assert isinstance(answer, ChatResponse), answer
        return answer.message.content

    until_text(answer)


@check
def chat():
    def answer():
        answer = chat_model.chat(MESSAGES)
        assert answer.raw.object == "chat.completion", answer
        return answer.message.content

    until_text(answer)


@check
def stream_chat():
    def answer():
        pieces = list(chat_model.stream_chat(MESSAGES))
        assert pieces and pieces[-1].message.content == "".join(p.delta for p in pieces), pieces[-3:]
        return pieces[-1].message.content

    until_text(answer)


@check
def complete_chat_model():
    until_text(lambda: chat_model.complete(ASK).text)


@check
def async_chat():
    async def main():
        whole = await chat_model.achat(MESSAGES)
        pieces = [p async for p in await chat_model.astream_chat(MESSAGES)]
        return whole, pieces

    def answer():
        whole, pieces = asyncio.run(main())
        return whole.message.content and pieces and pieces[-1].message.content

    until_text(answer)


@check
def responses_chat():
    until_text(lambda: responses_model.chat(MESSAGES).message.content)


@check
def responses_stream_chat():
    def answer():
        pieces = list(responses_model.stream_chat(MESSAGES))  # each piece's message holds its own delta only
        assert pieces and pieces[-1].raw.type in ("response.completed", "response.incomplete"), pieces[-3:]
        text = "".join(p.delta or "" for p in pieces)
        assert text == pieces[-1].raw.response.output_text, (text, pieces[-1].raw)
        return text

    until_text(answer)


if __name__ == "__main__":
    run()
