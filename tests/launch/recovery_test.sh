#!/usr/bin/env bash
# Recovery inside the job (launch/recovery.h), on CPU with the gloo backend:
# train_moe on 8 ranks (pp 2, ep 2, dp 4) plus 1 spare, started as plain
# processes around a bulkhead-store, in float64.
#
#   clean   no fault: the job ends 0 and so does the spare, told it was not needed.
#   kill    SIGKILL a random rank at a random step: every other process ends 0,
#           the spare took the rank, and the losses equal the clean run's
#           (1e-12 relative) with at most one step computed twice.
#   stop    SIGSTOP a random rank at a random step, SIGCONT it once a spare took
#           its place: it exits non-zero saying it was replaced; the rest as kill.
#   two     with 2 spares, SIGKILL two ranks at once (not each other's holder):
#           both replaced, the rest as kill.
#   during  with 2 spares, SIGKILL a rank, then another while the job recovers:
#           the recovery leaves it out too, the rest as kill.
#   every   as kill, with a snapshot every 3 steps in both runs: at most 3 steps
#           computed twice.
#   ckpt    as kill, with checkpoints every 4 steps (and at the end) in both runs:
#           the recovered run's latest (step 24) verifies and equals the clean
#           run's key by key (the spare writes the lost rank's slices).
#   spare   kill the spare first, then a rank: the job ends (no hang) on every
#           rank, naming the lost rank and the silent spare.
#   store   kill bulkhead-store, then a rank: every process ends non-zero
#           within the bound, naming the store.
# FAULT_RANK and FAULT_STEP pick the fault instead of $RANDOM.
# GPU=1: the nccl backend in bf16, one rank per GPU (every GPU, up to 8; ep 2, and pp 2 at 8) plus the
# spares, which wait off the GPUs and take the lost rank's; losses then within 2% of the clean run's.
# Skipped (77) with fewer than 2 GPUs.
# usage: [GPU=1] recovery_test.sh <clean|kill|stop|two|during|every|ckpt|spare|store> <bin dir>
set -u
mode=$1 bin=$2
out=$(mktemp -d)
pids=() store= watchdog=
stop_watchdog() {
  [ -n "$watchdog" ] && pkill -P "$watchdog" 2>/dev/null && kill "$watchdog" 2>/dev/null
  watchdog=
}
cleanup() {
  stop_watchdog
  for p in "${pids[@]}" $store; do kill -KILL "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] || rm -rf "$out"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$out"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -15 "$f"; }; done; exit 1; }

ranks=8 spares=1 steps=24
case $mode in two | during) spares=2 ;; esac
args=(--backend gloo --dtype float64 --pp 2 --ep 2 --microbatches 2 --layers 4 --hidden 32 --heads 4 --ffn 32
  --experts 4 --topk 2 --seq 16 --batch 8 --steps $steps --log-interval 4 --spares $spares)
tolerance=1e-12
if [ "${GPU:-0}" = 1 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -lt 2 ]; then
    echo "SKIPPED: recovery on GPUs needs at least 2 GPUs; nvidia-smi lists ${gpus:-0}"
    exit 77
  fi
  ranks=$((gpus < 8 ? gpus : 8)) tolerance=2e-2
  layout=(--ep 2)
  [ "$ranks" -ge 8 ] && layout=(--pp 2 --ep 2 --microbatches 2)
  args=(--backend nccl --dtype bfloat16 "${layout[@]}" --layers 4 --hidden 256 --heads 4 --ffn 256 --experts 8
    --topk 2 --seq 128 --batch $((4 * ranks)) --steps $steps --log-interval 4 --spares $spares)
fi
[ "$mode" = ckpt ] && args+=(--ckpt-interval 4)
every=1
[ "$mode" = every ] && every=3 && args+=(--snapshot-every $every)
# A generation that does not come up (a rank lost while it does) is given up after the init deadline.
export BULKHEAD_STORE_TOKEN=recovery-token BULKHEAD_COLLECTIVE_TIMEOUT=${BULKHEAD_COLLECTIVE_TIMEOUT:-6} \
  BULKHEAD_INIT_TIMEOUT=${BULKHEAD_INIT_TIMEOUT:-30}
. "$(dirname "$0")/outside_store.sh"
start_outside_store "$bin" "$out/store.log"

