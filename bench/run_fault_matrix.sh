#!/usr/bin/env bash
# The GPU fault matrix (tests/runtime/gpu_fault_matrix.sh) on every GPU and on
# 2 of them, with the time to diagnosis and to exit of each case, as a
# results file.
# usage: bench/run_fault_matrix.sh <build dir> <results.md> [gpu counts, default "all 2"]
set -u
build=$1 results=$2 counts=${3:-all 2}
cd "$(dirname "$0")/.."
cases=("mpirun stop 2 a2a" "store stop 0 rs" "mpirun kill 1 rs" "store kill 3 a2a" "mpirun stop 1 ckpt"
  "store kill 0 ckpt" "mpirun stop 0 a2a" "store stop 3 ckpt")
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 2 ] || { echo "SKIPPED: needs 2 GPUs or more (found ${gpus:-0})"; exit 77; }
mpirun=$(command -v mpirun)
rows=() failed=0
for count in $counts; do
  [ "$count" = all ] && count=$gpus
  visible=$(seq -s, 0 $((count - 1)))
  for c in "${cases[@]}"; do
    # shellcheck disable=SC2086
    log=$(CUDA_VISIBLE_DEVICES=$visible bash tests/runtime/gpu_fault_matrix.sh $c "$build/bin" "$mpirun" 2>&1)
    code=$?
    echo "$log" | grep -v '^RESULT'
    row=$(echo "$log" | grep '^RESULT' | sed 's/^RESULT //')
    if [ "$code" -ne 0 ] || [ -z "$row" ]; then
      failed=1
      # shellcheck disable=SC2086
      set -- $c
      row="| $1 | $2 | $3 | $4 | $count | FAIL | | | |"
    fi
    rows+=("$row")
  done
done
{
  echo "# The GPU fault matrix"
  echo
  echo "Command: \`bench/run_fault_matrix.sh $build $results \"$counts\"\`"
  echo "Machine: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $gpus, $(nproc) cores"
  echo "Date: $(date -u +%Y-%m-%d), commit ${BULKHEAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  echo
  echo "train_moe in bf16 (ep 2, 2 layers, hidden 256, 8 experts), checkpoints every 5 steps;"
  echo "BULKHEAD_COLLECTIVE_TIMEOUT=3, BULKHEAD_SHUTDOWN_TIMEOUT=3, BULKHEAD_ABORT_GRACE=1: a survivor must"
  echo "name the culprit within 3 + 2 = 5 s of the fault and exit with code 3 within 3 + 1 + 2 = 6 s of its error."
  echo "Times in seconds from the fault (the victim seen stopped or gone); the continued rank's from its SIGCONT."
  echo
  echo "| launch | fault | rank | moment | ranks | last survivor names it | last survivor exits | stopped rank exits after SIGCONT | resumed from step |"
  echo "|---|---|---:|---|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
} >"$results"
cat "$results"
exit $failed
