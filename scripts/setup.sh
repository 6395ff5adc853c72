#!/usr/bin/env bash
# Create .venv (once) and install dstool into it. torch is installed first, pinned, so that no
# dependency resolves a bare `torch` to a multi-GB CUDA build; DeepSpeed's C++ ops are built
# just-in-time only when a run needs them (DS_BUILD_OPS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q --disable-pip-version-check "torch==${DSTOOL_TORCH:-2.13.0}"
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==$torch_version" > .venv/constraints.txt
DS_BUILD_OPS=0 .venv/bin/pip install -q --disable-pip-version-check -e ".[all,dev]" -c .venv/constraints.txt
# The cache gateway's tests start their own redis-server (Debian's package) on a free port.
if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -qq redis-server || { apt-get update -qq && apt-get install -y -qq redis-server; }; } >/dev/null \
    || echo "warning: apt-get could not install redis-server; the gateway tests need it" >&2
fi
# dstool batch runs Apache Spark, which needs a Java runtime (17 or newer).
if ! command -v java >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -qq openjdk-17-jre-headless || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }; } \
    >/dev/null || echo "warning: apt-get could not install Java 17; dstool batch and its tests need it" >&2
fi
# The multi-host tests (tests/test_multihost.py, scripts/netns-cluster.sh) make hosts of network namespaces, each
# with its own sshd; the DeepSpeed launcher reaches them with pdsh (the script's `fault drop` uses iptables). A real
# Prometheus scrapes a training run in tests/test_train_observe.py.
missing=""
for tool in ip sshd ssh pdsh iptables prometheus; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || missing=yes
done
if [ -n "$missing" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  pkgs="iproute2 openssh-server openssh-client pdsh iptables prometheus"
  # shellcheck disable=SC2086
  { apt-get install -y -qq $pkgs || { apt-get update -qq && apt-get install -y -qq $pkgs; }; } >/dev/null \
    || echo "warning: apt-get could not install $pkgs; the multi-host and observability tests need them" >&2
fi
# lm-evaluation-harness in a venv of its own (its pins are not .venv's): tests/test_completions.py scores the served
# model with it; cached, so a second run only checks it.
bash "$(dirname "$0")/lm-eval-venv.sh" >/dev/null
# The client libraries the compatibility tests run against the gateway (tests/test_client_ecosystem.py), each group in
# a venv of its own under .venv-clients/ (their pins conflict); a no-op once made.
bash "$(dirname "$0")/client-venvs.sh"
echo "dstool installed in .venv (torch $torch_version)"
