#!/usr/bin/env bash
# One case of the GPU fault matrix: train_moe in bf16 on every GPU (2 to 8
# ranks, ep 2) with checkpoints every 5 steps; one rank stops itself (SIGSTOP)
# or kills itself (SIGKILL) at a chosen moment. The case passes when
#   - every survivor names the culprit within the deadline + 2 s of the fault
#     (the store's host when it is rank 0),
#   - every survivor exits with code 3 within BULKHEAD_SHUTDOWN_TIMEOUT +
#     BULKHEAD_ABORT_GRACE + 2 s of its error,
#   - a stopped rank, continued once the survivors are gone, says it was not
#     running and exits,
#   - no process of the job is left, and
#   - `latest` verifies and training resumes from it.
# Skipped (exit 77) with fewer than 2 GPUs. Prints one RESULT line for
# bench/run_fault_matrix.sh.
# usage: gpu_fault_matrix.sh <mpirun|store> <stop|kill> <victim rank> <a2a|rs|ckpt|pp|graph> <bin dir> <mpirun>
#   a2a   an expert-parallel all-to-all (ep group), rs a data-parallel
#         reduce-scatter (dp-cp group), ckpt halfway through writing the rank's
#         file of an asynchronous save, pp a pipeline send (pp 2, ep 2 from 4
#         ranks, 1F1B over 4 micro-batches; not in the matrix yet: a survivor
#         with no group holding the culprit names the live rank it waits on), graph
#         a data-parallel reduce-scatter of a step captured in a CUDA graph
#         (--cuda-graph, capacity 1.25): the victim stops with its replay in
#         flight, and its peers' next replays wait in captured exchanges.
# A victim other than 0 stays other than 0 with fewer ranks (taken modulo the ranks, else the last rank).
set -u
launch=$1 fault=$2 victim=$3 moment=$4 bin=$5 mpirun=$6
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .); fi
ranks=$((gpus > 8 ? 8 : gpus))
# MATRIX_BACKEND=mpi|gloo MATRIX_RANKS=N runs the same case on CPUs (to check the harness itself).
backend=${MATRIX_BACKEND:-nccl} dtype=bfloat16
[ "$backend" = nccl ] || { ranks=${MATRIX_RANKS:-4}; dtype=float32; }
if [ "${ranks:-0}" -lt 2 ]; then
  echo "SKIPPED: the GPU fault matrix needs 2 GPUs or more (found ${gpus:-0})"
  exit 77
fi
v=$((victim % ranks))
[ "$victim" -ne 0 ] && [ "$v" -eq 0 ] && v=$((ranks - 1))
deadline=3 shutdown=3 grace=1
bound=$((shutdown + grace + 2))
[ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
ckpt=$out/ckpt
cleanup() {
  for p in $(pgrep -f -- "--ckpt-dir $ckpt" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] || rm -rf "$out"
}
trap cleanup EXIT
fail() {
  echo "FAIL ($launch $fault rank $v at $moment, $ranks ranks): $*"
  for f in "$out"/rank*.log "$out"/resume.log; do [ -f "$f" ] && { echo "--- $f"; grep -v '| loss' "$f" | tail -12 | cut -c1-600; }; done
  exit 1
}
later() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
within() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }

case $moment in
a2a) export BULKHEAD_FAULT="rank=$v,group=ep,op=all_to_all,seq=200,action=$fault" ;;
rs | graph) export BULKHEAD_FAULT="rank=$v,group=dp-cp,op=reduce_scatter,seq=150,action=$fault" ;;
ckpt) export BULKHEAD_CHECKPOINT_FAULT="rank=$v,step=20,action=$fault" ;;
pp) export BULKHEAD_FAULT="rank=$v,group=pp,op=send,seq=300,action=$fault" ;;
*) fail "unknown moment $moment" ;;
esac
export NCCL_NVLS_ENABLE=0 CI=1 BULKHEAD_BACKEND=$backend BULKHEAD_COLLECTIVE_TIMEOUT=$deadline \
  BULKHEAD_SHUTDOWN_TIMEOUT=$shutdown BULKHEAD_ABORT_GRACE=$grace
