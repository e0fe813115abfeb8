#!/usr/bin/env bash
# Runs a GPU test suite with one rank per GPU (every GPU, up to 8). Skipped (exit 77)
# with a clear message where no GPU is present.
# usage: run_gpu_tests.sh <program> <mpirun>
set -u
program=$1 mpirun=$2
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 1 ]; then
  echo "SKIPPED: no GPU on this machine (nvidia-smi lists none); the GPU tests run on the device machine"
  exit 77
fi
ranks=$((gpus < 8 ? gpus : 8))
exec "$mpirun" --oversubscribe -np "$ranks" "$program"