# start <run>: ranks + spares processes of train_moe, pids in pids[], logs <run>.<i>.log.
start() {
  local run=$1 size=$((ranks + spares)) saves=()
  [ "$mode" = ckpt ] && saves=(--ckpt-dir "$out/ckpt.$run")
  pids=()
  for ((i = 0; i < size; i++)); do
    env -u OMPI_COMM_WORLD_RANK RANK=$i WORLD_SIZE=$size LOCAL_RANK=$i LOCAL_WORLD_SIZE=$size \
      BULKHEAD_RUN_ID="$run" "$bin/train_moe" "${args[@]}" ${saves[@]+"${saves[@]}"} --loss-log "$out/$run.loss" >"$out/$run.$i.log" 2>&1 &
    pids+=($!)
  done
  # Its output goes nowhere, so that it never holds the test's output open.
  bash -c 'sleep 240 && kill -KILL "$@"' _ "${pids[@]}" >/dev/null 2>&1 &
  watchdog=$!
}
# finish <run>: waits for every process; codes[i] its exit code.
finish() {
  codes=()
  for p in "${pids[@]}"; do
    wait "$p"
    codes+=($?)
  done
  stop_watchdog
  echo "$1: exit codes ${codes[*]}"
}
# lines <run>: steps rank 0 has logged.
lines() { [ -f "$out/$1.loss" ] && wc -l <"$out/$1.loss" || echo 0; }
# same_losses <run>: the last line of each step equals the clean run's.
same_losses() {
  python3 - "$out/clean.loss" "$out/$1.loss" "$steps" "$tolerance" <<'EOF' || fail "$1: the losses differ from the clean run's"
import sys
def last(path):
    rows = {}
    for line in open(path):
        step, loss, norm = line.split()
        rows[int(step)] = (float(loss), float(norm))
    return rows
clean, run, steps, tolerance = last(sys.argv[1]), last(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
assert sorted(run) == list(range(steps)), f"steps logged: {sorted(run)}"
worst = max(abs(run[s][i] - clean[s][i]) / max(abs(clean[s][i]), 1e-300) for s in range(steps) for i in (0, 1))
print(f"losses and gradient norms of {steps} steps follow the clean run's: worst relative difference {worst:.2e}")
assert worst <= tolerance
EOF
}

python3 -c 'import sys' || fail "python3 is needed"
# spare and store compare nothing with the clean run: they go without it.
if [ "$mode" != spare ] && [ "$mode" != store ]; then
  start clean
  finish clean
  for ((i = 0; i <= ranks; i++)); do [ "${codes[$i]}" = 0 ] || fail "clean run: process $i exited ${codes[$i]}"; done
  grep -q "needed no spare" "$out/clean.$ranks.log" || fail "the spare of the clean run does not say it was not needed"
  [ "$(lines clean)" = $steps ] || fail "the clean run logged $(lines clean) steps, not $steps"
fi
[ "$mode" = clean ] && echo PASS && exit 0

victim=${FAULT_RANK:-$((RANDOM % ranks))}
second=$(((victim + 2 + RANDOM % 5) % ranks))  # not the victim's holder, nor the rank it holds for
at=${FAULT_STEP:-$((3 + RANDOM % 12))}
echo "$mode: rank $victim at step $at$(case $mode in two | during) echo ", then rank $second" ;; esac)"
lost=" $victim "
case $mode in two | during) lost=" $victim $second " ;; esac
# Whether a process other than the faulted ones still runs.
others_alive() {
  for ((j = 0; j < ${#pids[@]}; j++)); do
    [[ "$lost" == *" $j "* ]] || ! kill -0 "${pids[$j]}" 2>/dev/null || return 0
  done
  return 1
}
start "$mode"
# The spare or the store goes once training runs.
for _ in $(seq 1200); do [ "$(lines "$mode")" -ge 1 ] && break; sleep 0.05; done
case $mode in
spare) kill -KILL "${pids[$ranks]}" ;;
store) kill -KILL "$store" && store= ;;
esac
for _ in $(seq 1200); do [ "$(lines "$mode")" -ge "$at" ] && break; sleep 0.05; done
[ "$(lines "$mode")" -ge "$at" ] || fail "$mode: training did not reach step $at"
fault_ms=$(date +%s%3N)
before=$(lines "$mode")
case $mode in
stop) kill -STOP "${pids[$victim]}" ;;
two) kill -KILL "${pids[$victim]}" "${pids[$second]}" ;;
*) kill -KILL "${pids[$victim]}" ;;
esac
if [ "$mode" = during ]; then
  for _ in $(seq 600); do grep -q "recovering:" "$out"/during.*.log && break; sleep 0.02; done
  kill -KILL "${pids[$second]}"
