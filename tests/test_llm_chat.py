"""How NAME_llm lays out a chat with tools, outside Triton (the python backend's module a small fake): through the
tokenizer's chat template where it has one (the tools passed to it, as transformers does), else the default layout
that lists the tools and writes calls as <tool_call> JSON."""

from __future__ import annotations

import json
import types

import pytest

from llmlib import llm_module

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                             "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
TEMPLATE = ("{% if tools %}[TOOLS]{% for t in tools %}{{ t.function.name }};{% endfor %}[/TOOLS]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[CALL {{ c.function.name }} {{ c.function.arguments | tojson }}]"
            "{% endfor %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def model(monkeypatch, trained):
    from transformers import AutoTokenizer

    llm = llm_module(monkeypatch)
    m = llm.TritonPythonModel()
    m.tokenizer = AutoTokenizer.from_pretrained(trained)
    m.max_prompt_bytes = 1 << 20
    return llm, m


def test_the_default_layout_lists_the_tools_and_writes_calls_as_hermes_json(model):
    llm, m = model
    assert not m.tokenizer.chat_template
    prompt = m._chat_prompt(json.dumps(CHAT), TOOLS)
    assert prompt.startswith('SYSTEM:\nYou may call these tools, each call written as <tool_call>{"name": NAME, ')
    assert '{"name": "add", "parameters": {"type": "object"}}' in prompt
    assert 'ASSISTANT:\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>\n\nTOOL:\n5\n\nASSISTANT:\n' \
        in prompt
    assert not m._chat_prompt(json.dumps(CHAT[:1]), None).startswith("SYSTEM")


def test_a_chat_template_gets_the_tools_and_the_calls(model):
    llm, m = model
    m.tokenizer.chat_template = TEMPLATE
    prompt = m._chat_prompt(json.dumps(CHAT), TOOLS)
    assert prompt == ('[TOOLS]add;[/TOOLS]<user>2 + 3?</user><assistant>[CALL add {"a": 2}]</assistant>'
                      "<tool>5</tool><assistant>")


def test_tools_go_with_messages_only(model):
    llm, m = model
    read = types.SimpleNamespace(parameters=json.dumps({"tools": json.dumps(TOOLS)}), messages=None)
    with pytest.raises(llm.RequestError, match="tools go with messages"):
        m._tools(read)
    with pytest.raises(llm.RequestError, match="JSON text of a list"):
        m._tools(types.SimpleNamespace(parameters=json.dumps({"tools": "{"}), messages="[]"))


def test_a_chat_nested_too_deep_to_lay_out_is_the_clients_mistake(model, monkeypatch):
    """Arguments a thousand lists deep parse, then overflow the stack of the layout (json.dumps, a template's
    tojson) in an intake thread: a RequestError (400), not a failure of the model."""
    llm, m = model

    def too_deep(chat, tools):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")

    monkeypatch.setattr(llm, "default_layout", too_deep)
    read = types.SimpleNamespace(prompt=None, messages=json.dumps(CHAT), parameters="{}")
    with pytest.raises(llm.RequestError, match="nest too deep"):
        m._sequence(read)
