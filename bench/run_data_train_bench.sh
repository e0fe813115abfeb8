#!/usr/bin/env bash
# train_moe's tokens/s on one GPU reading an indexed dataset (Megatron's .bin/.idx, in Megatron's sample
# order) beside the same run on generated text, in one command. The dataset is the repository's
# documentation as bytes, one document a line (what ./dev.sh run trains on); bf16, 4 layers, hidden 1024,
# 8 heads, 16 experts top-2, sequence 1,024, 16 sequences a step. The two sources alternate, twice each.
#   bench/run_data_train_bench.sh [build-dir] [out-file]
# Env: STEPS (default 60; the second half is measured), COMMIT (the commit to record; default git's HEAD).
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/data_train_$(date +%Y%m%d).md}
steps=${STEPS:-60}
export NCCL_NVLS_ENABLE=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/bin/bulkhead-data" convert README.md docs/*.md --format text --per-line --out "$work/docs_text_document" >/dev/null
shape="--layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 --seq 1024 --batch 16"
# train_moe's tokens/s over the second half of its steps, with the flags given.
run() {
  local log
  log=$("$build/bin/train_moe" $shape "$@" --dtype bfloat16 --steps "$steps" --warmup 10 \
    --log-interval $((steps / 2)) 2>&1) || { echo "train_moe failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
  grep -o '[0-9.]* tok/s' <<<"$log" | tail -1 | cut -d' ' -f1
}
dataset=(--data-path "$work/docs_text_document" --split 100,0,0 --data-cache-path "$work/cache")
generated=() indexed=()
for round in 1 2; do
  generated+=("$(run)")
  indexed+=("$(run "${dataset[@]}")")
  echo "round $round: generated ${generated[-1]} tok/s, indexed ${indexed[-1]} tok/s"
done
mean() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", (a + b) / 2 }'; }
g=$(mean "${generated[@]}")
i=$(mean "${indexed[@]}")
ratio=$(awk -v a="$i" -v b="$g" 'BEGIN { printf "%.3f", a / b }')
gpu=$(nvidia-smi -L | head -1 | sed 's/^GPU 0: //; s/ (UUID.*//')
{
  echo "# train_moe on an indexed dataset beside generated text, one GPU"
  echo
  echo "- Command: \`bench/run_data_train_bench.sh $build $out\` (STEPS=$steps; the second half measured; the sources alternate, twice each)"
  echo "- Machine: $gpu ($(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) driver), $(nproc) CPU cores"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}\`"
  echo "- Model: bf16, 4 layers, hidden 1024, 8 heads, 16 experts top-2, expert hidden 512, sequence 1,024, 16 sequences"
  echo "  a step. Dataset: README.md and docs/*.md as bytes, one document a line (bulkhead-data convert --per-line)."
  echo
  echo "| source | tok/s (runs) | mean | vs generated |"
  echo "|---|---:|---:|---:|"
  echo "| generated text | ${generated[0]}, ${generated[1]} | $g | 1.000 |"
  echo "| indexed dataset (--data-path) | ${indexed[0]}, ${indexed[1]} | $i | $ratio |"
} >"$out"
echo "wrote $out"
