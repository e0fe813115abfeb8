#!/usr/bin/env bash
# train_moe end to end on one GPU beside the same model in PyTorch (bench/torch_train_moe.py), eager and
# torch.compile, in one command. bf16, hidden 1024, 8 heads, 16 experts top-2, expert hidden 512, 16,384
# tokens a step; one row per (layers, sequence length).
#   bench/run_train_bench.sh [build-dir] [out-file] [layers, default "4 8"] [sequence lengths, default "256 1024 4096"]
# Env: STEPS (default 40; the second half is measured), MODES (default "eager,compiled").
#
# Multi-GPU mode (NP=N, N > 1; STEPS default 200): weak scaling at 4 layers, sequence 1,024, 16 sequences per GPU. train_moe
# on one GPU and on N (ep 1, 2 and N; gradient reduction overlapped, and at ep 1 also not), PyTorch under
# DDP (torchrun) on one and on N, eager and compiled; tokens/s, scaling efficiency (N-GPU tokens/s over N
# times the same program's one-GPU figure) and MFU.
#   NP=4 bench/run_train_bench.sh [build-dir] [out-file]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/train_moe_$(date +%Y%m%d).md}
layer_counts=${3:-4 8}
sequences=${4:-256 1024 4096}
steps=${STEPS:-40}
modes=${MODES:-eager,compiled}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
gpu=$(nvidia-smi -L | head -1 | sed 's/^GPU 0: //; s/ (UUID.*//')
case "$gpu" in
  *H100* | *H200* | *H800*) peak=989 ;;
  *A100* | *A800*) peak=312 ;;
  *B200*) peak=2250 ;;
  *) peak=0 ;;
