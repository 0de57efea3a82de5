#!/usr/bin/env bash
# Set up .venv (if needed) and run the demo: detect this CPU, explain, prepare and run a layer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m moe_dispatch.demo "$@"
