#!/usr/bin/env bash
# A rank that skips one collective: every other rank of its group gets a
# TimeoutError within the deadline (2 s) plus 1 s, naming the group, the
# operation and the sequence number, and the job exits non-zero, not hanging.
# usage: skip_collective_test.sh <ranks> <world|split> <op> <program> <mpirun>
set -u
ranks=$1 group=$2 op=$3 program=$4 mpirun=$5
skip=$((ranks - 1))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

start=$(date +%s%N)
timeout 90 "$mpirun" --oversubscribe -np "$ranks" "$program" "$skip" "$group" "$op" 2000 "$out" >"$out/log" 2>&1
code=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
fail() { echo "FAIL: $*"; echo "--- job output:"; cat "$out/log"; exit 1; }

[ "$code" -ne 124 ] || fail "the job hung until timeout(1) killed it after 90 s"
[ "$code" -ne 0 ] || fail "the job exited 0; a rank that timed out must make it exit non-zero"
echo "job exited with code $code after ${elapsed_ms} ms"

case $op in all_reduce) name=all_reduce ;; all_to_all) name=all_to_all ;; *) name=barrier ;; esac
checked=0
for ((r = 0; r < ranks; r++)); do
  [ "$r" -eq "$skip" ] && continue
  if [ "$group" = split ] && [ $((r % 2)) -ne $((skip % 2)) ]; then continue; fi
  file="$out/rank_$r.txt"
  [ -f "$file" ] || fail "rank $r wrote no outcome"
  read -r waited seq kind rest <"$file"
  echo "rank $r: waited ${waited} s: $kind $rest"
  [ "${kind%% *}" = "TimeoutError" ] || fail "rank $r got '$kind', not TimeoutError"
  echo "$rest" | grep -q "seq=$seq" || fail "rank $r: the error does not carry seq $seq"
  echo "$rest" | grep -q "$name seq $seq did not complete" || fail "rank $r: the message does not name $name seq $seq"
  echo "$rest" | grep -q "rank $skip last completed seq $((seq - 1)) and never issued seq $seq" ||
    fail "rank $r: the message does not name rank $skip as the one that never issued seq $seq"
  if [ "$group" = split ]; then want="group half\[$((skip % 2))\]"; else want="group world"; fi
  echo "$rest" | grep -q "$want" || fail "rank $r: the message does not name $want"
  awk -v w="$waited" 'BEGIN { exit !(w >= 1.9 && w <= 3.0) }' || fail "rank $r waited $waited s, not 2-3 s"
  checked=$((checked + 1))
done
[ "$checked" -gt 0 ] || fail "no rank was checked"
echo "PASS: $checked ranks raised TimeoutError within the deadline plus 1 s"
