#!/usr/bin/env bash
# One command for the NCCL comparison on a machine with 2 GPUs:
#   bench/run_nccl_bench.sh [build-dir] [out-file]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/nccl_$(date +%Y%m%d).md}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
mpirun --oversubscribe -np 2 "$build/bin/bulkhead-nccl-bench" --out "$out"
