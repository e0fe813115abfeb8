#!/usr/bin/env bash
# Time to build and warm every group: Bulkhead vs PyTorch, same GPUs, same
# groups, one command. Alternates the two three times and reports medians.
#   bench/run_groups_bench.sh [build-dir] [out-file] [layout flags, default --tp 2 --ep 2]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/groups_$(date +%Y%m%d).md}
shift 2 || true
flags=${*:---tp 2 --ep 2}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
ranks=$(nvidia-smi -L | grep -c '^GPU')
groups=$(mktemp)
ours=() theirs=()
for round in 1 2 3; do
  ours+=("$(mpirun --oversubscribe -np "$ranks" "$build/bin/bulkhead-groups-bench" $flags --groups-out "$groups" 2>&1 |
    awk '/BULKHEAD_TOTAL_MS/ {print $2}')")
  theirs+=("$(MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + round)) mpirun --oversubscribe -np "$ranks" \
    python3 bench/torch_groups.py "$groups" 2>&1 | awk '/TORCH_TOTAL_MS/ {print $2}')")
done
median() { printf '%s\n' "$@" | sort -n | sed -n 2p; }
b=$(median "${ours[@]}") t=$(median "${theirs[@]}")
{
  echo "# Building and warming every group: Bulkhead vs PyTorch"
  echo
  echo "Command: \`bench/run_groups_bench.sh $build $out $flags\` ($ranks GPUs: $(nvidia-smi -L | head -1 | cut -d'(' -f1))."
  echo "From process start (after imports) to every group built and warmed (1 MiB collective on each group of the rank,"
  echo "all-to-all on ep), median of 3 alternating runs; Bulkhead's figure includes MPI_Init and its rendezvous store."
  echo
  echo "| | runs (ms) | median ms |"
  echo "|---|---|---:|"
  echo "| Bulkhead | ${ours[*]} | $b |"
  echo "| PyTorch | ${theirs[*]} | $t |"
  echo
  echo "Bulkhead / PyTorch: $(awk -v b="$b" -v t="$t" 'BEGIN { printf "%.2f", b / t }')"
} | tee "$out"
rm -f "$groups"