layout=(--ep 2)
[ "$moment" = pp ] && layout=(--pp 2 --ep $((ranks >= 4 ? 2 : 1)) --microbatches 4)
[ "$moment" = graph ] && layout=(--ep 2 --capacity 1.25 --cuda-graph)
model=(--dtype $dtype "${layout[@]}" --layers 2 --hidden 256 --heads 4 --ffn 256 --experts 8 --topk 2 --seq 128
  --batch $((4 * ranks)) --log-interval 10 --ckpt-dir "$ckpt" --ckpt-interval 5)

# Each rank's lines stamped with the wall clock; its exit code and time in exit.<rank>.
cat >"$out/rank.sh" <<'EOF'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:-$RANK}
trap '' TERM  # mpirun's SIGTERM to the job's ranks: the rank's own exit is what is measured
stamp() { while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done; }
"$@" > >(stamp >"$OUT_DIR/rank$r.log") 2>&1
code=$?
echo "$code $EPOCHREALTIME" >"$OUT_DIR/exit.$r"
EOF
export OUT_DIR=$out
port=$((20000 + RANDOM % 12000))
if [ "$launch" = mpirun ]; then
  # mpirun ends the other ranks once one exits without MPI_Finalize (as an ending rank does): with
  # SIGTERM, which train_moe takes as a request to stop, and SIGKILL only after a long grace here, so
  # that each rank's own exit is measured.
  timeout 300 "$mpirun" --oversubscribe --mca orte_abort_on_non_zero_status 0 --mca odls_base_sigkill_timeout 30 \
    -np "$ranks" \
    bash "$out/rank.sh" "$bin/train_moe" "${model[@]}" --steps 100000 >"$out/mpirun.log" 2>&1 </dev/null &
else
  for ((r = 0; r < ranks; r++)); do
    env RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      BULKHEAD_STORE_TOKEN=matrix-$$ timeout 300 bash "$out/rank.sh" "$bin/train_moe" "${model[@]}" --steps 100000 \
      </dev/null &
  done
fi

# The ranks' processes, by the rank their launcher gave them.
declare -A pids=()
for _ in $(seq 600); do
  for p in $(pgrep -f -- "--ckpt-dir $ckpt"); do
    [ "$(basename "$(readlink "/proc/$p/exe" 2>/dev/null)")" = train_moe ] || continue
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p;s/^RANK=//p' | head -1)
    [ -n "$r" ] && pids[$r]=$p
  done
  [ "${#pids[@]}" -eq "$ranks" ] && break
  sleep 0.1
done
[ "${#pids[@]}" -eq "$ranks" ] || fail "found ${#pids[@]} of $ranks ranks"

# The moment of the fault: the victim, once it logged the injection, stopped or gone.
faulted=
for _ in $(seq 3000); do
  if ! grep -q "injecting a fault\|BULKHEAD_CHECKPOINT_FAULT" "$out/rank$v.log" 2>/dev/null; then
    [ -f "$out/exit.$v" ] && fail "rank $v ended before its fault"
    sleep 0.02
    continue
  fi
  state=$(awk '{print $3}' "/proc/${pids[$v]}/stat" 2>/dev/null)
  if { [ "$fault" = stop ] && [ "$state" = T ]; } || { [ "$fault" = kill ] && { [ -z "$state" ] || [ "$state" = Z ]; }; }; then
    faulted=$EPOCHREALTIME
    break
  fi
  sleep 0.02
done
[ -n "$faulted" ] || fail "the fault did not fire within 60 s"

# Every survivor ends by itself.
for _ in $(seq $(((deadline + 2 + bound + 10) * 20))); do
  left=0
  for ((r = 0; r < ranks; r++)); do [ "$r" -eq "$v" ] || [ -f "$out/exit.$r" ] || left=1; done
  [ "$left" = 0 ] && break
  sleep 0.05
