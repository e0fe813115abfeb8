#!/usr/bin/env bash
# One command for the peer-memory all-reduce beside NCCL: 2 ranks, and 4 where
# the machine has 4 GPUs, one GPU each; a results file per count, and one for
# PyTorch's symmetric-memory sums where the installed PyTorch has them
# (bench/torch_symm_all_reduce.py; NVLink multicast stays off).
#   bench/run_peer_bench.sh [bin dir] [results dir]     MAX_BYTES=64M
set -euo pipefail
bin=${1:-build/bin} dir=${2:-bench/results}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 2 ] || { echo "the peer all-reduce bench needs 2 GPUs or more (found ${gpus:-0})" >&2; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
for n in 2 4; do
  [ "$gpus" -ge "$n" ] || continue
  mpirun --oversubscribe -np "$n" "$bin/bulkhead-peer-bench" --max-bytes "${MAX_BYTES:-64M}" \
    --out "$dir/peer_${gpu}x${n}_$(date +%Y-%m-%d).md"
  if python3 -c 'import torch.distributed._symmetric_memory' 2>/dev/null; then
    torchrun --nproc-per-node "$n" "$(dirname "$0")/torch_symm_all_reduce.py" --max-bytes "${MAX_BYTES:-64M}" \
      --out "$dir/peer_torch_${gpu}x${n}_$(date +%Y-%m-%d).md"
  fi
done
