#!/usr/bin/env bash
# How train_moe reduces its gradients, on N GPUs: 200 steps at the README's GPU shape (4 layers, sequence
# 1,024, 16 sequences per GPU) with the reduce-scatters in float32 during the backward, again (the
# run-to-run spread of the loss), in bf16, and in float32 after the backward; at ep 1 and ep 2. Reports
# tokens/s over steps 101-200 and the mean |loss difference| against the first run of the same ep.
#   bench/run_grad_reduce_bench.sh [build-dir] [out-file] [GPUs, default 4]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/train_grad_reduce_$(date +%Y%m%d).md}
np=${3:-4}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
shape=(--backend nccl --dtype bfloat16 --layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2
  --seq 1024 --batch $((16 * np)) --steps 200 --warmup 20 --log-interval 100)
# run <name> <flags...>: tokens/s of steps 101-200; the losses in $work/<name>.txt
run() {
  local name=$1 log
  shift
  log=$(mpirun -np "$np" --bind-to none "$build/bin/train_moe" "${shape[@]}" --loss-log "$work/$name.txt" "$@" 2>&1) ||
    { echo "train_moe failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
  grep -o '[0-9.]* tok/s' <<<"$log" | tail -1 | cut -d' ' -f1
}
# spread <a> <b>: mean |loss difference| over the steps both logged
spread() {
  python3 - "$work/$1.txt" "$work/$2.txt" <<'PY'
import sys
a, b = ({int(l.split()[0]): float(l.split()[1]) for l in open(p)} for p in sys.argv[1:3])
d = [abs(a[k] - b[k]) for k in a if k in b]
print(f"{sum(d) / len(d):.4f}")
PY
}
rows=()
for ep in 1 2; do
  base=$(run "ep${ep}_fp32" --ep "$ep" --grad-reduce-fp32)
  rows+=("| $ep | float32, during the backward | $base | | |")
  for variant in "again:float32 again:--grad-reduce-fp32" "bf16:bf16:--grad-reduce-bf16" \
    "after:float32, after the backward:--grad-reduce-fp32 --no-grad-overlap"; do
    IFS=: read -r name label flags <<<"$variant"
    # shellcheck disable=SC2086
    t=$(run "ep${ep}_$name" --ep "$ep" $flags)
    rows+=("| $ep | $label | $t | $(awk -v a="$t" -v b="$base" 'BEGIN { printf "%.2f", a / b }') | $(spread "ep${ep}_fp32" "ep${ep}_$name") |")
    echo "${rows[-1]}"
  done
done
{
  echo "# train_moe's gradient reduction on $np GPUs"
  echo
  echo "- Command: \`bench/run_grad_reduce_bench.sh $build $out $np\`"
  echo "- Machine: $np x $(nvidia-smi -L | head -1 | sed 's/^GPU 0: //; s/ (UUID.*//')"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`"
  echo "- 200 steps, bf16, 4 layers, hidden 1024, 16 experts top-2, sequence 1,024, 16 sequences per GPU;"
  echo "  tokens/s over steps 101-200; mean |loss difference| over all 200 steps against the first row of its ep."
  echo
  echo "| ep | reduce-scatter | tokens/s | vs the first row | mean abs loss difference |"
  echo "|---:|---|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
} >"$out"
echo "wrote $out"
