"""Rows of instruction data as tokens and a learn mask: chats rendered with the tokenizer's chat template (the one
`dstool serve` renders prompts with), learned on the assistant's turns only; prompt-completion pairs learned on the
completion (and its EOS)."""

from __future__ import annotations

import json
from pathlib import Path

from dstool.errors import UsageError

# The layout `dstool serve` uses for a tokenizer without a chat template (serve/triton_models/llm.py default_layout),
# as a template, each assistant turn closed by EOS so the model learns to stop.
DEFAULT_TEMPLATE = (
    "{%- if tools %}{{ 'SYSTEM:\\nYou may call these tools, each call written as <tool_call>{\"name\": NAME, "
    "\"arguments\": {...}}</tool_call>:\\n' }}{% for t in tools %}"
    "{{ (t.function if t.function is defined else t) | tojson }}{{ '' if loop.last else '\\n' }}{% endfor %}"
    "{{ '\\n\\n' }}{% endif %}"
    "{%- for m in messages %}{{ (m.name or m.role) | upper }}{{ ':\\n' }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}"
    "{%- if m.role == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ 'ASSISTANT:\\n' }}{% endif %}"
)


def set_template(tokenizer, template: str | None, needed: bool) -> None:
    """Give the tokenizer `template` (`default`, or a Jinja file); without one it keeps its own, which a chat data
    set needs."""
    if template == "default":
        tokenizer.chat_template = DEFAULT_TEMPLATE
    elif template is not None:
        path = Path(template)
        if not path.is_file():
            raise UsageError(f"--chat-template {template}: no such file (pass a Jinja template file or 'default')")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    if needed and not tokenizer.chat_template:
        raise UsageError("--data-format chat needs a chat template and this tokenizer has none: add --chat-template "
                         "default (the ROLE: layout `dstool serve` uses) or --chat-template FILE.jinja")


def encode(row: dict, data_format: str, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(token ids, learn mask) of one row."""
    if data_format == "chat":  # a CSV cell holds them as JSON text
        return _chat(_json(row["messages"]), _json(row.get("tools")), tokenizer, where)
    prompt, completion = row["prompt"], row["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise UsageError(f"{where}: prompt and completion must be text (conversational prompt-completion rows: "
                         "use --data-format chat with messages)")
    # tokenized together, with the special tokens `dstool serve` adds to a prompt: the completion's tokens are those
    # that start in it
    enc = tokenizer(prompt + completion, return_offsets_mapping=True)
    learn = [int(start >= len(prompt) and end > start) for start, end in enc["offset_mapping"]]
    return enc["input_ids"] + [tokenizer.eos_token_id], learn + [1]


def _json(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _chat(messages, tools, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """The whole chat rendered once (with the row's tools, when it has them); each assistant turn's span is where the
    rendering up to it (generation prompt added) ends and the rendering with it ends, tokens starting inside those
    spans learned."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content", ""), str) or m.get("content") is None and m.get("tool_calls"))
            for m in messages):
        raise UsageError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects (content "
                         "text, or null beside tool_calls)")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UsageError(f"{where}: tools must be a list of tool objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f"{where}: the chat has no assistant turn, so nothing to learn: drop the row or add the "
                         "assistant's answer")
    messages = [{k: ("" if k == "content" and v is None else v) for k, v in m.items()
                 if v is not None or k == "content"} for m in messages]
    extra = {"tools": tools} if tools else {}

    def render(upto: int, prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt,
                                                 **extra)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, a jinja error, a template's own check
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"{where}: the chat template refuses this chat ({said[:200]}): fix the row or pass "
                             "--chat-template") from None

    full = render(len(messages), False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(i, True), render(i + 1, False)
        if full.startswith(after) and after.startswith(before):
            spans.append((len(before), len(after)))
    if not spans:
        raise UsageError(f"{where}: the chat template renders no assistant turn as a continuation of the chat before "
                         "it, so dstool cannot find the tokens to learn: use --chat-template")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    learn = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], learn
