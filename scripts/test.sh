#!/usr/bin/env bash
# Set up .venv (if needed) with the test extras, and .venv-vllm (vLLM's engine, for the
# plugin's end-to-end tests; x86_64 Linux only), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
scripts/setup-vllm.sh
exec .venv/bin/python -m pytest "$@"
