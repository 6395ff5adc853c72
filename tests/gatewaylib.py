"""What the gateway tests share: small python-backend models of our own (echo, slow, failing, decoupled
streaming), a redis-server started per test, and the gateway in its own process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dstool.proc import free_port

from conftest import DSTOOL

MODELS = Path(__file__).with_name("models")
REDIS_SERVER = shutil.which("redis-server")
API_GATEWAY = ("import json, sys; from dstool import log; from dstool.serve.gateway import GatewayConfig, run_gateway; "
               "log.setup(); sys.exit(run_gateway(GatewayConfig(**json.loads(sys.argv[1]))))")

# name -> (python file, [(input, type, dims, optional)], [(output, type, dims)], decoupled)
TEST_MODELS = {
    "echo_fp32": ("echo.py", [("INPUT0", mc.TYPE_FP32, [-1], False)], [("INPUT0_OUT", mc.TYPE_FP32, [-1])], False),
    "echo_joined": ("echo.py", [("INPUT0", mc.TYPE_FP32, [-1], False)], [("INPUT0_OUT", mc.TYPE_FP32, [-1])],
                    False),  # used by one test only: its inference count is that test's own
    "echo_int32": ("echo.py", [("INPUT0", mc.TYPE_INT32, [-1], False)], [("INPUT0_OUT", mc.TYPE_INT32, [-1])], False),
    "echo_bytes": ("echo.py", [("INPUT0", mc.TYPE_STRING, [-1], False)], [("INPUT0_OUT", mc.TYPE_STRING, [-1])], False),
    "echo_pair": ("echo.py", [("INPUT0", mc.TYPE_FP32, [-1], False), ("INPUT1", mc.TYPE_INT64, [-1], False)],
                  [("INPUT0_OUT", mc.TYPE_FP32, [-1]), ("INPUT1_OUT", mc.TYPE_INT64, [-1])], False),
    "scaled": ("scaled.py", [("INPUT0", mc.TYPE_FP32, [-1], False)], [("INPUT0_OUT", mc.TYPE_FP32, [-1])], False),
    "params": ("params.py", [("INPUT0", mc.TYPE_FP32, [-1], False)], [("PARAMS", mc.TYPE_STRING, [1])], False),
    "stream": ("stream.py", [("text_input", mc.TYPE_STRING, [1], False), ("count", mc.TYPE_INT32, [1], True)],
               [("text_output", mc.TYPE_STRING, [1])], True),
    # shaped like the models of Triton's client examples (batched [16] tensors; a sequence model)
    "simple": ("addsub.py", [("INPUT0", mc.TYPE_INT32, [16], False), ("INPUT1", mc.TYPE_INT32, [16], False)],
               [("OUTPUT0", mc.TYPE_INT32, [16]), ("OUTPUT1", mc.TYPE_INT32, [16])], False),
    "simple_string": ("addsub.py", [("INPUT0", mc.TYPE_STRING, [16], False), ("INPUT1", mc.TYPE_STRING, [16], False)],
                      [("OUTPUT0", mc.TYPE_STRING, [16]), ("OUTPUT1", mc.TYPE_STRING, [16])], False),
    "simple_sequence": ("accumulate.py", [("INPUT", mc.TYPE_INT32, [1], False)], [("OUTPUT", mc.TYPE_INT32, [1])],
                        False),
}
BATCHED = {"simple": 8, "simple_string": 8}


def write_test_models(repository: Path) -> list[str]:
    """The test models into `repository` (configs built as Triton's ModelConfig messages); their names."""
    for name, (source, inputs, outputs, decoupled) in TEST_MODELS.items():
        cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=BATCHED.get(name, 0))
        for n, t, d, optional in inputs:
            cfg.input.add(name=n, data_type=t, dims=d, optional=optional)
        for n, t, d in outputs:
            cfg.output.add(name=n, data_type=t, dims=d)
        cfg.instance_group.add(count=2 if name in ("echo_fp32", "simple_sequence") else 1,
                               kind=mc.ModelInstanceGroup.KIND_CPU)  # two sequences at once: two slots
        if decoupled:
            cfg.model_transaction_policy.decoupled = True
        if name == "simple_sequence":
            cfg.sequence_batching.max_sequence_idle_microseconds = 60_000_000
            control = cfg.sequence_batching.control_input.add(name="START").control.add(
                kind=mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START)
            control.int32_false_true.extend([0, 1])
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(MODELS / source, repository / name / "1" / "model.py")
        (repository / name / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    return list(TEST_MODELS)


class RedisServer:
    def __init__(self, workdir: Path, password: str | None = None, tls: bool = False):
        if REDIS_SERVER is None:
            pytest.fail("redis-server is not installed: run `bash scripts/setup.sh` (or apt-get install redis-server)")
        self.port, self.workdir, self.password, self.tls = free_port(), workdir, password, tls
        workdir.mkdir(parents=True, exist_ok=True)
        if tls:  # a self-signed certificate for 127.0.0.1
            if shutil.which("openssl") is None:
                pytest.fail("openssl is not installed: apt-get install openssl")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
                            str(workdir / "key.pem"), "-out", str(workdir / "cert.pem")], check=True,
                           capture_output=True)
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.workdir / 'cert.pem'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        extra = ["--requirepass", self.password] if self.password else []
        if self.tls:
            extra += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.workdir / "cert.pem"),
                      "--tls-key-file", str(self.workdir / "key.pem"), "--tls-ca-cert-file",
                      str(self.workdir / "cert.pem"), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir), *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class RedisClusterServers:
    """A real Redis Cluster on loopback: `masters` masters, each with one replica (redis-server
    --cluster-enabled yes, joined by redis-cli --cluster create), failing over within about a second."""

    def __init__(self, workdir: Path, masters: int = 3):
        if REDIS_SERVER is None or shutil.which("redis-cli") is None:
            pytest.fail("redis-server/redis-cli are not installed: run `bash scripts/setup.sh` (or apt-get install "
                        "redis-server)")
        self.workdir = workdir
        self.ports = [free_port(also=(10000,)) for _ in range(2 * masters)]  # and each one's bus port
        self.procs: dict[int, subprocess.Popen] = {}
        for port in self.ports:
            folder = workdir / str(port)
            folder.mkdir(parents=True, exist_ok=True)
            self.procs[port] = subprocess.Popen(
                [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000", "--save", "",
                 "--repl-diskless-sync-delay", "0",
                 "--appendonly", "no", "--dir", str(folder), "--logfile", str(folder / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for port in self.ports:
                wait_for(lambda port=port: self.cli(port, "ping") == "PONG", f"redis-server on port {port}")
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            wait_for(self.healthy, "the cluster to agree on its slots", 30)
            wait_for(self.replicated, "every replica to copy its master", 30)
        except BaseException:
            self.stop()  # no server left behind by a cluster that did not form
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    @staticmethod
    def cli(port: int, *args: str) -> str:
        done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def healthy(self) -> bool:
        return all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in self.alive())

    def replicated(self) -> bool:
        roles = [self.cli(p, "info", "replication") for p in self.alive()]
        return all("master_link_status:up" in r for r in roles if "role:slave" in r) and \
            sum("role:slave" in r for r in roles) == len(self.ports) // 2

    def masters(self) -> list[int]:
        return [p for p in self.alive() if "role:master" in self.cli(p, "info", "replication")]

    def keys_per_master(self) -> dict[int, int]:
        return {p: int(self.cli(p, "dbsize")) for p in self.masters()}

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


class GatewayProcess:
    """`dstool gateway` (argv) or the Python API (config dict) in its own process."""

    def __init__(self, log: Path, argv: list[str] | None = None, config: dict | None = None):
        self.http_port, self.grpc_port = free_port(), free_port()
        if argv is not None:
            cmd = [*DSTOOL, "gateway", *argv, "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        else:
            cmd = [sys.executable, "-c", API_GATEWAY,
                   json.dumps({**(config or {}), "http_port": self.http_port, "grpc_port": self.grpc_port})]
        self.log = log
        self.out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.time() + 60
        while "ready" not in log.read_text():
            assert self.proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.05)

    http_url = property(lambda self: f"127.0.0.1:{self.http_port}")
    grpc_url = property(lambda self: f"127.0.0.1:{self.grpc_port}")

    def metrics_text(self) -> str:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    def metric(self, name: str, **labels) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                got = line[len(name):].split(" ")[0].strip("{}")
                if all(part in got.split(",") for part in want.split(",") if part):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        self.out.close()
        return self.proc.returncode


def decoded_body(headers: dict, body: bytes):
    """An HTTP answer's content, to compare two servers' answers: decompressed, then (JSON header, binary rest)
    for the binary tensor extension, JSON, or the bytes as they are (Triton writes BYTES unchanged, also when
    they are not UTF-8)."""
    import zlib

    encoding = headers.get("content-encoding")
    if encoding:
        body = zlib.decompress(body, 31 if encoding == "gzip" else 15)
    length = headers.get("inference-header-content-length")
    if length is not None:
        n = int(length)
        return json.loads(body[:n]), body[n:]
    try:
        return json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return body


def wait_for(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def eventually(read, until, seconds: float = 30.0):
    """read() again until until(what it returned) holds, for up to `seconds`: for a state the server reaches in its
    own time (usage charged in the background, a flag set by a health check), which a test waits for rather than
    sleeping a guess of its time. The deadline is a net against a hang, not a timing bound. Returns the last value
    read, for the caller to assert on, so that a failure shows what was read."""
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)
