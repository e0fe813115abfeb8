#!/usr/bin/env bash
# Jobs started without MPI: ranks started by a shell loop with torchrun's
# variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) bootstrap
# through rank 0's store and run on the gloo backend.
#
#   collectives  bulkhead-collectives on 4 ranks: every result correct.
#   train        train_moe (float64, 20 steps) gives bitwise the same losses
#                started by the loop as under mpirun (gloo backend there too),
#                and a checkpoint saved under one launcher resumes under the
#                other, both ways, on the same losses.
#   faults       a rank that never starts, two processes with one RANK, a
#                mismatched WORLD_SIZE, a wrong token and a missing token: every
#                started rank exits non-zero within the init deadline + 2 s,
#                naming the problem.
#   outside      a store outside the job (bulkhead-store, BULKHEAD_STORE_ADDR):
#                two runs started by the loop and one under mpirun, one after
#                another through the same store, each with its own run id, all
#                correct; a run without a run id is refused on every rank; the
#                store still serves after them all and ends on SIGTERM with 0.
#                A store killed mid-training: training goes on to its end, and
#                the ranks name the store's process as gone.
# usage: store_launch_test.sh <collectives|train|faults|outside> <bin dir> <mpirun>
set -u
mode=$1 bin=$2 mpirun=$3
. "$(dirname "$0")/outside_store.sh"
out=$(mktemp -d)
store=
trap '[ -n "$store" ] && kill "$store" 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; for f in "$out"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done; exit 1; }

# A port below Linux's ephemeral range (32768 up, where the kernel picks the ports
# of outgoing connections and of listeners on port 0), with nothing listening on it.
port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 12000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || break
  done
  echo "$p"
}

# loop <name> <world size> <ranks to start, e.g. "0 1 2 3"> -- program args...
# Per-rank overrides: RANK_<i>_ENV="VAR=value ..." (i: position in the list).
loop() {
  local name=$1 size=$2 ranks=$3
  shift 4
  local master_port
  master_port=$(port)
  local i=0 pids=()
  for r in $ranks; do
    local extra_var="RANK_${i}_ENV"
    (
      start=$(date +%s%N)
      # shellcheck disable=SC2086
      env -u OMPI_COMM_WORLD_RANK RANK="$r" WORLD_SIZE="$size" LOCAL_RANK="$r" LOCAL_WORLD_SIZE="$size" \
        MASTER_ADDR=127.0.0.1 MASTER_PORT="$master_port" BULKHEAD_STORE_TOKEN="${TOKEN-job-token}" \
        ${!extra_var:-} timeout 120 "$@" >"$out/$name.$i.log" 2>&1
      echo "$? $((($(date +%s%N) - start) / 1000000))" >"$out/$name.$i.rc"
    ) &
    pids+=($!)
    i=$((i + 1))
  done
  wait "${pids[@]}"  # these ranks, not a store started in the background
}

case $mode in
collectives)
  loop coll 4 "0 1 2 3" -- "$bin/bulkhead-collectives" --iters 2 --sizes 4K,1M
  for i in 0 1 2 3; do
    read -r code _ <"$out/coll.$i.rc"
    [ "$code" = 0 ] || fail "rank $i exited $code"
  done
  grep -q "backend gloo" "$out/coll.0.log" || fail "rank 0 did not run on gloo"
  grep -q "all results correct" "$out/coll.0.log" || fail "not every result was correct"
  ;;

train)
  args=(--dtype float64 --steps 20 --log-interval 10 --batch 8 --seq 32)
  BULKHEAD_BACKEND=gloo "$mpirun" --oversubscribe -x BULKHEAD_BACKEND -np 4 "$bin/train_moe" "${args[@]}" \
    --loss-log "$out/mpirun.loss" >"$out/mpirun.log" 2>&1 || fail "train_moe under mpirun failed"
  loop train 4 "0 1 2 3" -- "$bin/train_moe" "${args[@]}" --loss-log "$out/loop.loss"
  read -r code _ <"$out/train.0.rc"
  [ "$code" = 0 ] || fail "train_moe started by the loop exited $code"
  [ "$(wc -l <"$out/loop.loss")" = 20 ] || fail "the loop's run logged $(wc -l <"$out/loop.loss") steps, not 20"
  cmp "$out/mpirun.loss" "$out/loop.loss" || fail "the losses differ between mpirun and the loop"
  echo "20 steps: the same losses bitwise under mpirun and the loop"

  # Saved under mpirun at step 10, resumed by the loop; and the reverse.
  BULKHEAD_BACKEND=gloo "$mpirun" --oversubscribe -x BULKHEAD_BACKEND -np 4 "$bin/train_moe" "${args[@]}" \
    --stop-after 10 --ckpt-dir "$out/a" --loss-log "$out/a.loss" >"$out/a1.log" 2>&1 || fail "save under mpirun"
  loop resume_a 4 "0 1 2 3" -- "$bin/train_moe" "${args[@]}" --ckpt-dir "$out/a" --resume latest \
    --loss-log "$out/a.loss"
  loop save_b 4 "0 1 2 3" -- "$bin/train_moe" "${args[@]}" --stop-after 10 --ckpt-dir "$out/b" \
    --loss-log "$out/b.loss"
  BULKHEAD_BACKEND=gloo "$mpirun" --oversubscribe -x BULKHEAD_BACKEND -np 4 "$bin/train_moe" "${args[@]}" \
    --ckpt-dir "$out/b" --resume latest --loss-log "$out/b.loss" >"$out/b2.log" 2>&1 || fail "resume under mpirun"
  cmp "$out/mpirun.loss" "$out/a.loss" || fail "mpirun save -> loop resume: losses differ from the straight run"
  cmp "$out/mpirun.loss" "$out/b.loss" || fail "loop save -> mpirun resume: losses differ from the straight run"
  echo "checkpoints move between the launchers both ways on the same losses"
  ;;

