"""Find, prepare, start and stop a real Triton Inference Server.

Where the binary comes from, in order: --tritonserver PATH, $DSTOOL_TRITONSERVER, `tritonserver` on
PATH (the NGC image), or the one shipped inside the `nvidia-pytriton` wheel. The wheel's copy needs
a work folder holding bin/, backends/ (with the python backend stub for this interpreter) and
caches/, the venv's bin first on PATH (the stub finds numpy through `python3`), and
LD_LIBRARY_PATH = the wheel's bundled libraries + this interpreter's LIBDIR (the stub must load
the same libpython as the interpreter).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from dstool import log as dlog
from dstool.errors import EngineFailed, UsageError
from dstool.files import cache_dir, replace_folder
from dstool.proc import die_with_parent, process_stat, stop_process

log = dlog.log


@dataclass
class TritonBinary:
    executable: Path
    backend_dir: Path | None = None
    cache_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def _pytriton_root() -> Path | None:
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def _prepare_from_wheel(root: Path, work: Path) -> TritonBinary:
    """Assemble bin/, backends/ and caches/ from the wheel into `work` (once per wheel version)."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise UsageError(f"nvidia-pytriton ships no python backend stub for Python {py}")
    marker = work / ".prepared"
    if not marker.is_file():
        tmp = work.with_name(work.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for part in ("bin", "backends", "caches"):
            shutil.copytree(root / part, tmp / part, symlinks=True)
        shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        (tmp / ".prepared").write_text(str(root))
        replace_folder(tmp, work)
    libs = root.parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(libs), libdir, os.environ.get("LD_LIBRARY_PATH", ""))
                                              if p)}
    return TritonBinary(work / "bin" / "tritonserver", work / "backends", work / "caches", env)


def find_tritonserver(explicit: str | None = None) -> TritonBinary:
    """Locate a Triton server binary (see the module docstring for the order)."""
    path = explicit or os.environ.get("DSTOOL_TRITONSERVER")
    if path:
        if not Path(path).is_file():
            raise UsageError(f"tritonserver {path} does not exist")
        return TritonBinary(Path(path))
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonBinary(Path(on_path))
    root = _pytriton_root()
    if root is None:
        raise UsageError("no Triton server found: pass --tritonserver PATH, set DSTOOL_TRITONSERVER, run in the NGC "
                         "tritonserver image, or pip install nvidia-pytriton==0.7.0")
    return _prepare_from_wheel(root, cache_dir() / "tritonserver-pytriton")


SHM = Path("/dev/shm")
EXIT_TIMEOUT = 10  # Triton's --exit-timeout-secs
STUB_ABORT = "boost::interprocess::lock_exception"


@dataclass
class TritonProcess:
    """A running tritonserver; `stop()` ends it (SIGTERM, then SIGKILL after a grace period) and removes what it
    leaves behind however it ended: python-backend stub processes (its process group) and their shared-memory
    regions (named with `shm_prefix`). Its `janitor` does the same if the process that started it dies first."""

    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    shm_prefix: str = ""
    janitor: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> int:
        code = stop_process(self.proc, grace)
        self.clean_up()
        if self.janitor is not None:  # its work is done
            self.janitor.kill()
            self.janitor.wait()
        return code

    def clean_up(self) -> list[str]:
        """After Triton exited: kill what is left of its process group (it runs in a session of its own) and remove
        its shared-memory regions; returns what was removed."""
        return clean_up(self.proc.pid, self.shm_prefix)


def clean_up(group: int, shm_prefix: str) -> list[str]:
    """Kill process group `group` (an exited Triton's: its stubs) and remove the shared-memory regions named with
    `shm_prefix`; what was removed."""
    removed = []
    try:
        os.killpg(group, signal.SIGKILL)
        removed.append(f"process group {group}")
    except (ProcessLookupError, PermissionError):
        pass
    if shm_prefix and SHM.is_dir():
        for region in SHM.glob(shm_prefix + "*"):
            region.unlink(missing_ok=True)
            removed.append(str(region))
    return removed


