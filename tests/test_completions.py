"""/v1/completions as vLLM serves it, on the real gateway and Triton: a batch of prompts (strings or token ids),
`echo` with the prompt's logprobs (what lm-evaluation-harness's `local-completions` scores with), every prompt
counted and metered; and GET /v1/models/{id}. Clients: the official `openai` client, LangChain's `OpenAI`,
lm-evaluation-harness, raw HTTP for hostile bodies."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_openai import _greedy

from dstool.evaluation.api import lm_eval_venv
from dstool.files import sha256_file

from conftest import built_once, lm_eval_versions
from gatewaylib import GatewayProcess, RedisServer, eventually
from llmlib import error_of, post

PROMPTS = ["ROMEO:\nBut soft", "JULIET:\nO Romeo, Romeo", "KING RICHARD:\nNow is the winter"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def api(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-completions.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url], "cache": "memory"})
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def tokenizer(trained):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained)


def _client(api):
    import openai

    return openai.OpenAI(base_url=f"http://{api.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def _greedy_ids(trained, ids: list[int], new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(trained).eval().generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()


def test_a_batch_of_prompts_whole_and_streamed(api, trained):
    """Three prompts, n=2: six choices indexed prompt-major (prompt i's choice j is i * 2 + j), each the prompt's
    greedy text; usage counts every prompt's tokens once and every choice's; streamed, the chunks carry their
    choice's index and add up to the same texts and usage."""
    client = _client(api)
    expected = [_greedy(trained, p, 6) for p in PROMPTS]
    answer = client.completions.create(model="dstool_lm", prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [text for text, _, _ in expected for _ in range(2)]
    assert answer.usage.prompt_tokens == sum(p for _, p, _ in expected)
    assert answer.usage.completion_tokens == 2 * sum(len(ids) for _, _, ids in expected)

    chunks = list(client.completions.create(model="dstool_lm", prompt=PROMPTS, max_tokens=6, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_headers={"Cache-Control": "no-cache"}))
    texts = [""] * 6
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in answer.choices]
    assert sorted({c.choices[0].index for c in chunks if c.choices}) == list(range(6))
    assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_langchain_openai_batch(api, trained):
    """LangChain's OpenAI LLM: `.batch` sends its prompts as one request's list (its default path)."""
    from langchain_openai import OpenAI

    llm = OpenAI(model="dstool_lm", base_url=f"http://{api.http_url}/v1", api_key="none", max_tokens=6,
                 temperature=0, max_retries=0)
    assert llm.batch(PROMPTS) == [_greedy(trained, p, 6)[0] for p in PROMPTS]
    result = llm.generate(PROMPTS)  # the same path, its usage kept
    assert [g[0].text for g in result.generations] == [_greedy(trained, p, 6)[0] for p in PROMPTS]
    assert result.llm_output["token_usage"]["prompt_tokens"] == sum(_greedy(trained, p, 1)[1] for p in PROMPTS)


def test_token_id_prompts_reach_the_model_as_they_are(api, trained, tokenizer):
    """A prompt of token ids, and a batch of them: the model continues exactly those ids (no special token added),
    the usage counts them."""
    client = _client(api)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    ids.append(ids[0][1:] if len(ids[0]) > 2 else ids[0] + [5])  # another sequence of ids than any text's
    one = client.completions.create(model="dstool_lm", prompt=ids[0], max_tokens=5, temperature=0)
    assert one.choices[0].text == tokenizer.decode(_greedy_ids(trained, ids[0], 5), skip_special_tokens=True)
    assert one.usage.prompt_tokens == len(ids[0])
    batch = client.completions.create(model="dstool_lm", prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == [tokenizer.decode(_greedy_ids(trained, x, 5), skip_special_tokens=True)
                                               for x in ids]
    assert batch.usage.prompt_tokens == sum(len(x) for x in ids)


def test_echo_with_logprobs_is_openais_shape_with_the_models_own_numbers(api, trained, tokenizer):
    """echo + logprobs: the prompt's text before the answer's; its tokens' log-probabilities (the first null, as
    OpenAI and vLLM write it) equal transformers' log-softmax, each with its alternatives; text_offset counts from
    the prompt's start. max_tokens 0: the prompt alone. Streamed: the prompt comes first."""
    import torch
    from transformers import AutoModelForCausalLM

    client = _client(api)
    prompt = PROMPTS[0]
    ids = tokenizer(prompt)["input_ids"]
    text, _, new = _greedy(trained, prompt, 4)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(trained).eval()(torch.tensor([ids + new])).logits[0]
    expected = torch.log_softmax(logits.double(), -1)
    answer = client.completions.create(model="dstool_lm", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True)
    choice, lp = answer.choices[0], answer.choices[0].logprobs
    assert choice.text == prompt + text
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] + [tokenizer.decode([t]) for t in new]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    everything = ids + new
    assert lp.token_logprobs[1:] == pytest.approx([float(expected[i - 1, everything[i]])
                                                   for i in range(1, len(everything))], abs=1e-4)
    for i in range(1, len(everything)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 2 <= len(top) <= 3  # the two most likely, and the token itself
        assert max(top.values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(new)

    alone = client.completions.create(model="dstool_lm", prompt=prompt, max_tokens=0, temperature=0, logprobs=1,
                                      echo=True)
    assert alone.choices[0].text == prompt and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-6)
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(ids)

    chunks = list(client.completions.create(model="dstool_lm", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                            echo=True, stream=True, extra_headers={"Cache-Control": "no-cache"}))
    rows = [c.choices[0] for c in chunks if c.choices]
    assert rows[0].text == prompt and rows[0].logprobs.tokens == lp.tokens[:len(ids)]
    assert "".join(r.text for r in rows) == choice.text
    assert [t for r in rows if r.logprobs for t in r.logprobs.text_offset] == lp.text_offset

    as_ids = client.completions.create(model="dstool_lm", prompt=ids, max_tokens=0, echo=True)  # its text decoded
    assert as_ids.choices[0].text == tokenizer.decode(ids)


def test_get_a_model_by_id(api):
    client = _client(api)
    listed = {m.id: m for m in client.models.list().data}
    assert client.models.retrieve("dstool_lm") == listed["dstool_lm"]
    import openai

    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no_such_model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    for path in ("/v1/models/" + "x" * 300, "/v1/models/a%2Fb", "/v1/models/%ff", "/v1/models/a%20b"):
        conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
        conn.request("GET", path)
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 404 and body["error"]["code"] == "model_not_found", (path, body)
        assert "\n" not in body["error"]["message"] and len(body["error"]["message"]) < 300


@pytest.mark.parametrize("body, needle", [
    ({"prompt": ["x"] * 65}, "'prompt' holds 65 prompts: send at most 64"),
    ({"prompt": ["x"] * 64, "n": 5}, "320 choices: at most 256"),
    ({"prompt": [[1, [2]]]}, "'prompt[0]' must be a string or a non-empty list of token ids"),
    ({"prompt": [["a"]]}, "'prompt[0]' must be a string or a non-empty list of token ids"),
    ({"prompt": [[1, 2], "x"]}, "not both"),
    ({"prompt": [[]]}, "'prompt[0]' must be"),
    ({"prompt": []}, "'prompt' must be a string, a list of token ids"),
    ({"prompt": [1, 2**40]}, "'prompt[1]' is 1099511627776: a token id is an integer from 0"),
    ({"prompt": [[3] * 70000]}, "'prompt[0]' holds 70000 token ids"),
    ({"prompt": [[5, 6], [7, 10**6]]}, "prompt[1][1] is 1000000: not a token id of this model's vocabulary"),
    ({"prompt": [5, -1]}, "'prompt[1]' is -1"),
    ({"prompt": "x", "echo": "yes"}, "'echo' must be true or false"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer from 1")])
def test_hostile_prompts_get_one_line_400s(api, body, needle):
    status, _, raw = post(api.http_port, "/v1/completions", {"model": "dstool_lm", "max_tokens": 2, **body})
    message = error_of(raw)
    assert status == 400 and needle in message and "\n" not in message and len(message) < 400, (status, message)
    assert json.loads(raw)["error"]["param"] in ("prompt", "echo", "max_tokens", "n")


def test_every_prompt_of_a_batch_is_metered(server, session_tmp):
    """--auth keys: a tenant's batch (three prompts, n=2, whole and streamed) is charged every prompt's tokens and
    every choice's, as its usage says."""
    import openai
    from test_tenants import keys_gateway, new_key, usage_of

    redis = RedisServer(session_tmp / "redis-completions")
    gw = keys_gateway(server, redis.url, session_tmp / "gateway-completions-keys.log", redis_timeout=2.0)
    try:
        key = new_key(redis.url, "--tenant", "batcher")
        client = openai.OpenAI(base_url=f"http://{gw.http_url}/v1", api_key=key, max_retries=0, timeout=120)

        def used(requests: int) -> tuple[int, int]:
            """(prompt, completion) tokens charged, once the key's `requests` are (charges are sent every 50 ms, in
            the background, and a request's after its answer)."""
            u = eventually(lambda: usage_of(redis.url, key), lambda u: u.get("requests", 0) >= requests)
            assert u.get("requests", 0) == requests, u
            u = eventually(lambda: usage_of(redis.url, key),
                           lambda u: u.get("completion_tokens", 0) >= 18 * requests)  # each request's 18 tokens
            return u.get("prompt_tokens", 0), u.get("completion_tokens", 0)

        before = used(0)
        answer = client.completions.create(model="dstool_lm", prompt=PROMPTS, max_tokens=3, n=2, temperature=0,
                                           extra_body={"ignore_eos": True}, extra_headers={"Cache-Control": "no-cache"})
        after = used(1)
        assert answer.usage.completion_tokens == 18
        assert (after[0] - before[0], after[1] - before[1]) == (answer.usage.prompt_tokens, 18)
        chunks = list(client.completions.create(model="dstool_lm", prompt=PROMPTS, max_tokens=3, n=2, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True},
                                                extra_headers={"Cache-Control": "no-cache"}))
        streamed = used(2)
        assert (streamed[0] - after[0], streamed[1] - after[1]) == (chunks[-1].usage.prompt_tokens, 18)
    finally:
        gw.stop()
        redis.stop()


def _lm_eval(model: str, args: str, task: Path, out: Path) -> None:
    """lm-eval (its own venv) on the dstool_plays task in `task`, results and samples under `out`."""
    venv = lm_eval_venv(None)
    assert (venv / "bin" / "lm_eval").exists(), f"no lm-evaluation-harness at {venv}: scripts/setup.sh makes it " \
        "(scripts/lm-eval-venv.sh)"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(venv / "bin" / "lm_eval"), "--model", model, "--model_args", args, "--tasks",
                           "dstool_plays", "--include_path", str(task), "--output_path", str(out), "--log_samples",
                           "--batch_size", "8"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _plays_task(out: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "lm_eval_task.py"), str(out), "--docs", "24"],
                   check=True, capture_output=True)
    return out


def _scores(out: Path) -> tuple[dict, dict]:
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["dstool_plays"]
    samples = [json.loads(line) for line in next(out.rglob("samples_dstool_plays_*.jsonl")).read_text().splitlines()]
    return results, {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


@pytest.fixture(scope="module")
def hf_plays(trained, tmp_path_factory, worker_id) -> Path:
    """lm-eval's own `hf` model scoring the trained model in-process: the reference, kept between runs (keyed by
    the trained model, the task script and lm-eval's venv)."""
    def build(out: Path) -> None:
        _lm_eval("hf", f"pretrained={trained},dtype=float32", _plays_task(out / "task"), out / "hf")

    return built_once(tmp_path_factory, worker_id, "lm_eval_hf_plays", build, (),
                      (trained, sha256_file(ROOT / "scripts" / "lm_eval_task.py"), *lm_eval_versions())) / "hf"


@pytest.mark.slow
def test_lm_evaluation_harness_scores_the_served_model_as_it_scores_the_model_itself(api, trained, hf_plays,
                                                                                      tmp_path):
    """lm-evaluation-harness's `local-completions` (batches of token-id prompts, echo, max_tokens 1, logprobs 1)
    scores a multiple-choice task made from the corpus (scripts/lm_eval_task.py) on the gateway: the accuracy and
    every choice's log-likelihood are those its `hf` model computes on the trained model in-process."""
    _lm_eval("local-completions", f"model=dstool_lm,base_url=http://{api.http_url}/v1/completions,"
                                  f"tokenizer={trained},tokenizer_backend=huggingface,max_retries=1,num_concurrent=1",
             _plays_task(tmp_path / "task"), tmp_path / "served")
    (served, served_ll), (local, local_ll) = _scores(tmp_path / "served"), _scores(hf_plays)
    assert served["acc,none"] == local["acc,none"] and served["acc_norm,none"] == local["acc_norm,none"]
    assert served_ll.keys() == local_ll.keys() and len(served_ll) == 24
    for doc, lls in served_ll.items():
        assert lls == pytest.approx(local_ll[doc], abs=2e-3), doc
    print(f"lm_eval dstool_plays (24 docs): acc {served['acc,none']:.4f}, acc_norm {served['acc_norm,none']:.4f}")
