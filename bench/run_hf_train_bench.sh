#!/usr/bin/env bash
# train_moe on a Qwen3-MoE at Qwen3-30B-A3B's layer shape (its published config.json, 4 layers: hidden 2048,
# 32 heads / 4 kv heads, head_dim 128, 128 experts top-8, expert hidden 768, vocabulary 151,936) on one GPU,
# beside the same architecture in plain PyTorch (eager and torch.compile) and transformers' own
# Qwen3MoeForCausalLM training step (eager and compiled), in one command. Every run: bf16, random weights,
# uniformly random token ids, AdamW, clipping at 1.0; Bulkhead also with --recompute and with --moment-dtype bfloat16.
#   bench/run_hf_train_bench.sh [build-dir] [out-file]
# Env: STEPS (default 20; the second half is measured), SEQ (4096), BATCH (2), LAYERS (4),
#      COMMIT (the commit to record; default git's HEAD), RAW (a folder for each part's figures; default a
#      temporary one), ONLY (bulkhead or references: run that part alone into RAW; the table is written once
#      RAW holds both).
# Every run starts from the same kind of weights (normal, std 0.02) with the same peak learning rate, 3e-4.
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/hf_train_$(date +%Y%m%d).md}
steps=${STEPS:-20} seq=${SEQ:-4096} batch=${BATCH:-2} layers=${LAYERS:-4}
export NCCL_NVLS_ENABLE=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
raw=${RAW:-$work/raw}
mkdir -p "$raw"
python3 - tests/models/fixtures/hf/configs/qwen3_30b_a3b.json "$work/config.json" "$layers" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["num_hidden_layers"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY

# train_moe's figures over the second half of its steps: "tok/s step_ms TFLOP/s MFU peak_GiB".
bulkhead() {
  local log
  log=$("$build/bin/train_moe" --model-config "$work/config.json" --dtype bfloat16 --seq "$seq" --batch "$batch" \
    --steps "$steps" --warmup 5 --lr 3e-4 --log-interval $((steps / 2)) --data-path "$work/ids" --split 100,0,0 \
    --data-cache-path "$work/cache" "$@" 2>&1) ||
    { echo "train_moe failed:" >&2; echo "$log" | tail -20 >&2; exit 1; }
  echo "$log" | grep -E '^step|peak device' | tail -3 >&2
  local line
  line=$(grep '^step' <<<"$log" | tail -1)
  echo "$(grep -o '[0-9.]* tok/s' <<<"$line" | cut -d' ' -f1) $(grep -o 'step *[0-9.]* ms' <<<"$line" | grep -o '[0-9.]*') \
$(grep -o '[0-9.]* TFLOP/s' <<<"$line" | cut -d' ' -f1) $(grep -o 'MFU [0-9.]*' <<<"$line" | cut -d' ' -f2) \
$(grep -o 'peak device memory [0-9.]*' <<<"$log" | grep -o '[0-9.]*$')"
}
if [ "${ONLY:-bulkhead}" = bulkhead ]; then
  echo "$(date +%T) Bulkhead"
# Uniformly random ids, documents of 64k tokens, enough for every step.
python3 - "$work/ids.jsonl" $(((steps + 2) * batch * (seq + 1) / 65536 + 1)) <<'PY'
import random, sys
rng = random.Random(1)
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        f.write("[" + ",".join(str(rng.randrange(151936)) for _ in range(65536)) + "]\n")
PY
"$build/bin/bulkhead-data" convert "$work/ids.jsonl" --out "$work/ids" --vocab 151936 >/dev/null
  bulkhead >"$raw/plain.txt"
  bulkhead --recompute >"$raw/recompute.txt"
  bulkhead --moment-dtype bfloat16 >"$raw/bf16_moments.txt"
fi
if [ "${ONLY:-references}" = references ]; then
  echo "$(date +%T) references"
  python3 bench/torch_qwen3_moe.py "$work/config.json" --seq "$seq" --batch "$batch" --steps "$steps" \
    --lr 3e-4 | tee "$raw/references.txt"
  python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' >"$raw/versions.txt"
fi
echo "$(date +%T) done"
for part in plain recompute bf16_moments references versions; do [ -s "$raw/$part.txt" ] || exit 0; done
read -r b_tok b_ms b_tflops b_mfu b_peak <"$raw/plain.txt"
read -r r_tok r_ms r_tflops r_mfu r_peak <"$raw/recompute.txt"
read -r m_tok m_ms m_tflops m_mfu m_peak <"$raw/bf16_moments.txt"
read -r torch_version transformers_version <"$raw/versions.txt"
references=$(cat "$raw/references.txt")
flops_per_token=$(awk -v t="$b_tflops" -v s="$b_tok" 'BEGIN { printf "%.6g", t * 1e12 / s }')
gpu=$(nvidia-smi -L | head -1 | sed 's/^GPU 0: //; s/ (UUID.*//')
row() {  # row <name> <tok/s> <step ms> <peak GiB>
  awk -v n="$1" -v t="$2" -v ms="$3" -v p="$4" -v f="$flops_per_token" -v b="$b_tok" 'BEGIN {
    printf "| %s | %.0f | %.1f | %.1f%% | %.1f | %.2fx |\n", n, t, ms, 100 * t * f / 989e12, p, b / t }'
}
{
  echo "# train_moe at Qwen3-30B-A3B's layer shape beside plain PyTorch and transformers, one GPU"
  echo
  echo "- Command: \`bench/run_hf_train_bench.sh $build $out\` (STEPS=$steps SEQ=$seq BATCH=$batch LAYERS=$layers; the second half measured)"
  echo "- Machine: $gpu ($(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) driver), $(nproc) CPU cores;" \
    "PyTorch $torch_version, transformers $transformers_version"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}\`"
  echo "- Model: tests/models/fixtures/hf/configs/qwen3_30b_a3b.json with $layers layers, random weights, bf16;"
  echo "  sequence $seq, $batch sequences a step, uniformly random token ids. Bulkhead: \`train_moe --model-config\`"
  echo "  (bf16 weights, fp32 master weights and AdamW moments; bf16 moments with --moment-dtype bfloat16). The references: bench/torch_qwen3_moe.py (bf16 weights,"
  echo "  fused AdamW in bf16). MFU: the model FLOPs train_moe counts ($flops_per_token a token) over 989 TFLOP/s."
  echo
  echo "| run | tokens/s | step ms | MFU | peak GiB | Bulkhead is |"
  echo "|---|---:|---:|---:|---:|---:|"
  row "Bulkhead train_moe" "$b_tok" "$b_ms" "$b_peak"
  row "Bulkhead train_moe --recompute" "$r_tok" "$r_ms" "$r_peak"
  row "Bulkhead train_moe --moment-dtype bfloat16" "$m_tok" "$m_ms" "$m_peak"
  while read -r _ mode tok ms peak _; do
    row "$mode" "${tok#*=}" "${ms#*=}" "${peak#*=}"
  done < <(grep '^QWEN3_TRAIN' <<<"$references")
} >"$out"
sed -i 's/^| torch-eager |/| plain PyTorch, eager |/; s/^| torch-compiled |/| plain PyTorch, torch.compile |/;
        s/^| hf-eager |/| transformers Qwen3MoeForCausalLM, eager |/; s/^| hf-compiled |/| transformers Qwen3MoeForCausalLM, torch.compile |/' "$out"
cat "$out"
echo "wrote $out"
