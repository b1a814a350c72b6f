#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q
