#!/usr/bin/env bash
# The pipeline bubble of parallel::Pipeline, and what a pipeline costs train_moe, in one command:
# (a) bulkhead-pipeline-bench at P = 2 and 4 ranks (every GPU when there are 3), V = 1 (1F1B) and 2
#     (interleaved), M = 4P: the first stage's idle fraction beside the ideal (P - 1) / (V M + P - 1),
#     and a Chrome trace of each configuration's last timed run, one file a rank;
# (b) on 4 GPUs, train_moe at one global batch as pp 2 x ep 2 (8 micro-batches through 1F1B) and as
#     ep 2 x dp 2 (1 micro-batch), and the ratio of their tokens per second at the last step.
#   bench/run_pipeline_bench.sh [build-dir, default $BUILD or build] [out-file] [trace folder, default <out-file>_traces]
# Env: BATCH (train_moe's global batch, default 256), STEPS (default 60); MPIRUN_ARGS (extra mpirun flags);
# BULKHEAD_COMMIT (the commit to name, where this copy's git is stale). Exits 77 with fewer than 2 GPUs.
set -euo pipefail
build=${1:-${BUILD:-build}}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "run_pipeline_bench.sh: skipped: a pipeline needs at least 2 GPUs, nvidia-smi lists ${gpus:-0}" >&2
  exit 77
