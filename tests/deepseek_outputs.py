"""Recorded DeepSeek answers and the fields each should read as: shared by tests/test_deepseek.py and
scripts/deepseek_parsers_vs_vllm.py (which runs vLLM's parsers on the same texts). Plain data, no dstool imports:
the script loads it by path from vLLM's virtual environment too."""

from __future__ import annotations

# OpenAI tool definitions (the test reads them with dstool's read_tools)
TOOL_SPECS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_call(name: str, arguments: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{arguments}\n```{CE}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CB}{name}{SEP}{arguments}{CE}"


# (answer, reasoning, content) under deepseek_r1: R1's answers begin inside the thinking its template opened
# (`<think>\n`)
REASONING = [
    ("Okay, the user asks for the capital of France.\nThat is Paris.\n</think>\n\nThe capital of France is Paris.",
     "Okay, the user asks for the capital of France.\nThat is Paris.\n", "\n\nThe capital of France is Paris."),
    ("<think>\nHmm, 2 + 3.\n</think>\n\n5", "\nHmm, 2 + 3.\n", "\n\n5"),
    ("Still thinking, cut by max_tokens: 巴黎 — schön", "Still thinking, cut by max_tokens: 巴黎 — schön", None),
    ("The answer is done.</think>", "The answer is done.", None),
    ('</think>{"city":"Paris"}', None, '{"city":"Paris"}'),
    ("I think < is less than; </thin is not a tag.</think>Yes: a < b.", "I think < is less than; </thin is not a tag.",
     "Yes: a < b."),
]

# (parser, answer, content, [(name, arguments)]) under tool_choice auto
CALLS = [
    ("deepseek_v3", "Let me look that up." + B + v3_call("get_weather", '{"city": "Paris"}') + "\n" +
     v3_call("get_weather", '{"city": "Rome", "unit": "celsius"}') + E,
     "Let me look that up.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome", "unit": '
                                                                                    '"celsius"}')]),
    ("deepseek_v3", B + v3_call("add", '{"a": 2, "b": 3}') + E, None, [("add", '{"a": 2, "b": 3}')]),
    ("deepseek_v3", "No tool is needed: it is 5.", "No tool is needed: it is 5.", []),
    ("deepseek_v31", B + v31_call("get_weather", '{"city": "Paris"}') + v31_call("add", '{"a": 2, "b": 3}') + E,
     None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 2, "b": 3}')]),
    ("deepseek_v31", "Checking.\n\n" + B + v31_call("get_weather", '{"city":"Zürich","unit":"celsius"}') + E,
     "Checking.\n\n", [("get_weather", '{"city":"Zürich","unit":"celsius"}')]),
]

# deepseek_r1 thinking, then a V3 call: (answer, reasoning, content, calls), content as streamed (a whole answer's
# whitespace-only content beside its calls is None, as vLLM's)
R1_THEN_CALL = ("The user wants Paris's weather: I call get_weather.\n</think>\n\n" + B +
                v3_call("get_weather", '{"city": "Paris"}') + E,
                "The user wants Paris's weather: I call get_weather.\n", "\n\n", [("get_weather", '{"city": "Paris"}')])

# Where dstool reads on purpose differently from vLLM: (name, parser, answer, parallel_tool_calls, content,
# calls) as dstool reads them
DIFFERENCES = [
    ("unknown tool", "deepseek_v3", B + v3_call("get_time", "{}") + E, True, v3_call("get_time", "{}"), []),
    ("arguments no object, text after the calls", "deepseek_v31", B + v31_call("add", "[1, 2]") + E + " done", True,
     v31_call("add", "[1, 2]") + " done", []),
    ("V3 arguments over lines", "deepseek_v3", B + v3_call("add", '{\n  "a": 2,\n  "b": 3\n}') + E, True, None,
     [("add", '{\n  "a": 2,\n  "b": 3\n}')]),
    ("parallel_tool_calls false", "deepseek_v31", B + v31_call("add", '{"a": 1}') + v31_call("add", '{"a": 2}') + E,
     False, v31_call("add", '{"a": 2}'), [("add", '{"a": 1}')]),
]
