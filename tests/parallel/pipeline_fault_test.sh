#!/usr/bin/env bash
# A pipeline stage that goes wrong, on 4 ranks with a 2 s deadline: every stage
# raises within the deadline plus 2 s, naming a stage and a micro-batch, and
# the job ends non-zero instead of hanging.
#   skip   stage 1 skips one send (BULKHEAD_FAULT, at the sequence number a probe run reads)
#   shape  stage 1 sends micro-batch 3 with another shape: its receiver raises DesyncError naming both stages
# usage: pipeline_fault_test.sh skip|shape <pipeline_fault> <mpirun>
set -u
mode=$1 program=$2 mpirun=$3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; cat "$out/log" 2>/dev/null | tail -40; for f in "$out"/rank_*.txt; do echo "--- $f"; cat "$f"; echo; done; exit 1; }

export BULKHEAD_COLLECTIVE_TIMEOUT=2 BULKHEAD_ABORT_GRACE=1
case $mode in
  skip)
    seq=$("$mpirun" --oversubscribe -np 4 "$program" probe "$out" 2>"$out/probe.log" | sed -n 's/^SEND_SEQ //p')
    [ -n "$seq" ] || fail "the probe run printed no SEND_SEQ"
    export BULKHEAD_FAULT="rank=1,group=pp[0],seq=$seq,action=skip" ;;
  shape) export PIPELINE_WRONG_SHAPE=1 ;;
  *) fail "unknown mode $mode" ;;
esac
start=$(date +%s.%N)
timeout 60 "$mpirun" --oversubscribe -np 4 "$program" run "$out" >"$out/log" 2>&1
code=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
[ "$code" -ne 0 ] || fail "the job exited 0"
[ "$code" -ne 124 ] || fail "the job hung (killed after 60 s)"
for rank in 0 1 2 3; do
  f=$out/rank_$rank.txt
  [ -s "$f" ] || fail "rank $rank wrote no outcome"
  read -r seconds kind rest <"$f"
  echo "rank $rank: after $seconds s: $kind $rest" | cut -c1-400
  [ "$kind" != none ] || fail "rank $rank raised nothing"
  awk -v s="$seconds" 'BEGIN { exit !(s <= 4.0) }' || fail "rank $rank raised after $seconds s (deadline 2 s + 2 s)"
  grep -q "micro-batch [0-9]" "$f" && grep -q "stage [0-9]" "$f" || fail "rank $rank's error names no stage and micro-batch"
done
if [ "$mode" = shape ]; then
  grep -q "DesyncError.*stage 2 expected micro-batch 3's forward activations from stage 1 as .*\[5, 16\], but stage 1 sent .*\[6, 16\]" \
    "$out/rank_2.txt" || fail "stage 2 did not raise a DesyncError naming both stages and shapes"
else
  grep -q "stage 1" "$out/rank_2.txt" || fail "stage 2 does not name stage 1"
fi
echo "PASS: every stage raised within 4 s; the job ended with $code after $elapsed s"
