#!/usr/bin/env bash
# A pipeline stage that goes wrong, with a 2 s deadline: every stage raises
# within the deadline plus 2 s, naming a stage and a micro-batch, and the job
# ends non-zero instead of hanging.
#   skip   stage F skips one send (BULKHEAD_FAULT, at the sequence number a probe run reads)
#   shape  stage F sends micro-batch 3 with another shape. mpi: its receiver raises
#          DesyncError naming both stages and shapes; nccl: stage F itself does, before sending
# mpi: 4 ranks, F = 1. nccl: one rank a GPU (2 to 8; skipped without 2), F = 1,
# or 0 on 2 GPUs.
# usage: pipeline_fault_test.sh skip|shape <pipeline_fault> <mpirun> [mpi|nccl]
set -u
mode=$1 program=$2 mpirun=$3 backend=${4:-mpi}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; cat "$out/log" 2>/dev/null | tail -40; for f in "$out"/rank_*.txt; do echo "--- $f"; cat "$f"; echo; done; exit 1; }

ranks=4
if [ "$backend" = nccl ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -lt 2 ]; then
    echo "SKIPPED: fewer than 2 GPUs on this machine (nvidia-smi lists ${gpus:-0}); the GPU tests run on the device machine"
    exit 77
  fi
  ranks=$((gpus < 8 ? gpus : 8))
fi
faulty=$((ranks > 2 ? 1 : 0)) receiver=$((ranks > 2 ? 2 : 1))
export BULKHEAD_BACKEND=$backend PIPELINE_FAULT_STAGE=$faulty
export BULKHEAD_COLLECTIVE_TIMEOUT=2 BULKHEAD_ABORT_GRACE=1 NCCL_NVLS_ENABLE=0
case $mode in
  skip)
    seq=$("$mpirun" --oversubscribe -np "$ranks" "$program" probe "$out" 2>"$out/probe.log" | sed -n 's/^SEND_SEQ //p')
    [ -n "$seq" ] || fail "the probe run printed no SEND_SEQ"
    export BULKHEAD_FAULT="rank=$faulty,group=pp[0],seq=$seq,action=skip" ;;
  shape) export PIPELINE_WRONG_SHAPE=1 ;;
  *) fail "unknown mode $mode" ;;
esac
start=$(date +%s.%N)
timeout 60 "$mpirun" --oversubscribe -np "$ranks" "$program" run "$out" >"$out/log" 2>&1
code=$?
elapsed=$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN { printf "%.1f", a - b }')
[ "$code" -ne 0 ] || fail "the job exited 0"
[ "$code" -ne 124 ] || fail "the job hung (killed after 60 s)"
for ((rank = 0; rank < ranks; rank++)); do
  f=$out/rank_$rank.txt
  [ -s "$f" ] || fail "rank $rank wrote no outcome"
  read -r seconds kind rest <"$f"
  echo "rank $rank: after $seconds s: $kind $rest" | cut -c1-400
  [ "$kind" != none ] || fail "rank $rank raised nothing"
  awk -v s="$seconds" 'BEGIN { exit !(s <= 4.0) }' || fail "rank $rank raised after $seconds s (deadline 2 s + 2 s)"
  grep -q "micro-batch [0-9]" "$f" && grep -q "stage [0-9]" "$f" || fail "rank $rank's error names no stage and micro-batch"
done
if [ "$mode" = shape ] && [ "$backend" = mpi ]; then
  grep -q "DesyncError.*stage 2 expected micro-batch 3's forward activations from stage 1 as .*\[5, 16\], but stage 1 sent .*\[6, 16\]" \
    "$out/rank_2.txt" || fail "stage 2 did not raise a DesyncError naming both stages and shapes"
elif [ "$mode" = shape ]; then
  grep -q "DesyncError.*stage $faulty .*would send micro-batch 3's forward activations to stage $receiver as .*\[6, 16\], but stage $receiver expects .*\[5, 16\]" \
    "$out/rank_$faulty.txt" || fail "stage $faulty did not raise a DesyncError naming both stages and shapes"
else
  grep -q "stage $faulty" "$out/rank_$receiver.txt" || fail "stage $receiver does not name stage $faulty"
fi
echo "PASS: every stage raised within 4 s; the job ended with $code after $elapsed s"
