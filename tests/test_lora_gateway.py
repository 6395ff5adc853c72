"""Multi-LoRA serving through the gateway, against a stand-in NAME_llm (tests/models/lora_llm.py: NAME_llm's adapter
control requests and its `adapter` parameter) on a real Triton, Redis and gateway processes: picking an adapter by
`model` (BASE:ADAPTER or a bare ADAPTER) on the OpenAI, Responses and Anthropic routes with the official clients,
the 404s, /v1/models, vLLM's load/unload routes (admin only), tenant keys given adapters, the cache keyed by each
adapter's sha256, and a second gateway replica learning of a load. Then the same routes on the real exported model
with two adapters (conftest's `lora_repo`): each adapter's answer is NAME_llm's own for it."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import dstool
from gatewaylib import MODELS, GatewayProcess, RedisServer

INTERVAL = 0.5  # --version-check-interval of the gateways here
ADMIN = "admin-t0ken"


def write_fake_llm(repository: Path, name: str, roots: Path) -> None:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    for n, t, d in (("text_input", mc.TYPE_STRING, [1]), ("messages", mc.TYPE_STRING, [1]),
                    ("input_ids", mc.TYPE_INT64, [-1]), ("max_new_tokens", mc.TYPE_INT32, [1]),
                    ("stop_token_ids", mc.TYPE_INT64, [-1]), ("stream", mc.TYPE_BOOL, [1])):
        cfg.input.add(name=n, data_type=t, dims=d, optional=True)
    for n, t, d in (("text_output", mc.TYPE_STRING, [1]), ("output_ids", mc.TYPE_INT64, [-1]),
                    ("prompt_tokens", mc.TYPE_INT32, [1])):
        cfg.output.add(name=n, data_type=t, dims=d)
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    cfg.model_transaction_policy.decoupled = True
    cfg.parameters["max_positions"].string_value = "64"
    cfg.parameters["adapter_roots"].string_value = str(roots)
    (repository / name / "1").mkdir(parents=True)
    shutil.copy2(MODELS / "lora_llm.py", repository / name / "1" / "model.py")
    (repository / name / "config.pbtxt").write_text(text_format.MessageToString(cfg))


def write_adapter(folder: Path, weights: bytes, rank: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


ADAPTERS: dict[str, str] = {}  # name -> the folder of the adapters written for these tests


@pytest.fixture(scope="module")
def fake_repo(session_tmp) -> Path:
    repo, roots = session_tmp / "fake_lora_repository", session_tmp / "fake_lora_adapters"
    for name in ("fam_llm", "other_llm"):
        write_fake_llm(repo, name, roots)
    for name, weights in (("french", b"one"), ("pirate", b"two"), ("french2", b"three"), ("shared", b"four")):
        ADAPTERS[name] = str(write_adapter(roots / name, weights))
    (roots / "empty").mkdir()
    ADAPTERS["empty"] = str(roots / "empty")
    return repo


@pytest.fixture(scope="module")
def fake_triton(fake_repo, session_tmp):
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    srv = triton.start(fake_repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "fake-lora-triton.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lora_redis(session_tmp):
    r = RedisServer(session_tmp / "redis-lora")
    yield r
    r.stop()


def gateway(srv, redis, log: Path, **config) -> GatewayProcess:
    return GatewayProcess(log, config={"upstreams": [srv.http_url], "upstreams_grpc": [srv.grpc_url],
                                       "cache": redis.url, "version_check_interval": INTERVAL, **config})


@pytest.fixture(scope="module")
def gw(fake_triton, lora_redis, session_tmp):
    g = gateway(fake_triton, lora_redis, session_tmp / "gateway-lora.log")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def replica(fake_triton, lora_redis, session_tmp):
    g = gateway(fake_triton, lora_redis, session_tmp / "gateway-lora-replica.log")
    yield g
    g.stop()


def call(g: GatewayProcess, method: str, path: str, body=None, key: str | None = None,
         headers: dict | None = None) -> tuple[int, str, object]:
    """(status, content type, JSON body or text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", g.http_port, timeout=30)
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body if isinstance(body, (bytes, str)) or body is None else json.dumps(body), sent)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    kind = r.getheader("Content-Type") or ""
    return r.status, kind, json.loads(raw) if kind.startswith("application/json") else raw.decode()


def load(g, name: str, path: str, key: str | None = None, **more):
    return call(g, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **more}, key)


def unload(g, name: str, key: str | None = None, **more):
    return call(g, "POST", "/v1/unload_lora_adapter", {"lora_name": name, **more}, key)