fi
listing=$(nvidia-smi -L)
gpu=$(head -1 <<<"$listing" | sed 's/^GPU 0: //; s/ (UUID.*//')
model=$(awk 'match($0, /[ABHL][0-9][0-9][0-9]?/) { print tolower(substr($0, RSTART, RLENGTH)); exit }' <<<"$gpu")
day=$(date -u +%Y-%m-%d)
out=${2:-bench/results/pipeline_${model:-gpu}x${gpus}_${day}.md}
traces=${3:-${out%.md}_traces}
batch=${BATCH:-256}
steps=${STEPS:-60}
commit=${BULKHEAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
read -ra mpirun_args <<<"${MPIRUN_ARGS:-}"
for binary in bulkhead-pipeline-bench train_moe; do
  [ -x "$build/bin/$binary" ] || { echo "run_pipeline_bench.sh: no $build/bin/$binary: build it first (a build with NCCL)" >&2; exit 1; }
done
mkdir -p "$traces" "$(dirname "$out")"

# run_or_fail <what> <command...>: its output (stdout and stderr) in $log; stops the script if it fails.
run_or_fail() {
  local what=$1
  shift
  echo "+ $*" >&2
  log=$("$@" 2>&1) || { echo "run_pipeline_bench.sh: $what failed (exit $?); its last lines:" >&2; tail -30 <<<"$log" >&2; exit 1; }
}
# field <prefix>: the bench's line starting with <prefix>, or a failure naming it.
field() {
  local line
  line=$(grep -m1 -- "^$1" <<<"$log" || true)
  [ -n "$line" ] || { echo "run_pipeline_bench.sh: no line starting with '$1' in the output:" >&2; tail -30 <<<"$log" >&2; exit 1; }
  echo "$line"
}

# (a) The bubble.
sizes=2
if [ "$gpus" -gt 2 ]; then sizes="2 $((gpus < 4 ? gpus : 4))"; fi
header="" rows=() details=()
for p in $sizes; do
  for v in 1 2; do
    run_or_fail "bulkhead-pipeline-bench at P=$p V=$v" \
      mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np "$p" "$build/bin/bulkhead-pipeline-bench" \
      --vpp "$v" --microbatches $((4 * p)) --trace "$traces/pipeline_p${p}_v${v}.json"
    row=$(field '| [0-9]')
    config=$(field 'bulkhead-pipeline-bench:')
    idle=$(field 'idle fraction per rank')
    [ -n "$header" ] || header=$(grep -A1 -m1 '^| P |' <<<"$log")
    rows+=("$row")
    details+=("- P=$p V=$v: $config; $idle")
    echo "$row"
    echo "  $idle"
  done
done

# (b) train_moe with and without a pipeline, on 4 GPUs, at one global batch.
shape="--backend nccl --dtype bfloat16 --layers 8 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 --seq 1024 --batch $batch --steps $steps --warmup 10 --log-interval $((steps / 3))"
# at_last_step <unit>: the number before <unit> ("tok/s", "ms") on train_moe's log line of the last step.
at_last_step() {
  local value
  value=$(awk -v s="$steps" -v unit="$1" '$1 == "step" && $2 == s { for (i = 3; i < NF; ++i) if ($(i + 1) == unit) { print $i; exit } }' <<<"$log")
  [ -n "$value" ] || { echo "run_pipeline_bench.sh: train_moe printed no '$1' at step $steps:" >&2; tail -30 <<<"$log" >&2; exit 1; }
  echo "$value"
}
train_rows=() ratio_line=""
if [ "$gpus" -ge 4 ]; then
  declare -A tokens
  for layout in "pp2xep2:--pp 2 --ep 2 --microbatches 8" "ep2xdp2:--ep 2 --microbatches 1"; do
    name=${layout%%:*} flags=${layout#*:}
    run_or_fail "train_moe $flags" \
      mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np 4 "$build/bin/train_moe" $shape $flags
    tokens[$name]=$(at_last_step tok/s)
    step_ms=$(at_last_step ms)
    train_rows+=("| $name | \`$flags\` | ${tokens[$name]} | $step_ms |")
    echo "${train_rows[-1]}"
  done
  ratio_line="pp2xep2 / ep2xdp2 tokens per second: $(awk -v a="${tokens[pp2xep2]}" -v b="${tokens[ep2xdp2]}" 'BEGIN { printf "%.3f", a / b }')"
  echo "$ratio_line"
else
  echo "train_moe comparison skipped: it needs 4 GPUs, this machine has $gpus" >&2
fi

{
  echo "# The pipeline bubble of parallel::Pipeline"
  echo
  echo "- Command: \`bench/run_pipeline_bench.sh $build $out $traces\` (BATCH=$batch, NCCL_NVLS_ENABLE=0)"
  echo "- Machine: $gpu; $gpus GPUs"
  echo "- Date: $day"
  echo "- Commit: \`$commit\`"
  echo
  echo "## The bubble (bulkhead-pipeline-bench)"
  echo
  echo "One rank a GPU, the whole world one pp group; every chunk 8 MLP blocks \`x = x + gelu(x @ W1) @ W2\`"
  echo "(bf16, 4096 tokens, hidden 2048, ffn 8192), M = 4P micro-batches. Each step's compute timed with CUDA"
  echo "events on the default stream; the first stage's idle fraction is 1 - its busy time over the span from its"
  echo "first step's start to its last step's end; ideal (P - 1) / (V M + P - 1). Medians of 10 runs after 3"
  echo "warm-up. Traces of the last timed run (one file a rank, chrome://tracing or Perfetto): \`$traces\`."
  echo
  echo "$header"
  printf '%s\n' "${rows[@]}"
  echo
  printf '%s\n' "${details[@]}"
  echo
  echo "## train_moe with and without a pipeline, 4 GPUs"
  echo
  if [ ${#train_rows[@]} -gt 0 ]; then
    echo "\`mpirun -np 4 $build/bin/train_moe $shape\` plus the layout's flags; tokens per second and step"
    echo "time of the last log line (the last third of the steps)."
    echo
    echo "| layout | flags | tok/s (step $steps) | step ms |"
    echo "|---|---|---:|---:|"
    printf '%s\n' "${train_rows[@]}"
    echo
    echo "$ratio_line"
  else
    echo "Skipped: it needs 4 GPUs, this machine has $gpus."
  fi
} >"$out"
echo "wrote $out and the traces in $traces"
