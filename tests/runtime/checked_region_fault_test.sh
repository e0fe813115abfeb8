#!/usr/bin/env bash
# A checked region in which one rank issues another sequence: every rank raises
# DesyncError at the region's end within 5 s, naming region, group, the first
# position that differs and both sides; the job exits non-zero, not hanging.
# usage: checked_region_fault_test.sh <mode> <ranks> <program> <mpirun> [backend]
set -u
mode=$1 ranks=$2 program=$3 mpirun=$4 backend=${5:-mpi}
odd=$((ranks - 1))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; echo "--- job output:"; cat "$out/log"; exit 1; }

fault=()
case $mode in
  mismatch-op | mismatch-size | skip) export BULKHEAD_FAULT="rank=$odd,group=world,seq=6,action=$mode" fault=(-x BULKHEAD_FAULT) ;;
esac
export BULKHEAD_BACKEND=$backend
timeout 90 "$mpirun" --oversubscribe -np "$ranks" "${fault[@]}" -x BULKHEAD_BACKEND "$program" "$mode" "$odd" "$out" >"$out/log" 2>&1
code=$?
[ "$code" -ne 124 ] || fail "the job hung until timeout(1) killed it after 90 s"
[ "$code" -ne 0 ] || fail "the job exited 0 after a desync"

eights=$(printf '8,%.0s' $(seq "$ranks")) nines=$(printf '9,%.0s' $(seq "$ranks"))  # splits: rows to each rank
eights=${eights%,} nines=${nines%,}
# What each side issued at the first difference (position 3 = seq 6, or 6 for extra).
others="ranks $(seq -s, 0 $((odd - 1)))"
[ "$odd" -eq 1 ] && others="rank 0"
case $mode in
  mismatch-op)   want="collective 3 of the region: $others issued all_reduce float32 \[1024\] sum (seq 6); rank $odd issued broadcast float32 \[1024\] root 0 (seq 6)" ;;
  mismatch-size) want="collective 3 of the region: $others issued all_reduce float32 \[1024\] sum (seq 6); rank $odd issued all_reduce float32 \[1025\] sum (seq 6)" ;;
  skip)          want="collective 3 of the region: $others issued all_reduce float32 \[1024\] sum (seq 6); rank $odd issued all_to_all float32 \[$((8 * ranks)) x 16\]" ;;
  splits)        want="collective 4 of the region: rank 0 sends 8 rows to rank $odd, which expects 9 from it (rank 0: all_to_all float32 \[$((8 * ranks)) x 16\] send \[$eights\] recv \[$eights\], seq 7; rank $odd: all_to_all float32 \[$((9 * ranks)) x 16\] send \[$nines\] recv \[$nines\], seq 7)" ;;
  extra)         want="collective 6 of the region: $others issued nothing there (no more than 5 collectives on this group in the region); rank $odd issued all_reduce float32 \[32\] sum (seq 9)" ;;
esac
for ((r = 0; r < ranks; r++)); do
  file="$out/rank_$r.txt"
  [ -f "$file" ] || fail "rank $r wrote no outcome"
  read -r took kind rest <"$file"
  echo "rank $r: end() took ${took} s: $kind $rest"
  [ "$kind" = DesyncError ] || fail "rank $r got '$kind', not DesyncError"
  echo "$rest" | grep -q "checked region 'step' #1: group world (ranks $(seq -s, 0 $odd))" ||
    fail "rank $r: the message does not name the region and the group"
  echo "$rest" | grep -q "$want" || fail "rank $r: the message does not say: $want"
  awk -v t="$took" 'BEGIN { exit !(t <= 5.0) }' || fail "rank $r took $took s to fail, over 5 s"
done
echo "PASS: $ranks ranks ($backend) raised DesyncError at the region's end ($mode, job exit code $code)"