def chat(g, model: str, key: str | None = None, content: str = "hi") -> tuple[int, object]:
    status, _, body = call(g, "POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}]}, key)
    return status, body


def text(body) -> str:
    return body["choices"][0]["message"]["content"]


def test_load_list_use_and_unload_with_the_openai_client(gw, fake_repo):
    import openai

    assert load(gw, "french", ADAPTERS["french"], base_model_name="fam") == \
        (200, "text/plain; charset=utf-8", "Success: LoRA adapter 'french' added successfully.")
    try:
        client = openai.OpenAI(base_url=f"http://{gw.http_url}/v1", api_key="-")
        models = {m.id: m for m in client.models.list().data}
        assert {"fam", "other", "french"} <= set(models)
        assert models["french"].model_extra == {"root": ADAPTERS["french"], "parent": "fam"}
        assert client.models.retrieve("fam:french").id == "french"
        for model in ("french", "fam:french"):  # bare (one base holds it) or BASE:ADAPTER
            answer = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": "bonjour"}])
            assert answer.choices[0].message.content.startswith("[french "), answer
            assert answer.model == model
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="french", max_tokens=4, temperature=0.5, stream=True, messages=[{"role": "user", "content": "s"}])
            if c.choices)
        assert streamed.startswith("[french ") and streamed.endswith(" ok")
        completion = client.completions.create(model="fam:french", prompt="x", max_tokens=4, temperature=0)
        assert completion.choices[0].text.startswith("[french ")
        response = client.responses.create(model="french", input="bonjour", max_output_tokens=4, temperature=0)
        assert response.output_text.startswith("[french ")
        base = client.chat.completions.create(model="fam", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "bonjour"}])
        assert base.choices[0].message.content.startswith("[base - ")
        for missing in ("fam:nope", "nope", "other:french"):
            with pytest.raises(openai.NotFoundError) as e:
                client.chat.completions.create(model=missing, max_tokens=4,
                                               messages=[{"role": "user", "content": "x"}])
            assert e.value.code == "model_not_found" and e.value.param == "model", e.value.body
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("fam:nope")
    finally:
        assert unload(gw, "french")[0] == 200
    status, body = chat(gw, "french")
    assert status == 404 and body["error"]["code"] == "model_not_found"  # unloaded: the gateway knows at once
    assert "french" not in {m["id"] for m in call(gw, "GET", "/v1/models")[2]["data"]}


