#!/usr/bin/env bash
# CUDA graphs at ep > 1 and tp > 1 beside the same eager steps, on every GPU, in one command:
# - the MoE layer (bf16, 64 experts top-8, hidden 2048, expert hidden 768, capacity 1.25) at ep = every
#   GPU: the captured forward + backward (its capacity-padded exchanges in the graph), the same layer's
#   eager step, and its expert products alone;
# - train_moe (bf16, 4 layers, hidden 1024, 16 experts top-2, capacity 1.25, sequence 1,024, 16 sequences
#   per GPU, 200 steps) at ep = every GPU and at tp 2: eager (the dispatcher's capacity path, gradient
#   reduction overlapped) and --cuda-graph; tokens/s over steps 101-200 and the mean |loss difference|
#   over the 200 steps.
#   bench/run_graph_bench.sh [build-dir] [out-file] [token counts, default "4096 16384"]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/graph_$(date +%Y%m%d).md}
shift $(($# < 2 ? $# : 2))
token_counts=${*:-4096 16384}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
ranks=${NP:-$(nvidia-smi -L | grep -c '^GPU')}
[ "$ranks" -ge 2 ] || { echo "run_graph_bench.sh: ep > 1 needs 2 GPUs or more (found $ranks)"; exit 1; }
value() { awk -v key="$1" '$1 == key {print $2}' <<<"$2"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

layer_rows=()
for tokens in $token_counts; do
  r=$(mpirun --oversubscribe -np "$ranks" "$build/bin/bulkhead-moe-bench" --tokens "$tokens" --hidden 2048 \
    --experts 64 --topk 8 --ffn 768 --capacity 1.25 --graph 2>&1 || true)
  [ -n "$(value STEP_MS "$r")" ] || { echo "bulkhead-moe-bench --graph failed:"; echo "$r" | tail -20; exit 1; }
  g=$(value STEP_MS "$r") e=$(value EAGER_STEP_MS "$r") p=$(value EXPERT_PRODUCTS_MS "$r")
  layer_rows+=("| $tokens | $ranks | $e | $g | $(ratio "$e" "$g") | $p | $(ratio "$g" "$p") | $(ratio "$e" "$p") |")
done

model=(--backend nccl --dtype bfloat16 --layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2
  --capacity 1.25 --seq 1024 --batch $((16 * ranks)) --steps 200 --warmup 20 --log-interval 100)
train() {  # train <name> <flags...>: the tokens/s of steps 101-200; the loss log in $work/<name>
  local name=$1 log
  shift
  log=$(mpirun --oversubscribe -np "$ranks" "$build/bin/train_moe" "${model[@]}" --loss-log "$work/$name" "$@" 2>&1) ||
    { echo "train_moe $* failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
  grep -o '[0-9.]* tok/s' <<<"$log" | tail -1 | cut -d' ' -f1
}
last() { awk 'END { printf "%.4f", $2 }' "$work/$1"; }
mean_diff() { paste -d' ' "$work/$1" "$work/$2" | awk '{ s += ($2 > $5 ? $2 - $5 : $5 - $2); n++ } END { printf "%.4f", s / n }'; }
train_rows=()
layouts=("--ep $ranks")
[ $((ranks % 2)) -eq 0 ] && layouts+=("--tp 2 --ep $((ranks / 2))")
for layout in "${layouts[@]}"; do
  read -ra flags <<<"$layout"
  eager=$(train eager "${flags[@]}")
  fixed=$(train fixed "${flags[@]}" --static-shapes)
  graph=$(train graph "${flags[@]}" --cuda-graph)
  again=$(train again "${flags[@]}")  # the eager run's own spread
  train_rows+=("| $layout | $eager | $fixed | $graph | $(ratio "$graph" "$eager") | $(mean_diff fixed graph) | $(mean_diff eager fixed) | $(mean_diff eager again) | $(last eager) / $(last fixed) / $(last graph) |")
done

{
  echo "# CUDA graphs at ep > 1 and tp > 1"
  echo
  echo "Command: \`bench/run_graph_bench.sh $build $out $token_counts\`"
  echo "Machine: $ranks x $(nvidia-smi -L | head -1 | sed 's/^GPU 0: //; s/ (UUID.*//'), $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "## The MoE layer (forward + backward, bf16, E=64 top-8, H=2048, F=768, capacity 1.25, ep = ranks)"
  echo
  echo "| tokens per rank | ep | eager ms | captured ms | speed-up | expert products ms | captured / products | eager / products |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${layer_rows[@]}"
  echo
  echo "## train_moe (bf16, capacity 1.25, 200 steps; tokens/s over steps 101-200)"
  echo
  echo "Eager: the dispatcher's capacity path with the gradient reduction overlapped. Static: the capacity-padded"
  echo "exchanges (\`--static-shapes\`), eagerly. Captured (\`--cuda-graph\`): the static step's forward and backward"
  echo "replayed, gradients reduced at the optimizer step. Loss differences: mean |Δloss| over the 200 steps between"
  echo "two runs; eager vs eager is the run-to-run spread of one program."
  echo
  echo "| layout | eager tok/s | static tok/s | captured tok/s | captured / eager | \\|Δloss\\| captured vs static | static vs eager | eager vs eager | loss at 200: eager / static / captured |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  printf '%s\n' "${train_rows[@]}"
} >"$out"
cat "$out"
