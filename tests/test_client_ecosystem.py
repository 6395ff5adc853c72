"""The ecosystem's client libraries on their default paths against the gateway (issue 41): what each library sends
when its user sets nothing but the server's address, key and model — openai, langchain-openai, litellm (as an SDK),
openai-agents, pydantic-ai, anthropic, outlines, guidance, instructor and LlamaIndex's OpenAILike — over the real
Triton.

Their pins conflict, so each runs in a virtual environment of its group (scripts/client-venvs.sh makes them, under
the dstool cache's client-venvs/; this test runs the script, a no-op once they are made): the test runs a small
script of checks (tests/clients/*.py) with that environment's python, which prints one JSON line of results; every
check must pass.
The served model is tiny and writes nonsense, so structured answers use bounded schemas (short strings, enums, small
integers: a grammar-forced answer ends quickly) and the checks assert shape and validity, not content. What each
library does by default and what the tests had to set is in docs/openai-fields.md ("Clients")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstool.files import cache_dir

from gatewaylib import GatewayProcess

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).with_name("clients")
VENVS = Path(os.environ.get("DSTOOL_CLIENT_VENVS") or cache_dir() / "client-venvs")
TOKEN = "sk-dstool-clients"
# script (tests/clients/NAME.py) -> its virtual environment's group (scripts/client-venvs.sh)
SCRIPTS = {"openai_sdk": "openai", "langchain": "openai", "litellm_sdk": "openai", "agents_sdk": "openai",
           "pydantic_ai_sdk": "openai", "anthropic_sdk": "openai", "outlines_sdk": "openai", "guidance_sdk": "openai",
           "instructor_sdk": "instructor", "llamaindex": "llamaindex"}


@pytest.fixture(scope="session")
def client_venvs() -> Path:
    """The client environments, made once (scripts/client-venvs.sh: about 1.5 minutes the first time, 0.3 s after)."""
    made = subprocess.run(["bash", str(ROOT / "scripts" / "client-venvs.sh"), str(VENVS)], capture_output=True,
                          text=True, timeout=1200)  # it takes turns with other set-ups itself (a lock)
    assert made.returncode == 0, f"scripts/client-venvs.sh failed:\n{made.stdout[-3000:]}\n{made.stderr[-6000:]}"
    return VENVS


@pytest.fixture(scope="module")
def clients_gateway(server, session_tmp):
    gw = GatewayProcess(session_tmp / "gateway-clients.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": "memory", "token": TOKEN})
    yield gw
    gw.stop()


def run_script(venvs: Path, name: str, gateway_url: str, *checks: str,
               key: str = TOKEN) -> tuple[dict, subprocess.CompletedProcess]:
    """tests/clients/NAME.py run by its group's python against `gateway_url`: ({check: result}, the process)."""
    python = venvs / SCRIPTS[name] / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(DSTOOL_GATEWAY=f"http://{gateway_url}", DSTOOL_API_KEY=key, PYTHONUNBUFFERED="1",
               # what a library reads from the environment points at the gateway too, never at a vendor
               OPENAI_BASE_URL=f"http://{gateway_url}/v1", OPENAI_API_KEY=key,
               ANTHROPIC_BASE_URL=f"http://{gateway_url}", ANTHROPIC_API_KEY=key,
               LITELLM_LOCAL_MODEL_COST_MAP="True",  # litellm fetches its price list at import otherwise
               OPENAI_AGENTS_DISABLE_TRACING="1", OTEL_SDK_DISABLED="true")
    proc = subprocess.run([str(python), str(CLIENTS / f"{name}.py"), *checks], cwd=CLIENTS, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (f"{name}.py exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                                            f"\n--- stderr\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULTS "):]), proc


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_client_library_default_paths(name, client_venvs, clients_gateway):
    results, proc = run_script(client_venvs, name, clients_gateway.http_url)
    assert results, f"{name}.py ran no checks"
    failed = {check: r["error"] for check, r in results.items() if not r["ok"]}
    assert not failed, f"{name}.py: {len(failed)} of {len(results)} checks failed\n" + "\n".join(
        f"--- {check}\n{error}" for check, error in failed.items()) + f"\n--- stderr\n{proc.stderr[-3000:]}"
    print(name, {check: r["seconds"] for check, r in results.items()}, file=sys.stderr)


def test_a_failing_check_fails_the_test(client_venvs, clients_gateway):
    """The harness itself: a check that fails is reported as failed, with the library's own error (a wrong key: the
    gateway's 401 through the openai client; a port nobody listens on: no connection)."""
    results, _ = run_script(client_venvs, "openai_sdk", clients_gateway.http_url, "chat_plain", key="sk-wrong")
    assert results["chat_plain"]["ok"] is False and "AuthenticationError" in results["chat_plain"]["error"], results
    results, _ = run_script(client_venvs, "openai_sdk", "127.0.0.1:1", "models_list")
    assert results["models_list"]["ok"] is False and "APIConnectionError" in results["models_list"]["error"], results
