#!/usr/bin/env bash
# Checkpoint faults across whole jobs (bulkhead_ckpt_job under mpirun):
#   kill         a rank dies halfway through writing step 200: `latest` and step 100 stay
#                intact, and the next run (another world size and layout) resumes from step 100
#   commit-exit  rank 0 dies after writing the manifest of step 200, before the rename: same
#   stall        one rank's writer stalls: the others give up within the deadline (2 s) plus
#                slack while training goes on, the save fails, `latest` stays; the next save works
#   write-error  a write fails as on a full disk: IoError on every rank, nothing lost
#   tmpfs        a real full disk (a small tmpfs; needs root, else skipped): IoError, nothing lost
#   two-jobs     two jobs save the same steps into one folder at once: every committed step
#                verifies and holds one job's data, no partial folder remains
# usage: fault_test.sh <mode> <bulkhead_ckpt_job> <bulkhead-ckpt> <mpirun>
set -u
mode=$1 job=$2 tool=$3 mpirun=$4
work=$(mktemp -d)
dir=$work/ckpt
mounted=""
cleanup() {
  [ -n "$mounted" ] && umount "$mounted"
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for log in "$work"/*.log; do echo "--- $log:"; cat "$log"; done; exit 1; }
run_job() {  # run_job LOG NP ARGS...: the job's exit code
  local log=$1 np=$2
  shift 2
  timeout 180 "$mpirun" --oversubscribe -np "$np" "$job" "$dir" "$@" >"$log" 2>&1
}
latest() { cat "$dir/latest" 2>/dev/null; }
verify_ok() { "$tool" verify "$dir" --step "$1" >"$work/verify.log" 2>&1 || fail "bulkhead-ckpt verify --step $1 failed"; }
saves_of() { grep "SAVE $2 " "$1"; }

case $mode in
kill | commit-exit)
  run_job "$work/first.log" 4 tp=2 ep=2 saves=100 || fail "the first run failed"
  [ "$(latest)" = step_000100 ] || fail "latest is '$(latest)' after the first run"
  if [ "$mode" = kill ]; then fault="rank=2,step=200,action=exit"; else fault="rank=0,step=200,action=commit-exit"; fi
  BULKHEAD_CHECKPOINT_FAULT=$fault run_job "$work/crash.log" 4 tp=2 ep=2 seed=1 saves=200
  code=$?
  [ "$code" -ne 0 ] || fail "the run with a rank dying during the save exited 0"
  [ "$code" -ne 124 ] || fail "the run with a rank dying during the save hung"
  echo "the crashed run exited with code $code"
  [ "$(latest)" = step_000100 ] || fail "latest is '$(latest)' after the crash, not step_000100"
  [ ! -e "$dir/step_000200" ] || fail "step 200 was committed although a rank died"
  verify_ok latest
  "$tool" list "$dir" | tee "$work/list.log"
  grep -q "step_000200.tmp" "$work/list.log" || fail "list does not show the partial step 200"
  # The next run: another world size and layout, resumes from step 100.
  run_job "$work/resume.log" 8 ep=8 load=latest seeds=1 || fail "the resumed run failed"
  [ "$(grep -o "LOAD step 100 seed 1 user ok" "$work/resume.log" | wc -l)" -eq 8 ] || fail "not every rank loaded step 100 intact"
  echo "PASS: latest and step 100 intact after the crash; 8 ranks under ep 8 resumed from step 100 bitwise"
  ;;
stall)
  BULKHEAD_CHECKPOINT_FAULT=rank=2,step=200,action=stall:4 \
    run_job "$work/stall.log" 4 tp=2 ep=2 timeout=2 train=3 saves=100,200,300 || fail "the run failed"
  for r in 0 1 2 3; do
    line=$(grep "RANK $r SAVE 200 " "$work/stall.log") || fail "rank $r reported nothing for step 200"
    echo "$line"
    echo "$line" | grep -q "failed" || fail "rank $r: the stalled save did not fail"
    [ "$r" -eq 2 ] && continue
    echo "$line" | grep -q "TimeoutError" || fail "rank $r: not a TimeoutError"
    echo "$line" | grep -q "rank 2 did not report" || fail "rank $r: the error does not name rank 2"
    total=$(echo "$line" | sed 's/.*total=\([0-9.]*\).*/\1/')
    awk -v t="$total" 'BEGIN { exit !(t >= 1.9 && t <= 3.5) }' || fail "rank $r gave up after $total s, not 2-3.5 s"
  done
  grep -q "RANK 0 LATEST 100" "$work/stall.log" || fail "latest moved after the failed save"
  [ "$(grep -o "SAVE 300 ok" "$work/stall.log" | wc -l)" -eq 4 ] || fail "the save after the stall did not commit on every rank"
  [ "$(latest)" = step_000300 ] || fail "latest is '$(latest)', not step_000300"
  [ ! -e "$dir/step_000200" ] || fail "the stalled step 200 was committed"
  verify_ok 100
  verify_ok 300
  echo "PASS: the others gave up on step 200 within the deadline while training went on; step 300 committed"
  ;;
write-error | tmpfs)
  args=(tp=2 ep=2 saves=100,200 load=latest seeds=1)
  if [ "$mode" = tmpfs ]; then
    mkdir -p "$dir"
    # Room for one checkpoint of this size (about 1.1 MB) but not two.
    mount -t tmpfs -o size=1800k tmpfs "$dir" 2>/dev/null || { echo "SKIP: cannot mount a tmpfs here (needs root)"; exit 77; }
    mounted=$dir
    args+=(hidden=64 ffn=96)
    run_job "$work/full.log" 4 "${args[@]}" || fail "the run failed"
  else
    BULKHEAD_CHECKPOINT_FAULT=rank=1,step=200,action=write-error run_job "$work/full.log" 4 "${args[@]}" ||
      fail "the run failed"
  fi
  grep "SAVE" "$work/full.log"
  [ "$(grep -o "SAVE 100 ok" "$work/full.log" | wc -l)" -eq 4 ] || fail "step 100 was not saved by every rank"
  [ "$(grep -o "SAVE 200 failed IoError" "$work/full.log" | wc -l)" -eq 4 ] || fail "step 200 did not fail with IoError on every rank"
  grep "SAVE 200 failed" "$work/full.log" | grep -q "No space left on device" || fail "no rank names the full disk"
  [ "$(latest)" = step_000100 ] || fail "latest is '$(latest)', not step_000100"
  ls "$dir" | grep -q "step_000200" && fail "step 200 left a folder behind: $(ls "$dir")"
  verify_ok latest
  [ "$(grep -o "LOAD step 100 seed 1 user ok" "$work/full.log" | wc -l)" -eq 4 ] || fail "step 100 did not load intact"
  echo "PASS: IoError on every rank, step 100 and latest intact and loadable"
  ;;
two-jobs)
  run_job "$work/job1.log" 2 ep=2 seed=1 keep=0 saves=100,200,300,400 &
  first=$!
  run_job "$work/job2.log" 2 ep=2 seed=2 keep=0 saves=100,200,300,400 &
  second=$!
  wait $first || fail "job 1 failed"
  wait $second || fail "job 2 failed"
  for step in 100 200 300 400; do
    ok=$(cat "$work/job1.log" "$work/job2.log" | grep -c "RANK 0 SAVE $step ok")
    echo "step $step: committed by $ok job(s)"
    [ "$ok" -eq 1 ] || fail "step $step was committed by $ok jobs"
    run_job "$work/load$step.log" 2 ep=2 load=$step seeds=1,2 || fail "step $step does not hold either job's data"
    grep "RANK 0 LOAD" "$work/load$step.log"
  done
  "$tool" verify "$dir" --step all || fail "verify found a fault"
  partial=$(ls "$dir" | grep -v -e '^step_[0-9]*$' -e '^latest$' || true)
  [ -z "$partial" ] || fail "left behind: $partial"
  echo "PASS: each step holds exactly one job's intact checkpoint"
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
