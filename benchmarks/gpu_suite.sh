#!/usr/bin/env bash
# The GPU suite in one command: the tests marked `gpu` (nccl, AMP bf16/fp16 + scaler, channels_last, the
# CUDA memory loader, DALI GPU decoding, NVML, DataParallel with 2+ GPUs), then the training throughput
# against the GPU's peak. The test log and the GPU's name go into one folder, the figures to benchmarks/results/
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]        # default: gpu-figures/<YYYYmmdd-HHMMSS>
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${1:-gpu-figures/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.csv" 2>&1
# --continue-on-collection-errors: a GPU machine without the notebook tools (nbformat, papermill) cannot import
# test modules that hold no gpu test; the gpu tests in the others still run
python -m pytest -m gpu -v -rs --continue-on-collection-errors 2>&1 | tee "$out/gpu-tests.txt"
tests=${PIPESTATUS[0]}
python benchmarks/gpu_peak.py   # writes benchmarks/results/gpu_peak.json, which docs/benchmarks.md quotes
peak=$?
echo "figures in $out (tests exit $tests, benchmark exit $peak)"
[ "$tests" -eq 0 ] && [ "$peak" -eq 0 ]
