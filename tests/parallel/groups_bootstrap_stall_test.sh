#!/usr/bin/env bash
# A rank stalls in the process-group manager's k-th split (BULKHEAD_FAULT
# delay:10 on the world's split, sequence number taken from the world ledger by
# a probe run): with a 2 s deadline, every other rank raises TimeoutError
# within 2 s + 2 s, naming the group it was creating, and the job exits
# non-zero instead of hanging.
# usage: groups_bootstrap_stall_test.sh <k> <program> <mpirun>
set -u
k=$1 program=$2 mpirun=$3
ranks=4 guilty=2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; echo "--- job output:"; cat "$out/log" 2>/dev/null; exit 1; }

timeout 60 "$mpirun" --oversubscribe -np $ranks "$program" probe "$k" >"$out/probe" 2>&1 ||
  { cat "$out/probe"; fail "the probe run failed"; }
read -r _ seq _ kind < <(grep '^seq ' "$out/probe")
[ -n "${seq:-}" ] || { cat "$out/probe"; fail "the probe printed no sequence number"; }
echo "split $k ($kind) is world seq $seq"

BULKHEAD_FAULT="rank=$guilty,group=world,seq=$seq,action=delay:10" BULKHEAD_SHUTDOWN_TIMEOUT=3 \
  timeout 90 "$mpirun" --oversubscribe -np $ranks "$program" run "$k" 2000 "$out" >"$out/log" 2>&1
code=$?
[ "$code" -ne 124 ] || fail "the job hung until timeout(1) killed it after 90 s"
[ "$code" -ne 0 ] || fail "the job exited 0"
echo "job exited with code $code"
for ((r = 0; r < ranks; r++)); do
  [ "$r" -eq "$guilty" ] && continue
  file="$out/rank_$r.txt"
  [ -f "$file" ] || fail "rank $r wrote no outcome"
  read -r took group got rest <"$file"
  echo "rank $r: $took s: $got $rest"
  [ "$got" = TimeoutError ] || fail "rank $r got '$got', not TimeoutError"
  echo "$rest" | grep -qF "$kind group $group" || fail "rank $r: the message does not name the group $group being created"
  echo "$rest" | grep -qF "creation" || fail "rank $r: the message does not say the creation step failed"
  echo "$rest" | grep -qF "seq $seq" || fail "rank $r: the message does not keep the world's diagnosis of seq $seq"
  echo "$rest" | grep -qF "rank $guilty" || fail "rank $r: the message does not name rank $guilty"
  awk -v t="$took" 'BEGIN { exit !(t <= 4.0) }' || fail "rank $r took $took s, over the 2 s deadline plus 2 s"
done
echo "PASS"