fi
# The first step after the fault, as rank 0 (or the spare that took its place) logs it.
recovered_ms=
for _ in $(seq 2400); do
  [ "$(lines "$mode")" -gt "$before" ] && recovered_ms=$(date +%s%3N) && break
  others_alive || break
  sleep 0.05
done
if [ "$mode" = stop ]; then
  # The step under way may still be logged (the stopped rank had done its part of it): the stopped
  # rank is continued only once a spare has taken its place.
  for _ in $(seq 1200); do
    grep -Eq "took rank $victim in generation|is up in .* as rank $victim:" "$out/stop.$ranks.log" && break
    others_alive || break
    sleep 0.05
  done
  sleep 2
  kill -CONT "${pids[$victim]}"
fi
finish "$mode"
end_ms=$(date +%s%3N)

if [ "$mode" = spare ] || [ "$mode" = store ]; then
  want="live spare"
  [ "$mode" = store ] && want="bulkhead-store"
  for ((i = 0; i <= ranks; i++)); do
    [ "$i" = "$victim" ] && continue
    [ "$mode" = spare ] && [ "$i" = "$ranks" ] && continue
    [ "${codes[$i]}" != 0 ] || fail "$mode: process $i exited 0 with a rank lost and no recovery"
    grep -q "$want" "$out/$mode.$i.log" || fail "$mode: process $i does not name what was lost (/$want/)"
  done
  [ "$mode" = spare ] && { grep -q "rank $victim lost" "$out"/spare.*.log || fail "spare: the lost rank is not named"; }
  echo "$mode: every process ended within $(((end_ms - fault_ms) / 1000)) s of the fault, naming what was lost"
  echo PASS
  exit 0
fi

for ((i = 0; i < ranks + spares; i++)); do
  [[ "$lost" == *" $i "* ]] && continue
  [ "${codes[$i]}" = 0 ] || fail "$mode: process $i exited ${codes[$i]}"
done
if [ "$mode" = stop ]; then
  [ "${codes[$victim]}" != 0 ] || fail "stop: the stopped rank exited 0"
  grep -q "was replaced by a spare" "$out/stop.$victim.log" || fail "stop: the stopped rank does not say it was replaced"
else
  for r in $lost; do [ "${codes[$r]}" = 137 ] || fail "$mode: killed rank $r exited ${codes[$r]}"; done
fi
for r in $lost; do
  spare_logs=()
  for ((i = ranks; i < ranks + spares; i++)); do spare_logs+=("$out/$mode.$i.log"); done
  grep -Eq "took rank $r in generation|is up in .* as rank $r:" "${spare_logs[@]}" || fail "$mode: no spare took rank $r"
done
total=$(lines "$mode")
[ "$total" -le $((steps + every)) ] ||
  fail "$mode: $total steps logged: more than $every step(s) computed twice (a snapshot every $every)"
same_losses "$mode"
[ -n "$recovered_ms" ] || fail "$mode: no step was logged after the fault"
if [ "$mode" = ckpt ]; then
  "$bin/bulkhead-ckpt" verify "$out/ckpt.ckpt" --step latest >"$out/verify.log" 2>&1 ||
    fail "ckpt: latest does not verify: $(tail -3 "$out/verify.log")"
  latest=$("$bin/bulkhead-ckpt" list "$out/ckpt.ckpt" | awk '/\(latest\)/ {print $2}')
  [ "$latest" = "$steps" ] || fail "ckpt: latest is step '$latest', not $steps"
  "$bin/bulkhead-ckpt" diff "$out/ckpt.clean" "$out/ckpt.ckpt" >"$out/diff.log" 2>&1 ||
    fail "ckpt: step $steps differs from the clean run's: $(grep -v ' equal$' "$out/diff.log" | tail -5)"
  echo "ckpt: step $steps verifies and equals the clean run's: $(tail -1 "$out/diff.log")"
fi
echo "$mode: rank 0 had logged $before steps at the fault and $total in all; the next step was logged" \
  "$(((recovered_ms - fault_ms) / 1000)).$((((recovered_ms - fault_ms) % 1000) / 100)) s after the fault" \
  "(BULKHEAD_COLLECTIVE_TIMEOUT=$BULKHEAD_COLLECTIVE_TIMEOUT s of it to notice)"
echo PASS