done
diagnosis=0 ended=0
for ((r = 0; r < ranks; r++)); do
  [ "$r" -eq "$v" ] && continue
  [ -f "$out/exit.$r" ] || fail "rank $r did not end within $((deadline + 2 + bound + 10)) s of the fault"
  read -r code at <"$out/exit.$r"
  # Its first error that names the culprit (a failed save may say first that the store's host is gone).
  if [ "$v" -eq 0 ]; then culprit="rank 0 hosts the store\|did rank 0 exit"; else culprit="rank $v is dead"; fi
  line=$(grep "\[bulkhead $r/$ranks [^]]* ERROR" "$out/rank$r.log" | grep -m1 "$culprit") ||
    fail "rank $r logged no error that names rank $v"
  error=$(echo "$line" | cut -d' ' -f1)
  after=$(later "$error" "$faulted") exit_after=$(later "$at" "$error")
  echo "rank $r: error after $after s, exit $code $exit_after s later: $(echo "$line" | cut -d' ' -f2- | cut -c1-240)"
  within "$after" $((deadline + 2)) || fail "rank $r raised $after s after the fault, over $deadline s + 2 s"
  [ "$code" -eq 3 ] || fail "rank $r exited with code $code, not 3"
  within "$exit_after" "$bound.3" || fail "rank $r exited $exit_after s after its error, over the bound of $bound s"
  diagnosis=$(awk -v a="$after" -v b="$diagnosis" 'BEGIN { print (a > b ? a : b) }')
  ended=$(awk -v a="$(later "$at" "$faulted")" -v b="$ended" 'BEGIN { print (a > b ? a : b) }')
done

# The stopped rank, continued, says it was not running and ends.
frozen=-
if [ "$fault" = stop ]; then
  continued=$EPOCHREALTIME
  kill -CONT "${pids[$v]}"
  for _ in $(seq $(((deadline + bound + 20) * 20))); do [ -f "$out/exit.$v" ] && break; sleep 0.05; done
  [ -f "$out/exit.$v" ] || fail "the continued rank $v did not end within $((deadline + bound + 20)) s"
  read -r code at <"$out/exit.$v"
  frozen=$(later "$at" "$continued")
  echo "rank $v (continued): exit $code $frozen s later"
  grep -q "was not running for" "$out/rank$v.log" || fail "the continued rank $v does not say it was not running"
  [ "$code" -ne 0 ] || fail "the continued rank $v exited 0"
fi
sleep 1
left=$(pgrep -f -- "--ckpt-dir $ckpt" | while read -r p; do
  [ "$(basename "$(readlink "/proc/$p/exe" 2>/dev/null)")" = train_moe ] && echo "$p"
done)
[ -z "$left" ] || fail "processes of the job are left: $left"
pkill -f -- "-np $ranks bash $out/rank.sh" 2>/dev/null  # mpirun may linger once every rank is gone
wait 2>/dev/null

# `latest` is whole and training resumes from it.
"$bin/bulkhead-ckpt" verify "$ckpt" --step latest >"$out/verify.log" 2>&1 || fail "latest does not verify: $(tail -3 "$out/verify.log")"
step=$("$bin/bulkhead-ckpt" list "$ckpt" | awk '/\(latest\)/ {print $2}')
[ -n "$step" ] || fail "no latest checkpoint"
unset BULKHEAD_FAULT BULKHEAD_CHECKPOINT_FAULT
timeout 120 "$mpirun" --oversubscribe -np "$ranks" "$bin/train_moe" "${model[@]}" --steps 100000 \
  --stop-after $((step + 2)) --resume latest >"$out/resume.log" 2>&1 || fail "resuming from step $step failed"
grep -q "resumed from" "$out/resume.log" || fail "the resumed run does not say it resumed"
echo "RESULT | $launch | $fault | $v | $moment | $ranks | $diagnosis | $ended | $frozen | $step |"
echo PASS
