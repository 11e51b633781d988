#!/usr/bin/env bash
# Every figure the pages mark as waiting for a GPU, taken on the GPU node you have (a g4dn's T4 first: the pages'
# T4 figures are estimates until this has run there). In the kit's folder, inside the course's container:
#
#   bash benchmarks/gpu_node.sh [OUT]      # about 40 minutes on a g4dn.2xlarge (8 vCPUs, one T4)
#
# It writes, each named after the GPU (e.g. tesla-t4), into OUT (default benchmarks/results/, which the pages read):
#   gpu_peak-GPU.json        the ceiling: ResNet-18 and -50 at 224 px on data already on the GPU (AMP as the kit)
#   student_job-GPU.json     ImageNet-like JPEGs (real size) through the kit on a quarter, half and all of the
#                            node's vCPUs: images/s per vCPU, the feed check's verdict of each run, nvJPEG, and DALI
#                            where it is importable (the NGC container has it)
#   imagenet_input-GPU.json  the CPU input path per core on this node's CPU, against the course's loader
# and the gpu-marked tests' log beside them (gpu_node-GPU-tests.txt). Commit the files from a clean tree: the
# JSONs name the commit they measured (a tree with changes is refused), and the pages quote only such files.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
command -v nvidia-smi >/dev/null || { echo "gpu_node.sh: no nvidia-smi here: run it on a GPU node" >&2; exit 2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr '[:upper:]' '[:lower:]' | tr -cs '[:lower:][:digit:]' '-' | sed 's/-$//')
cpus=$(nproc)
quarter=$(( cpus / 4 > 0 ? cpus / 4 : 1 )); half=$(( cpus / 2 > 0 ? cpus / 2 : 1 ))
cores=$(printf '%s\n' "$quarter" "$half" "$cpus" | sort -nu | paste -sd, -)
out="${1:-benchmarks/results}"
mkdir -p "$out"
echo "gpu_node.sh: $gpu, $cpus vCPUs; the kit's runs on $cores of them"
status=0
python -m pytest -m gpu -rs --continue-on-collection-errors > "$out/gpu_node-$gpu-tests.txt" 2>&1 || status=1
python benchmarks/gpu_peak.py --out "$out/gpu_peak-$gpu.json" || status=1
python benchmarks/student_job.py --cores "$cores" --loaders workers,nvjpeg,dali --out "$out/student_job-$gpu.json" || status=1
python benchmarks/imagenet_input.py --out "$out/imagenet_input-$gpu.json" || status=1
echo "gpu_node.sh: done (exit $status); the files are in $out/*-$gpu.json"
exit $status
