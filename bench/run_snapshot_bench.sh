#!/usr/bin/env bash
# The cost of recovery's snapshots (launch/snapshot.h) on one GPU: train_moe in
# bf16 at the README's GPU shape without spares, and with one spare process, so
# that the rank takes a snapshot every N steps (a device copy downloaded behind
# the training), and in place every step, in alternating rounds. Each run's
# step time is the mean over the steps after the first 60; each
# configuration's cost is the median of its rounds beside the median of the
# runs without spares. "spare" has the spare but takes no snapshot after the
# first: what recovery's machinery costs without snapshots. Runs differ by
# more than a few percent on a shared machine, so each run also reports its
# own cost: the training stream's time in a snapshot (train_moe's
# "snapshots:" line), over N steps of that run; the host's time in each is
# printed beside it.
#   bench/run_snapshot_bench.sh [bin dir]     ROUNDS=3 STEPS=200 EVERY="1 2 4 8" IN_PLACE=1
set -euo pipefail
bin=${1:-build/bin}
rounds=${ROUNDS:-3} steps=${STEPS:-200} every=${EVERY:-1 2 4 8} in_place=${IN_PLACE:-1}
export NCCL_NVLS_ENABLE=0 BULKHEAD_STORE_TOKEN=snapshot-bench
args=(--backend nccl --dtype bfloat16 --layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2
  --seq 1024 --batch 16 --steps "$steps" --warmup 20 --log-interval 20)
out=$(mktemp -d) store=
cleanup() {
  [ -n "$store" ] && kill "$store" 2>/dev/null
  rm -rf "$out"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
. "$(dirname "$0")/../tests/launch/outside_store.sh"
start_outside_store "$bin" "$out/store.log"

# step_ms <log>: the mean of the step times the log reports after step 60.
step_ms() {
  awk '/^step/ && $2 > 60 { for (i = 2; i <= NF; i++) if ($i == "ms") { s += $(i - 1); n++; break } }
       END { if (n) printf "%.3f", s / n }' "$1"
}
# run <name> [train_moe flags]: one run; "plain" has no spare. Prints its step time.
run() {
  local name=$1 size=2 spare=
  shift
  [ "$name" = plain ] && size=1
  local id="$name.$RANDOM"
  if [ "$size" = 2 ]; then
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 BULKHEAD_RUN_ID=$id \
      "$bin/train_moe" "${args[@]}" "$@" >"$out/spare.log" 2>&1 &
    spare=$!
  fi
  RANK=0 WORLD_SIZE=$size LOCAL_RANK=0 LOCAL_WORLD_SIZE=$size BULKHEAD_RUN_ID=$id \
    "$bin/train_moe" "${args[@]}" "$@" >"$out/$name.log" 2>&1 || {
    tail -5 "$out/$name.log" >&2
    fail "$name did not train"
  }
  [ -z "$spare" ] || wait "$spare" || fail "the spare of $name ended badly: $(tail -2 "$out/spare.log")"
  local ms stream host
  ms=$(step_ms "$out/$name.log")
  stream=$(sed -n 's/.* \([0-9.]*\) ms each on the training stream.*/\1/p' "$out/$name.log" | tail -1)
  host=$(sed -n 's/.* \([0-9.]*\) ms each on the host.*/\1/p' "$out/$name.log" | tail -1)
  echo "$ms ${stream:--} ${host:--}"
}

configs=(plain spare)
for n in $every; do configs+=("every$n"); done
[ "$in_place" = 1 ] && configs+=(inplace)
declare -A times own
for ((r = 1; r <= rounds; r++)); do
  for c in "${configs[@]}"; do
    case $c in
      plain) read -r t stream host < <(run plain) ;;
      spare) read -r t stream host < <(run spare --spares 1 --snapshot-every 1000000) ;;
      inplace) read -r t stream host < <(run inplace --spares 1 --snapshot-every 1 --snapshot-in-place) ;;
      *) read -r t stream host < <(run "$c" --spares 1 --snapshot-every "${c#every}") ;;
    esac
    [ -n "$t" ] || fail "$c: no step time (round $r)"
    times[$c]="${times[$c]:-} $t"
    n=${c#every}
    if [ "$stream" != - ] && [ "$n" != "$c" ]; then
      own[$c]="${own[$c]:-} $(awk -v s="$stream" -v n="$n" -v t="$t" 'BEGIN { printf "%.3f", 100 * s / (n * t) }')"
    fi
    echo "round $r: $c $t ms a step, ${stream} ms a snapshot on the training stream, ${host} ms on the host"
  done
done
grep -ho "snapshots of .*" "$out"/every*.log 2>/dev/null | head -1 || true
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
base=$(echo "${times[plain]}" | median)
echo
echo "| configuration | step ms, each round | median | cost beside no spares | own cost, each round (% a step) |"
echo "|---|---|---:|---:|---|"
for c in "${configs[@]}"; do
  m=$(echo "${times[$c]}" | median)
  echo "| $c |${times[$c]} | $m | $(awk -v m="$m" -v b="$base" 'BEGIN { printf "%+.2f%%", 100 * (m / b - 1) }') |${own[$c]:-} |"
done