def janitor(parent: int, triton: int, shm_prefix: str) -> None:
    """What Triton's janitor process runs: once `parent` (the process that started Triton) is gone, however it
    ended (SIGKILL, a crash), Triton has its exit timeout to stop (its parent's death sent it SIGTERM), then its
    process group is killed and its shared-memory regions removed."""
    while os.getppid() == parent:
        time.sleep(0.2)
    deadline = time.monotonic() + EXIT_TIMEOUT + 2
    while (stat := process_stat(triton)) is not None and stat[0] not in "ZX" and time.monotonic() < deadline:
        time.sleep(0.2)
    clean_up(triton, shm_prefix)


def start(repository: Path, binary: TritonBinary, http_port: int, grpc_port: int, metrics_port: int,
          log_path: Path, address: str = "127.0.0.1", cache_config: str | None = None,
          timeout: float = 120.0, extra_args: list[str] | None = None) -> TritonProcess:
    """Start tritonserver on `repository`, wait until the server and every model are ready. A start that aborts
    as a python-backend stub starts is made once more: Triton 2.51 kills a stub that is not up within 10 s (a
    loaded machine), then aborts on the lock the stub held (boost::interprocess::lock_exception)."""
    for attempt in (1, 2):
        server = _launch(repository, binary, http_port, grpc_port, metrics_port, log_path, address, cache_config,
                         extra_args)
        try:
            _wait_ready(server, timeout)
            return server
        except EngineFailed:
            aborted = server.proc.poll() == -signal.SIGABRT and STUB_ABORT in server.log_tail(40)
            server.stop()
            if attempt == 2 or not aborted:
                raise
            log.warning(f"tritonserver aborted as a python-backend stub started ({STUB_ABORT}); starting it again")
    raise AssertionError("unreachable")


def _launch(repository: Path, binary: TritonBinary, http_port: int, grpc_port: int, metrics_port: int,
            log_path: Path, address: str, cache_config: str | None, extra_args: list[str] | None) -> TritonProcess:
    cmd = [str(binary.executable), "--model-repository", str(Path(repository).resolve()),
           "--http-address", address, "--http-port", str(http_port), "--grpc-address", address,
           "--grpc-port", str(grpc_port), "--metrics-address", address, "--metrics-port", str(metrics_port),
           "--allow-gpu-metrics", "false", "--exit-timeout-secs", str(EXIT_TIMEOUT)]
    if binary.backend_dir:
        cmd += ["--backend-directory", str(binary.backend_dir)]
    if binary.cache_dir:
        cmd += ["--cache-directory", str(binary.cache_dir)]
    if cache_config:
        cmd += ["--cache-config", cache_config]
    # The python backend names its shared-memory regions with this prefix, so they can be found and removed.
    shm_prefix = f"dstool_triton_{os.getpid()}_{http_port}_"
    cmd += [f"--backend-config=python,shm-region-prefix-name={shm_prefix}", *(extra_args or [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    # Triton gets its own session, so a terminal's Ctrl-C reaches only dstool, which then stops it once,
    # gracefully (a second signal makes Triton exit at once); it still dies if dstool dies.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **binary.env},
                            start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    # It is cleaned up after even if dstool dies without stopping it: by a process of its own, in its own session.
    watch = f"from dstool.serve.runtime.triton import janitor; janitor({os.getpid()}, {proc.pid}, {shm_prefix!r})"
    janitor_proc = subprocess.Popen([sys.executable, "-c", watch], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return TritonProcess(proc, http_port, grpc_port, metrics_port, log_path, shm_prefix, janitor_proc)


def _wait_ready(server: TritonProcess, timeout: float) -> None:
    import tritonclient.http as http

    # Closed before returning: Triton's shutdown waits for every open HTTP connection, an idle keep-alive
    # included, and exits 1 when that uses up --exit-timeout-secs.
    client = http.InferenceServerClient(server.http_url)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if server.proc.poll() is not None:
                raise EngineFailed(f"tritonserver exited with code {server.proc.returncode} before it was ready; "
                                   f"last log lines: {server.log_tail(5)!r}", log=server.log_path)
            try:
                if client.is_server_ready():
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.2)
    finally:
        client.close()
    server.stop()
    raise EngineFailed(f"tritonserver was not ready after {timeout:.0f} s; last log lines: {server.log_tail(5)!r}",
                       log=server.log_path)
