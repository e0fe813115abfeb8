#!/usr/bin/env bash
# train_moe at tp 2, and tp 4 where the machine has 4 GPUs, in bf16 at the GPU
# shape, with its tensor-parallel sums on NCCL and through peer memory
# (BULKHEAD_PEER_ALL_REDUCE=tp,expert-tp with BULKHEAD_PEER_ALL_REDUCE_BYTES=PEER_BYTES,
# default 64M so that every one of them takes the path), in alternating
# rounds. Reports the mean |loss difference| over the steps (the same data
# and seed: the curves must agree to bf16 rounding) and tokens/s.
#   bench/run_peer_train_bench.sh [bin dir] [out file]     ROUNDS=2 STEPS=200 PEER_BYTES=64M
set -euo pipefail
bin=${1:-build/bin}
out=${2:-bench/results/peer_train_$(date +%Y-%m-%d).md}
rounds=${ROUNDS:-2} steps=${STEPS:-200} peer_bytes=${PEER_BYTES:-64M}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 2 ] || { echo "needs 2 GPUs or more (found ${gpus:-0})" >&2; exit 1; }
bytes=$(numfmt --from=iec "$peer_bytes")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run <tp> <nccl|peer> <round>: one run; prints its tokens/s, leaves its losses in $work.
run() {
  local tp=$1 path=$2 round=$3 env=()
  [ "$path" = peer ] && env=(-x BULKHEAD_PEER_ALL_REDUCE=tp,expert-tp -x BULKHEAD_PEER_ALL_REDUCE_BYTES="$bytes")
  local log=$work/$path.tp$tp.r$round
  rm -f "$log.loss"
  mpirun --oversubscribe -np "$tp" -x NCCL_NVLS_ENABLE "${env[@]}" "$bin/train_moe" --backend nccl --dtype bfloat16 \
    --tp "$tp" --layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 --seq 1024 --batch 16 \
    --steps "$steps" --warmup 20 --log-interval "$((steps / 2))" --loss-log "$log.loss" >"$log.out" 2>&1 ||
    { tail -20 "$log.out" >&2; echo "train_moe at tp $tp ($path) failed" >&2; exit 1; }
  [ "$path" = nccl ] || grep -q "go through peer memory" "$log.out" ||
    { echo "tp $tp: the peer path was not taken:" >&2; grep -i "peer" "$log.out" >&2; exit 1; }
  grep -o '[0-9.]* tok/s' "$log.out" | tail -1 | cut -d' ' -f1
}
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

{
  echo "# train_moe's tensor-parallel sums through peer memory beside NCCL"
  echo
  echo "- Command: \`ROUNDS=$rounds STEPS=$steps PEER_BYTES=$peer_bytes bench/run_peer_train_bench.sh\`"
  echo "- Machine: $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "- Model: train_moe bf16, 4 layers, hidden 1024, 8 heads, 16 experts top-2, ffn 512, 16 sequences of 1,024"
  echo
  echo "| tp | NCCL tok/s, each round | peer tok/s, each round | peer / NCCL (medians) | mean \|Δloss\| over $steps steps |"
  echo "|---:|---|---|---:|---:|"
} >"$out"
for tp in 2 4; do
  [ "$gpus" -ge "$tp" ] || continue
  nccl="" peer=""
  for ((r = 1; r <= rounds; r++)); do
    nccl="$nccl $(run "$tp" nccl "$r")"
    peer="$peer $(run "$tp" peer "$r")"
  done
  delta=$(paste "$work/nccl.tp$tp.r1.loss" "$work/peer.tp$tp.r1.loss" |
    awk '$1 == $4 { d = $2 - $5; s += d < 0 ? -d : d; n++ } END { if (n) printf "%.5f", s / n; else print "-" }')
  ratio=$(awk -v a="$(echo "$peer" | median)" -v b="$(echo "$nccl" | median)" 'BEGIN { printf "%.3f", a / b }')
  echo "| $tp |$nccl |$peer | $ratio | $delta |" >>"$out"
done
cat "$out"
