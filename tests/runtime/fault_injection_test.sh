#!/usr/bin/env bash
# Each injected fault on the group all[0] at seq 4 (an all-reduce; FAULT_SEQ=6 where
# BULKHEAD_PEER_ALL_REDUCE sets the group up first, with two operations), on rank 2:
# every surviving rank raises within the deadline (2 s) plus 2 s, and its
# message names the group, the sequence number and rank 2 for what it did.
# With strict=1, a mismatch is caught at the call itself, long before any
# deadline. The job exits non-zero instead of hanging.
# usage: fault_injection_test.sh <ranks> <skip|mismatch-op|mismatch-size|delay:5|exit> <strict 0|1> <program> <mpirun>
#        [mpi|gloo|nccl]   (nccl: one rank per GPU; skipped with fewer GPUs than ranks)
set -u
ranks=$1 action=$2 strict=$3 program=$4 mpirun=$5 backend=${6:-mpi}
if [ "$backend" = nccl ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -lt "$ranks" ]; then
    echo "SKIPPED: $ranks ranks with NCCL need $ranks GPUs (found ${gpus:-0})"
    exit 77
  fi
fi
guilty=$((ranks > 2 ? 2 : 1)) seq=${FAULT_SEQ:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# A rank that exits abruptly must not take the job down before its peers
# report: only then is mpirun told to keep the others running.
keep=()
[ "$action" = exit ] && keep=(--mca orte_abort_on_non_zero_status 0)
start=$(date +%s%N)
BULKHEAD_FAULT="rank=$guilty,group=all[0],seq=$seq,action=$action" BULKHEAD_STRICT=$strict BULKHEAD_SHUTDOWN_TIMEOUT=3 \
  timeout 90 "$mpirun" --oversubscribe "${keep[@]}" -np "$ranks" "$program" "$out" "$backend" >"$out/log" 2>&1
code=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
fail() { echo "FAIL: $*"; echo "--- job output:"; cat "$out/log"; exit 1; }
[ "$code" -ne 124 ] || fail "the job hung until timeout(1) killed it after 90 s"
# (mpirun told to keep running after a rank's death reports 0 whatever its
# ranks returned, so the exit test judges by the ranks' own outcomes.)
[ "$code" -ne 0 ] || [ "$action" = exit ] || fail "the job exited 0"
echo "job exited with code $code after $elapsed_ms ms"

case $action in
  skip | delay:*) kind=TimeoutError want="rank $guilty last completed seq $((seq - 1)) and never issued seq $seq" ;;
  exit) kind=TimeoutError want="rank $guilty is dead" ;;
  mismatch-op) kind=DesyncError want="rank $guilty issued broadcast float32 \[4096\]" ;;
  mismatch-size) kind=DesyncError want="rank $guilty issued all_reduce float32 \[4097\]" ;;
esac
limit=4.0
if [ "$strict" = 1 ]; then limit=1.0; want="rank $guilty issues all_reduce float32 \[4097\]"; fi
for ((r = 0; r < ranks; r++)); do
  [ "$r" -eq "$guilty" ] && continue
  file="$out/rank_$r.txt"
  [ -f "$file" ] || fail "rank $r wrote no outcome"
  read -r waited got rest <"$file"
  echo "rank $r: $waited s: $got $rest"
  [ "$got" = "$kind" ] || fail "rank $r got '$got', not $kind"
  echo "$rest" | grep -q "group all\[0\]" || fail "rank $r: the message does not name group all[0]"
  echo "$rest" | grep -q "seq $seq" || fail "rank $r: the message does not name seq $seq"
  echo "$rest" | grep -q "$want" || fail "rank $r: the message does not say '$want'"
  awk -v w="$waited" -v l="$limit" 'BEGIN { exit !(w <= l) }' || fail "rank $r took $waited s, over $limit s"
done
echo "PASS"
