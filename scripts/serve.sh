#!/usr/bin/env bash
# Set up a fresh machine and serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec flexpage serve "$@"
