#!/usr/bin/env bash
# Create .venv (once) and install dstool into it. torch is installed first, pinned, so that no
# dependency resolves a bare `torch` to a multi-GB CUDA build; DeepSpeed's C++ ops are built
# just-in-time only when a run needs them (DS_BUILD_OPS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
root=$([ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && echo yes || true)
apt_install() {  # apt_install WHY PKG...: Debian packages, as root only; otherwise one line saying what is missing
  local why=$1; shift
  if [ -n "$root" ]; then
    { apt-get install -y -qq "$@" || { apt-get update -qq && apt-get install -y -qq "$@"; }; } >/dev/null && return
  fi
  echo "warning: $* missing (install them as root); $why" >&2
}
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# Debian's python3 makes no venv without python3.X-venv (ensurepip); DeepSpeed's one JIT build (CPU Adam) needs a C++
# compiler and Python's headers.
"$python" -c "import ensurepip" 2>/dev/null || apt_install "no .venv can be made" "python$pyver-venv"
{ command -v g++ >/dev/null && [ -f "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; } \
  || apt_install "DeepSpeed's CPU Adam (--offload-optimizer) cannot be built" build-essential "python$pyver-dev"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch's CPU build: PyPI's plain Linux wheel is the multi-GB CUDA one. Where the configured indexes offer a +cpu build
# of the pin (a local mirror or find-links) it is used; otherwise PyTorch's CPU index (DSTOOL_TORCH_INDEX overrides).
torch_pin="torch==${DSTOOL_TORCH:-2.13.0}"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if .venv/bin/pip install -q --disable-pip-version-check --dry-run --no-deps --report - "$torch_pin" 2>/dev/null \
      | grep -q '"version": "[^"]*+cpu"'; then
    .venv/bin/pip install -q --disable-pip-version-check "$torch_pin"
  else
    .venv/bin/pip install -q --disable-pip-version-check "$torch_pin" \
      --index-url "${DSTOOL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" --extra-index-url https://pypi.org/simple
  fi
fi
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==$torch_version" > .venv/constraints.txt
# Every other package at the version the suite last passed with (scripts/lock.sh wrote the lock for this python), so
# that the registry's newer releases change nothing here; DSTOOL_UNLOCKED=1, or a python with no lock: the newest allowed.
lock="requirements/lock-py$pyver.txt"
if [ -f "$lock" ] && [ -z "${DSTOOL_UNLOCKED:-}" ]; then
  locked=(-c "$lock")
else
  locked=()
  echo "note: not locked ($lock missing or DSTOOL_UNLOCKED set): the newest versions pyproject.toml allows" >&2
fi
DS_BUILD_OPS=0 .venv/bin/pip install -q --disable-pip-version-check -e ".[all,dev]" -c .venv/constraints.txt \
  ${locked[@]+"${locked[@]}"}
# The cache gateway's tests start their own redis-server (Debian's package) on a free port.
command -v redis-server >/dev/null || apt_install "the gateway tests need it" redis-server
# Triton's python backend stub links against the interpreter's shared library (Debian: libpython3.X).
ldconfig -p 2>/dev/null | grep -q "libpython$pyver\.so\.1" \
  || [ -f "$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')/libpython$pyver.so.1.0" ] \
  || apt_install "Triton's python backend (dstool serve) cannot start" "libpython$pyver"
# dstool batch runs Apache Spark, which needs a Java runtime (17 or newer).
command -v java >/dev/null || apt_install "dstool batch and its tests need it" openjdk-17-jre-headless
# The multi-host tests (tests/test_multihost.py, scripts/netns-cluster.sh) make hosts of network namespaces, each
# with its own sshd; the DeepSpeed launcher reaches them with pdsh (the script's `fault drop` uses iptables). A real
# Prometheus scrapes a training run in tests/test_train_observe.py.
missing=""
for tool in ip sshd ssh pdsh iptables prometheus; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || missing=yes
done
[ -z "$missing" ] || apt_install "the multi-host and observability tests skip, saying so" \
  iproute2 openssh-server openssh-client pdsh iptables prometheus
# lm-evaluation-harness in a venv of its own (its pins are not .venv's): tests/test_completions.py scores the served
# model with it; cached, so a second run only checks it.
bash "$(dirname "$0")/lm-eval-venv.sh" >/dev/null
# The client libraries the compatibility tests run against the gateway (tests/test_client_ecosystem.py), each group in
# a venv of its own under the dstool cache's client-venvs/ (their pins conflict); a no-op once made on this machine.
bash "$(dirname "$0")/client-venvs.sh"
# DeepSpeed's CPU Adam (--offload-optimizer) built once now, into torch's extension cache, not inside a first run.
.venv/bin/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" \
  >/dev/null 2>&1 || echo "warning: DeepSpeed's CPU Adam did not build; --offload-optimizer will try again" >&2
echo "dstool installed in .venv (torch $torch_version)"
