#!/usr/bin/env bash
# A whole node, every GPU one rank: the process groups of the node's layouts built and warmed by
# bulkhead-doctor, the NCCL fault tests, the MoE bench at ep = every GPU, and the checkpoint bench
# on every GPU with a resharding load onto half of them. Layouts for 8 GPUs: (tp 8), (tp 4, dp 2),
# (tp 2, ep 4), (ep 8), (tp 2, pp 2, ep 2); on 4 GPUs each is halved.
#   bench/run_node_bench.sh STAGE [build-dir] [out-dir]
#   STAGE: doctor | faults | moe | ckpt | all   (one stage fits a 10-minute slot)
# Writes out-dir/node_<stage>_<N>gpu.md (default out-dir: bench/results).
set -uo pipefail
stage=${1:?usage: run_node_bench.sh doctor|faults|moe|ckpt|all [build-dir] [out-dir]}
build=${2:-build}
outdir=${3:-bench/results}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 4 ] || { echo "run_node_bench.sh needs 4 or 8 GPUs (found ${gpus:-0})" >&2; exit 77; }
mkdir -p "$outdir"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
header() { echo "# $1, $gpus x $device"; echo; echo "Command: \`bench/run_node_bench.sh $stage $build $outdir\`, $(date -u +%Y-%m-%d)."; echo; }

doctor() {
  local layouts
  if [ "$gpus" -ge 8 ]; then
    layouts=("--tp 8" "--tp 4" "--tp 2 --ep 4" "--ep 8" "--tp 2 --pp 2 --ep 2")
  else
    layouts=("--tp 4" "--tp 2" "--tp 2 --ep 2" "--ep 4" "--tp 2 --pp 2 --ep 2")
  fi
  header "bulkhead-doctor: every group of each layout built, warmed and checked with NCCL"
  for layout in "${layouts[@]}"; do
    local log start seconds code
    log=$(mktemp)
    start=$(date +%s.%N)
    timeout 300 mpirun --oversubscribe -np "$gpus" "$build/bin/bulkhead-doctor" $layout --backend nccl --deadline 60 \
      >"$log" 2>&1
    code=$?
    seconds=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
    echo "## $layout (exit $code, $seconds s for the whole job)"
    echo
    echo '```'
    grep -v -E '^\[bulkhead .* INFO store\]' "$log"
    echo '```'
    echo
    rm -f "$log"
  done
}

faults() {
  header "NCCL fault tests on $gpus ranks"
  echo "| test | outcome |"
  echo "|---|---|"
  local variant action strict line
  for variant in "skip 0" "mismatch-op 0" "mismatch-size 0" "delay:5 0" "exit 0" "mismatch-size 1"; do
    read -r action strict <<<"$variant"
    line=$(bash tests/runtime/fault_injection_test.sh "$gpus" "$action" "$strict" "$build/bin/bulkhead_fault_injection" \
      mpirun nccl 2>&1 | grep -E '^(PASS|FAIL|job exited|rank 0)' | tr '\n' ' ')
    echo "| inject $action, strict $strict, $gpus ranks | $line |"
  done
  for mode in init collective unwaited connect; do
    line=$(NP=$gpus bash tests/runtime/gpu_fault_test.sh "$mode" "$build/bin/bulkhead_gpu_fault" mpirun 2>&1 |
      grep -E '^(PASS|FAIL|job exited)' | tr '\n' ' ')
    echo "| gpu_fault $mode, $gpus ranks | $line |"
  done
}

moe() {
  NP=$gpus bash bench/run_moe_bench.sh "$build" "$outdir/node_moe_${gpus}gpu.md.tmp" 4096 16384 >/dev/null
  { header "MoE layer at ep $gpus"; cat "$outdir/node_moe_${gpus}gpu.md.tmp"; }
  rm -f "$outdir/node_moe_${gpus}gpu.md.tmp"
}

ckpt() {
  NP=$gpus RESHARD_NP=$((gpus / 2)) ITERS=3 bash bench/run_ckpt_bench.sh "$build" "${TMPDIR:-/tmp}/bulkhead-node-ckpt" \
    "$outdir/node_ckpt_${gpus}gpu.md.tmp" >/dev/null
  { header "Checkpoints on $gpus ranks, and a resharding load onto $((gpus / 2))"; cat "$outdir/node_ckpt_${gpus}gpu.md.tmp"; }
  rm -f "$outdir/node_ckpt_${gpus}gpu.md.tmp"
}

run() { "$1" | tee "$outdir/node_$1_${gpus}gpu.md"; }
case $stage in
  doctor | faults | moe | ckpt) run "$stage" ;;
  all) for s in doctor faults moe ckpt; do run "$s"; done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
