#!/usr/bin/env bash
# Fault tests on GPUs (NP ranks, default 2, one per GPU): rank 0 must raise TimeoutError
# within the deadline (2 s) plus 2 s and the job must exit non-zero, without
# hanging in abort. Skipped (exit 77) with fewer than NP GPUs.
# usage: gpu_fault_test.sh <init|collective|unwaited|connect> <program> <mpirun>
set -u
mode=$1 program=$2 mpirun=$3
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
ranks=${NP:-2}
if [ "${gpus:-0}" -lt "$ranks" ]; then
  echo "SKIPPED: this fault test needs $ranks GPUs (found ${gpus:-0})"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s%N)
BULKHEAD_SHUTDOWN_TIMEOUT=3 timeout 90 "$mpirun" --oversubscribe -np "$ranks" "$program" "$mode" 2000 "$out" \
  >"$out/log" 2>&1
code=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
fail() { echo "FAIL: $*"; echo "--- job output:"; cat "$out/log"; exit 1; }
[ "$code" -ne 124 ] || fail "the job hung until timeout(1) killed it"
[ "$code" -ne 0 ] || fail "the job exited 0"
[ -f "$out/rank_0.txt" ] || fail "rank 0 wrote no outcome"
read -r waited kind rest <"$out/rank_0.txt"
echo "job exited with code $code after $elapsed_ms ms; rank 0 waited $waited s: $kind $rest"
[ "$kind" = "TimeoutError" ] || fail "rank 0 got '$kind', not TimeoutError"
awk -v w="$waited" 'BEGIN { exit !(w >= 1.9 && w <= 4.0) }' || fail "rank 0 waited $waited s, not 2-4 s"
case $mode in
  init) echo "$rest" | grep -q "did not join init" || fail "the message does not say a rank did not join init" ;;
  connect)
    echo "$rest" | grep -q "all_to_all seq 1 did not complete" || fail "the message does not name all_to_all seq 1"
    echo "$rest" | grep -q "later operations refused" || fail "the aborted communicator accepted more work"
    ;;
  *)
    echo "$rest" | grep -q "all_reduce seq 6 did not complete" || fail "the message does not name all_reduce seq 6"
    echo "$rest" | grep -q "later operations refused" || fail "the aborted communicator accepted more work"
    ;;
esac
# With more ranks, every rank but the guilty one (1) raises the same way.
for ((r = 2; r < ranks; r++)); do
  [ -f "$out/rank_$r.txt" ] || fail "rank $r wrote no outcome"
  read -r w k _ <"$out/rank_$r.txt"
  [ "$k" = "TimeoutError" ] || fail "rank $r got '$k', not TimeoutError"
  awk -v w="$w" 'BEGIN { exit !(w >= 1.9 && w <= 4.0) }' || fail "rank $r waited $w s, not 2-4 s"
done
echo "PASS"