esac
tokens=16384
# The model FLOPs per token of examples/train_moe/model.cc's trainingFlopsPerToken.
flops() { awk -v l="$1" -v s="$2" 'BEGIN { h = 1024; f = 512; printf "%.0f", 3 * (l * (8*h*h + 2*s*h + 2*h*16 + 2*6*h*f) + 2*h*256) }'; }
tflops() { awk -v t="$1" -v f="$2" 'BEGIN { printf "%.1f", t * f / 1e12 }'; }
mfu() { awk -v t="$1" -v f="$2" -v p="$peak" 'BEGIN { if (p > 0) printf "%.1f%%", 100 * t * f / (p * 1e12); else printf "-" }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "-" }'; }
# train_moe's tokens per second over the second half of its steps.
ours() {
  local log
  log=$("$build/bin/train_moe" $1 --dtype bfloat16 --steps "$steps" --warmup 10 --log-interval $((steps / 2)) 2>&1) ||
    { echo "train_moe failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
  grep -o '[0-9.]* tok/s' <<<"$log" | tail -1 | cut -d' ' -f1
}
np=${NP:-1}
if [ "$np" -gt 1 ]; then
  steps=${STEPS:-200}  # the first tens of steps run slower on several GPUs: measure steps 101-200
  shape="--layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 --seq 1024"
  f=$(flops 4 1024)
  # train_moe tokens/s on $1 GPUs with the flags after it.
  ranks() {
    local n=$1 log
    shift
    log=$(mpirun -np "$n" --bind-to none "$build/bin/train_moe" $shape --backend nccl --batch $((16 * n)) "$@" \
      --dtype bfloat16 --steps "$steps" --warmup 10 --log-interval $((steps / 2)) 2>&1) ||
      { echo "train_moe failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
    grep -o '[0-9.]* tok/s' <<<"$log" | tail -1 | cut -d' ' -f1
  }
  torch() {
    local n=$1 ref
    ref=$(python3 -m torch.distributed.run --nproc-per-node "$n" bench/torch_train_moe.py $shape --batch 16 \
      --steps "$steps" --modes "$modes" 2>&1) || { echo "PyTorch reference failed:"; echo "$ref" | tail -20; exit 1; }
    echo "$ref"
  }
  pick() { grep -o "TORCH_TRAIN $1 tokens_per_s=[0-9]*" <<<"$2" | cut -d= -f2 || echo 0; }
  # A row: label, GPUs, tokens/s over all of them, efficiency (MFU per GPU).
  row() {
    rows+=("| $1 | $3 | $4 | $(mfu "$(awk -v t="$3" -v n="$2" 'BEGIN { print t / n }')" "$f") |")
    echo "${rows[-1]}"
  }
  rows=()
  one=$(ranks 1)
  row "train_moe, 1 GPU" 1 "$one" ""
  for ep in 1 2 "$np"; do
    t=$(ranks "$np" --ep "$ep")
    row "train_moe, $np GPUs, ep $ep" "$np" "$t" "$(ratio "$t" "$(awk -v a="$one" -v n="$np" 'BEGIN { print a * n }')")"
    [ "$ep" = 1 ] && best=$t
    [ "$ep" = 1 ] || best=$(awk -v a="$best" -v b="$t" 'BEGIN { print (b > a ? b : a) }')
  done
  t=$(ranks "$np" --ep 1 --no-grad-overlap)
  row "train_moe, $np GPUs, ep 1, reduction after the backward" "$np" "$t" "$(ratio "$t" "$(awk -v a="$one" -v n="$np" 'BEGIN { print a * n }')")"
  ref1=$(torch 1)
  refn=$(torch "$np")
  for mode in ${modes//,/ }; do
    a=$(pick "$mode" "$ref1")
    b=$(pick "$mode" "$refn")
    row "PyTorch $mode, 1 GPU" 1 "$a" ""
    row "PyTorch DDP $mode, $np GPUs" "$np" "$b" "$(ratio "$b" "$(awk -v a="$a" -v n="$np" 'BEGIN { print a * n }')")"
    [ "$mode" = compiled ] && compiled=$b
  done
  {
    echo "# train_moe weak scaling beside PyTorch DDP, $np GPUs"
    echo
    echo "- Command: \`NP=$np STEPS=$steps bench/run_train_bench.sh $build $out\` (the second half of the steps measured)"
    echo "- Machine: $np x $gpu ($(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) driver), PyTorch $(python3 -c 'import torch; print(torch.__version__)')"
    echo "- Date: $(date -u +%Y-%m-%d)"
    echo "- Commit: \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`"
    echo "- Model: bf16, 4 layers, hidden 1024, 8 heads, 16 experts top-2, expert hidden 512, sequence 1,024,"
    echo "  16 sequences per GPU. Efficiency: N-GPU tokens/s over N x the same program's one-GPU tokens/s."
    echo "- train_moe's best $np-GPU figure over PyTorch DDP compiled at $np GPUs: $(ratio "$best" "${compiled:-0}")"
    echo
    echo "| run | tokens/s | efficiency | MFU (per GPU) |"
    echo "|---|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
  } >"$out"
  echo "wrote $out"
  exit 0
fi

rows=()
for layers in $layer_counts; do
  for seq in $sequences; do
    batch=$((tokens / seq))
    shape="--layers $layers --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 --seq $seq --batch $batch"
    before=$(ours "$shape")
    ref=$(python3 bench/torch_train_moe.py $shape --steps "$steps" --modes "$modes" 2>&1) ||
      { echo "PyTorch reference failed:"; echo "$ref" | tail -20; exit 1; }
    after=$(ours "$shape")
    # train_moe runs before and after the reference: their mean, so a drift of the GPU's speed over the
    # row weighs on both sides alike.
    ours=$(awk -v a="$before" -v b="$after" 'BEGIN { printf "%.0f", (a + b) / 2 }')
    eager=$(grep -o 'TORCH_TRAIN eager tokens_per_s=[0-9]*' <<<"$ref" | cut -d= -f2 || true)
    compiled=$(grep -o 'TORCH_TRAIN compiled tokens_per_s=[0-9]*' <<<"$ref" | cut -d= -f2 || true)
    f=$(flops "$layers" "$seq")
    rows+=("| $layers | $seq | $batch | ${ours} ($before, $after) | $(tflops "$ours" "$f") | $(mfu "$ours" "$f") | ${eager:--} | $(mfu "${eager:-0}" "$f") | ${compiled:--} | $(mfu "${compiled:-0}" "$f") | $(ratio "$ours" "${eager:-0}") | $(ratio "$ours" "${compiled:-0}") |")
    echo "${rows[-1]}"
  done
done
{
  echo "# train_moe beside the same model in PyTorch, one GPU"
  echo
  echo "- Command: \`bench/run_train_bench.sh $build $out \"$layer_counts\" \"$sequences\"\` (STEPS=$steps; the second half measured; train_moe runs before and after the reference, the mean reported)"
  echo "- Machine: $gpu ($(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) driver), PyTorch $(python3 -c 'import torch; print(torch.__version__)')"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`"
  echo "- Model: bf16, hidden 1024, 8 heads, 16 experts top-2, expert hidden 512, $tokens tokens a step. Model FLOPs"
  echo "  per token counted alike for both (examples/train_moe/model.cc, trainingFlopsPerToken); MFU against $peak TFLOP/s."
  echo
  echo "| layers | seq | batch | train_moe tok/s (before, after the reference) | TFLOP/s | MFU | PyTorch eager tok/s | MFU | PyTorch compiled tok/s | MFU | vs eager | vs compiled |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
} >"$out"
echo "wrote $out"