def test_the_anthropic_route_picks_adapters_and_says_not_found_its_way(gw):
    import anthropic

    assert load(gw, "pirate", ADAPTERS["pirate"], base_model_name="fam")[0] == 200
    try:
        client = anthropic.Anthropic(base_url=f"http://{gw.http_url}", api_key="-")
        message = client.messages.create(model="pirate", max_tokens=4, messages=[{"role": "user", "content": "ahoy"}])
        assert message.content[0].text.startswith("[pirate ")
        with pytest.raises(anthropic.NotFoundError) as e:
            client.messages.create(model="fam:nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "not_found_error"
        assert {client.models.retrieve(m).id for m in ("pirate", "fam:pirate")} == {"pirate"}  # as the OpenAI route
        with pytest.raises(anthropic.NotFoundError):
            client.models.retrieve("fam:nope")
    finally:
        unload(gw, "pirate")


def test_admin_routes_validate_before_triton_and_pass_its_refusals(gw):
    assert load(gw, "x", ADAPTERS["french"])[0] == 400  # two bases served: which one?
    status, _, body = load(gw, "bad/name", ADAPTERS["french"], base_model_name="fam")
    assert status == 400 and "'lora_name' must be an adapter's name" in body["error"]["message"]
    for bad in ({"lora_name": "a"}, {"lora_name": "a", "lora_path": ""}, {"lora_name": "a", "lora_path": 3},
                {"lora_name": "a", "lora_path": "p", "extra": 1}, [1]):
        assert call(gw, "POST", "/v1/load_lora_adapter", bad)[0] == 400, bad
    assert call(gw, "POST", "/v1/load_lora_adapter", b"{not json")[0] == 400
    assert call(gw, "GET", "/v1/load_lora_adapter")[0] == 405
    status, _, body = load(gw, "etc", "/etc", base_model_name="fam")  # NAME_llm's refusal, as it words it
    assert status == 400 and "outside the model repository" in body["error"]["message"]
    status, _, body = load(gw, "empty", ADAPTERS["empty"], base_model_name="fam")
    assert status == 400 and "is not a PEFT LoRA adapter folder" in body["error"]["message"]
    assert load(gw, "fam:french", ADAPTERS["french"])[0] == 200  # the base in lora_name
    try:
        status, _, body = load(gw, "french", ADAPTERS["french"], base_model_name="fam")
        assert status == 400 and "already loaded" in body["error"]["message"]
    finally:
        assert unload(gw, "fam:french")[2] == "Success: LoRA adapter 'french' removed successfully."
    status, _, body = unload(gw, "french", base_model_name="fam")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_bare_name_two_bases_hold_must_name_its_base(gw):
    for base in ("fam", "other"):
        assert load(gw, "shared", ADAPTERS["shared"], base_model_name=base)[0] == 200
    try:
        status, body = chat(gw, "shared")
        assert status == 400 and "other:shared" in body["error"]["message"] or "BASE:shared" in body["error"]["message"]
        assert text(chat(gw, "other:shared")[1]).startswith("[shared ")
        ids = {m["id"] for m in call(gw, "GET", "/v1/models")[2]["data"]}
        assert {"fam:shared", "other:shared"} <= ids and "shared" not in ids
    finally:
        unload(gw, "shared", base_model_name="fam")
        unload(gw, "shared", base_model_name="other")


def test_the_cache_keys_each_adapter_by_its_sha256(gw, fake_repo):
    assert load(gw, "french", ADAPTERS["french"], base_model_name="fam")[0] == 200
    try:
        first = text(chat(gw, "french", content="cache me")[1])
        assert text(chat(gw, "fam:french", content="cache me")[1]) == first  # a hit: the same generation
        base = text(chat(gw, "fam", content="cache me")[1])
        assert base.startswith("[base ") and base != first
        assert unload(gw, "french")[0] == 200
        assert load(gw, "french", ADAPTERS["french2"], base_model_name="fam")[0] == 200  # other weights, same name
        again = text(chat(gw, "french", content="cache me")[1])
        assert again != first and again.split()[1] != first.split()[1], (first, again)  # a new sha256, a new answer
        assert text(chat(gw, "french", content="cache me")[1]) == again
    finally:
        unload(gw, "french")


def test_a_second_replica_learns_of_a_load_and_a_reload(gw, replica):
    assert load(gw, "french", ADAPTERS["french"], base_model_name="fam")[0] == 200
    try:
        first = text(chat(replica, "french", content="replica")[1])  # a miss there: its list asked again
        assert first.startswith("[french ")
        assert unload(gw, "french")[0] == 200
        assert load(gw, "french", ADAPTERS["french2"], base_model_name="fam")[0] == 200
        time.sleep(INTERVAL * 2)
        again = text(chat(replica, "french", content="replica")[1])
        assert again.split()[1] != first.split()[1], (first, again)  # never the old weights' cached answer
    finally:
        unload(gw, "french")
    time.sleep(INTERVAL * 2)
    assert chat(replica, "french")[0] == 404


@pytest.fixture(scope="module")
def keyed(fake_triton, lora_redis, session_tmp):
    g = gateway(fake_triton, lora_redis, session_tmp / "gateway-lora-keys.log", auth="keys", token=ADMIN,
                redis_timeout=2.0)
    yield g
    g.stop()


def new_key(redis_url: str, *args: str) -> str:
    return dstool("keys", "create", "--redis", redis_url, *args).stdout.strip()


def grpc_stream(g: GatewayProcess, key: str, parameters: list[dict]) -> list[tuple]:
    """(result, error) of each request sent to fam_llm on one gRPC stream with `key`, in order, each with its own
    request parameters."""
    import queue

    import numpy as np
    from tritonclient import grpc

    answers: queue.Queue = queue.Queue()
    c = grpc.InferenceServerClient(g.grpc_url)
    c.start_stream(callback=lambda result, error: answers.put((result, error)),
                   headers={"authorization": f"Bearer {key}"})
    try:
        for i, p in enumerate(parameters):
            text = grpc.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
            c.async_stream_infer("fam_llm", [text], request_id=str(i), parameters=p or None)
        return [answers.get(timeout=60) for _ in parameters]
    finally:
        c.stop_stream()
        c.close()


def test_tenant_keys_list_adapters_as_models_of_their_own(keyed, lora_redis):
    base_only = new_key(lora_redis.url, "--tenant", "t1", "--models", "fam")
    french_only = new_key(lora_redis.url, "--tenant", "t2", "--models", "fam:french")
    admin = new_key(lora_redis.url, "--tenant", "ops", "--admin")
    status, _, body = load(keyed, "french", ADAPTERS["french"], base_model_name="fam", key=french_only)
    assert status == 403 and body["error"]["code"] == "permission_denied"
    assert load(keyed, "french", ADAPTERS["french"], base_model_name="fam", key=admin)[0] == 200
    try:
        for model in ("french", "fam:french"):
            status, body = chat(keyed, model, key=base_only)  # a key given the base is not given its adapters
            assert status == 404 and body["error"]["code"] == "model_not_found", body
            assert text(chat(keyed, model, key=french_only)[1]).startswith("[french ")
        assert chat(keyed, "fam", key=french_only)[0] == 404
        assert text(chat(keyed, "fam", key=base_only)[1]).startswith("[base ")
        assert [m["id"] for m in call(keyed, "GET", "/v1/models", key=french_only)[2]["data"]] == ["french"]
        assert [m["id"] for m in call(keyed, "GET", "/v1/models", key=base_only)[2]["data"]] == ["fam"]
        # KServe's generate extension on NAME_llm with its `adapter` parameter: the key needs the family (the
        # Triton model it names) and the adapter
        both = new_key(lora_redis.url, "--tenant", "t3", "--models", "fam,fam:french")
        body = {"text_input": "x", "adapter": "french"}
        status, _, answer = call(keyed, "POST", "/v2/models/fam_llm/generate", body, key=base_only)
        assert status == 403 and "fam:french" in answer["error"], answer
        assert call(keyed, "POST", "/v2/models/fam_llm/generate", body, key=french_only)[0] == 403
        status, _, answer = call(keyed, "POST", "/v2/models/fam_llm/generate", body, key=both)
        assert status == 200 and answer["text_output"].startswith("[french "), answer
        assert call(keyed, "POST", "/v2/models/fam_llm/generate", {"text_input": "x"}, key=both)[0] == 200
        # the same on KServe's gRPC stream (tritonclient's own): refused on the stream, the stream going on
        refused, answered = grpc_stream(keyed, base_only, [{"adapter": "french"}, {}])
        assert refused[1] is not None and "fam:french" in refused[1].message() and refused[0] is None, refused
        assert answered[1] is None and answered[0].as_numpy("text_output")[0].decode().startswith("[base ")
        (result, error), = grpc_stream(keyed, both, [{"adapter": "french"}])
        assert error is None and result.as_numpy("text_output")[0].decode().startswith("[french "), error
        assert unload(keyed, "french", key=base_only)[0] == 403
    finally:
        assert unload(keyed, "french", key=ADMIN)[0] == 200


# ---- the real exported model: `trained` with two adapters (conftest's lora_repo, lora_adapters) ----

@pytest.fixture(scope="module")
def real_gateway(lora_repo, lora_adapters, lora_redis, session_tmp):
    """A real Triton serving the exported lora_llm (a third adapter, `sql` again, in its folder to load at run time)
    behind a gateway."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    repo = session_tmp / "lora_gateway_repository"
    shutil.copytree(lora_repo / "lora_llm", repo / "lora_llm")
    shutil.copytree(lora_adapters["sql"], repo / "lora_llm" / "adapters" / "sql3")
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "lora-gateway-triton.log")
    g = gateway(srv, lora_redis, session_tmp / "gateway-lora-real.log")
    yield srv, g
    g.stop()
    srv.stop()


def triton_text(srv, prompt: str, adapter: str | None, new: int = 8) -> str:
    """NAME_llm's own greedy answer, asked of Triton directly."""
    from llmlib import post

    status, _, raw = post(srv.http_port, "/v2/models/lora_llm/generate", {
        "text_input": prompt, "max_new_tokens": new, "parameters": {"adapter": adapter} if adapter else {}})
    assert status == 200, raw
    return json.loads(raw)["text_output"]


def test_the_real_model_answers_each_adapter_through_the_openai_client(real_gateway):
    import openai

    srv, g = real_gateway
    client = openai.OpenAI(base_url=f"http://{g.http_url}/v1", api_key="-")
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert models["sql"]["parent"] == "lora" and models["chat"]["parent"] == "lora" and "lora" in models
    prompt = "ROMEO:"
    texts = {}
    for model, adapter in (("lora", None), ("sql", "sql"), ("lora:chat", "chat")):
        want = triton_text(srv, prompt, adapter)
        for _ in range(2):  # a miss, then a hit: the same
            got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert got.choices[0].text == want, (model, got.choices[0].text, want)
        texts[model] = want
    assert len(set(texts.values())) == 3, texts  # each adapter changes the answer, and the cache keeps them apart
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="lora:nope", prompt=prompt, max_tokens=8)
    assert e.value.code == "model_not_found"

    assert load(g, "sql3", "lora_llm/adapters/sql3")[2] == "Success: LoRA adapter 'sql3' added successfully."
    try:
        got = client.completions.create(model="sql3", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == texts["sql"]  # the same weights as sql
        assert models.keys() < {m.id for m in client.models.list().data}
    finally:
        assert unload(g, "sql3")[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql3", prompt=prompt, max_tokens=8)
    status, _, body = load(g, "bad", "/etc")
    assert status == 400 and "outside the model repository" in body["error"]["message"], body