faults)
  export BULKHEAD_INIT_TIMEOUT=5
  prog=("$bin/bulkhead-collectives" --iters 1 --sizes 4K)
  # The bound is the init deadline + 2 s from the process's start: the time 4 processes take to start and
  # exit together on this machine (--help, libtorch loaded), at least 0.5 s, is added to it.
  loop startup 4 "0 1 2 3" -- "$bin/bulkhead-collectives" --help
  start_ms=500
  for i in 0 1 2 3; do
    read -r _ ms <"$out/startup.$i.rc"
    [ "$ms" -le "$start_ms" ] || start_ms=$ms
  done
  bound=$((7000 + start_ms))
  echo "4 processes start and exit in $start_ms ms here: each may take up to $bound ms"
  # check <name> <count> <regex every started rank's log must match>
  check() {
    local name=$1 count=$2 want=$3
    for ((i = 0; i < count; i++)); do
      read -r code ms <"$out/$name.$i.rc"
      echo "$name: process $i exited $code after $ms ms"
      [ "$code" != 0 ] || fail "$name: process $i exited 0"
      [ "$code" != 124 ] || fail "$name: process $i hung until timeout(1) killed it"
      [ "$ms" -le "$bound" ] || fail "$name: process $i took $ms ms, over the 5 s init deadline + 2 s (+$start_ms ms start)"
      grep -Eq "$want" "$out/$name.$i.log" || fail "$name: process $i does not say /$want/"
    done
  }
  loop missing 4 "0 1 2" -- "${prog[@]}"
  check missing 3 "rank 3 did not join the store"

  loop twice 4 "0 1 1 2" -- "${prog[@]}"
  check twice 4 "two processes claim rank 1"

  RANK_3_ENV="WORLD_SIZE=5" loop size 4 "0 1 2 3" -- "${prog[@]}"
  check size 4 "started with WORLD_SIZE=(4|5), but rank [0-3] has (4|5)"

  RANK_2_ENV="BULKHEAD_STORE_TOKEN=wrong" loop token 4 "0 1 2 3" -- "${prog[@]}"
  check token 4 "token|rank 2 did not join"
  grep -q "token" "$out/token.2.log" || fail "the rank with the wrong token is not told so"

  TOKEN="" loop notoken 2 "0 1" -- "${prog[@]}"
  check notoken 2 "BULKHEAD_STORE_TOKEN is not set"
  ;;
outside)
  export BULKHEAD_STORE_TOKEN=outside-token TOKEN=outside-token
  start_outside_store "$bin" "$out/store.log"
  for run in first second; do
    export BULKHEAD_RUN_ID=$run
    loop "coll_$run" 4 "0 1 2 3" -- "$bin/bulkhead-collectives" --iters 2 --sizes 4K,1M
    for i in 0 1 2 3; do
      read -r code _ <"$out/coll_$run.$i.rc"
      [ "$code" = 0 ] || fail "run $run: rank $i exited $code"
    done
    grep -q "all results correct" "$out/coll_$run.0.log" || fail "run $run: not every result was correct"
  done
  export BULKHEAD_RUN_ID=third
  "$mpirun" --oversubscribe -np 4 "$bin/bulkhead-collectives" --iters 2 --sizes 4K \
    >"$out/mpirun.log" 2>&1 || fail "the run under mpirun failed"
  grep -q "all results correct" "$out/mpirun.log" || fail "under mpirun: not every result was correct"
  echo "three runs, two started by the loop and one by mpirun, through one store outside the job"
  (
    unset BULKHEAD_RUN_ID
    export BULKHEAD_INIT_TIMEOUT=5
    loop norun 2 "0 1" -- "$bin/bulkhead-collectives" --iters 1 --sizes 4K
  )
  for i in 0 1; do
    read -r code _ <"$out/norun.$i.rc"
    [ "$code" != 0 ] || fail "a run without a run id: rank $i exited 0"
    grep -q "no run id is" "$out/norun.$i.log" || fail "a run without a run id: rank $i does not say so"
  done
  kill -0 "$store" 2>/dev/null || fail "bulkhead-store did not outlive the runs"
  kill -TERM "$store"
  wait "$store"
  code=$?
  store=
  [ "$code" = 0 ] || fail "bulkhead-store exited $code on SIGTERM"

  # The store killed mid-training: the collectives need no store, so training
  # goes on to its end; each rank says once that the store process is gone.
  start_outside_store "$bin" "$out/store2.log"
  export BULKHEAD_RUN_ID=fourth
  "$mpirun" --oversubscribe -np 4 "$bin/train_moe" --steps 150 --log-interval 50 >"$out/train.log" 2>&1 &
  job=$!
  for _ in $(seq 300); do grep -q "step .* | loss" "$out/train.log" && break; sleep 0.1; done
  grep -q "step .* | loss" "$out/train.log" || fail "training through the outside store did not start"
  kill -KILL "$store"
  wait "$store" 2>/dev/null
  store=
  wait "$job" || fail "training ended non-zero after the store was killed"
  grep -q "^step   150 " "$out/train.log" || fail "training did not reach its last step"
  [ "$(grep -c "did the bulkhead-store process exit" "$out/train.log")" -ge 1 ] ||
    fail "no rank names the bulkhead-store process once it is gone"
  echo "training went on to its end after the store outside the job was killed"
  ;;
*)
  echo "unknown mode $mode"
  exit 2
  ;;
esac
echo PASS
