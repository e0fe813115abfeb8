#!/usr/bin/env bash
# A rank of a 4-rank train_moe job (2 s collective deadline) is frozen with
# SIGSTOP for 6 s, or killed: every other rank raises within the deadline + 2 s
# naming it (rank 0 as the store's host), and the frozen rank, resumed, says
# it was not running and names no healthy rank as dead.
# With "outside", the store runs outside the job (bulkhead-store, next to
# train_moe; BULKHEAD_STORE_ADDR): rank 0 is then named dead like any other
# rank, and the store outlives the job.
# usage: freeze_test.sh <stop|kill> <rank> <train_moe> <mpirun> [outside]
set -u
declare -A ended
action=$1 victim=$2 program=$3 mpirun=$4 where=${5:-rank0}
ranks=4
out=$(mktemp -d)
trap 'kill -CONT "${pid:-0}" 2>/dev/null; [ -n "${store:-}" ] && kill "$store" 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; echo "--- job output:"; cut -c1-400 "$out/log"; exit 1; }

store=
if [ "$where" = outside ]; then
  export BULKHEAD_STORE_TOKEN=freeze-test BULKHEAD_RUN_ID=freeze-$$
  "$(dirname "$program")/bulkhead-store" --host 127.0.0.1 --port 0 >"$out/store.log" 2>&1 &
  store=$!
  for _ in $(seq 100); do grep -q "^bulkhead-store listening on" "$out/store.log" && break; sleep 0.1; done
  BULKHEAD_STORE_ADDR=$(sed -n 's/^bulkhead-store listening on //p' "$out/store.log")
  [ -n "$BULKHEAD_STORE_ADDR" ] || fail "bulkhead-store did not start"
  export BULKHEAD_STORE_ADDR
fi

# Every line stamped with the wall clock when it arrives.
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }
(BULKHEAD_COLLECTIVE_TIMEOUT=2 BULKHEAD_SHUTDOWN_TIMEOUT=3 CI=1 \
  timeout 120 "$mpirun" --oversubscribe --mca orte_abort_on_non_zero_status 0 -np $ranks "$program" \
  --steps 1000000 --log-interval 20 2>&1 | stamp >"$out/log") &
job=$!

# Wait until training runs, then find the victim's process.
for _ in $(seq 300); do grep -q "step .* | loss" "$out/log" && break; sleep 0.1; done
grep -q "step .* | loss" "$out/log" || fail "training did not start"
pid=
declare -A pids
for p in $(pgrep -f "$(basename "$program") --steps 1000000"); do
  r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
  [ -n "$r" ] && pids[$r]=$p
done
pid=${pids[$victim]:-}
[ -n "$pid" ] || fail "no process of rank $victim"
frozen=$(date +%s.%N)
if [ "$action" = stop ]; then
  kill -STOP "$pid"
  (sleep 6 && kill -CONT "$pid") &
else
  kill -KILL "$pid"
fi
# Every process ends by itself (the frozen one once resumed): the survivors
# within the deadline + 2 s + the abort grace (1 s).
for _ in $(seq 600); do
  alive=0
  for r in "${!pids[@]}"; do
    if [ -z "${ended[$r]:-}" ] && kill -0 "${pids[$r]}" 2>/dev/null &&
      ! grep -q '^Z' <(awk '{print $3}' "/proc/${pids[$r]}/stat" 2>/dev/null); then
      alive=1
    elif [ -z "${ended[$r]:-}" ]; then
      ended[$r]=$(echo "$(date +%s.%N) - $frozen" | bc)
    fi
  done
  [ "$alive" = 0 ] && break
  sleep 0.05
done
for r in "${!pids[@]}"; do
  echo "rank $r ended ${ended[$r]:-never} s after the $action"
  [ -n "${ended[$r]:-}" ] || fail "rank $r did not end"
  [ "$r" = "$victim" ] && continue
  awk -v a="${ended[$r]}" 'BEGIN { exit !(a <= 5.5) }' || fail "rank $r ended ${ended[$r]} s after the $action"
done
# (mpirun, told to keep going after a rank's death, may linger once all ranks are gone.)
pkill -P "$job" 2>/dev/null
kill "$job" 2>/dev/null
wait "$job" 2>/dev/null

# Each surviving rank's first error, and when it arrived.
for ((r = 0; r < ranks; r++)); do
  [ "$r" -eq "$victim" ] && continue
  line=$(grep -m1 "\[bulkhead $r/$ranks [^]]* ERROR" "$out/log") || fail "rank $r raised nothing"
  at=$(echo "$line" | cut -d' ' -f1)
  after=$(echo "$at - $frozen" | bc)
  echo "rank $r after $after s: $(echo "$line" | cut -d' ' -f2- | cut -c1-300)"
  awk -v a="$after" 'BEGIN { exit !(a <= 4.5) }' || fail "rank $r raised $after s after the $action, over 2 s + 2 s"
  if [ "$victim" = 0 ] && [ "$where" != outside ]; then
    echo "$line" | grep -q "rank 0 hosts the store" || fail "rank $r does not name rank 0 as the store's host"
  else
    echo "$line" | grep -q "rank $victim is dead" || fail "rank $r does not name rank $victim"
  fi
done
if [ "$action" = stop ]; then
  grep "\[bulkhead $victim/$ranks " "$out/log" | grep -q "was not running for" ||
    fail "the frozen rank $victim does not report its own pause"
  if grep "\[bulkhead $victim/$ranks [^]]* ERROR" "$out/log" | grep -q "is dead"; then
    fail "the frozen rank $victim names a healthy rank as dead"
  fi
  grep "\[bulkhead $victim/$ranks " "$out/log" | grep "not running\|ERROR" | head -3 | cut -d' ' -f2- | cut -c1-300
fi
if [ -n "$store" ]; then
  kill -0 "$store" 2>/dev/null || fail "the store outside the job did not outlive it"
  kill -TERM "$store"
  wait "$store" || fail "bulkhead-store did not end cleanly on SIGTERM"
  store=
fi
echo PASS
