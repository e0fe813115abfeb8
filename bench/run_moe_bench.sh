#!/usr/bin/env bash
# The MoE layer, forward + backward, Bulkhead beside a PyTorch reference on
# the same GPUs in one command; and Bulkhead's dispatch + combine beside raw
# NCCL all-to-alls of the same rows. bf16, E=64 experts, top-8, H=2048, F=768.
#   bench/run_moe_bench.sh [build-dir] [out-file] [token counts, default "4096 16384"]
# Env: NP (ranks = ep, default: every GPU); MPIRUN_ARGS (extra mpirun flags, such as a
# binding, given to Bulkhead and the PyTorch reference alike); CAPACITY (the capacity
# factor of one more once-per-rank run per token count, default 1.25; 0: none; on one
# GPU also captured in a CUDA graph, its rows padded and packed). On one GPU the
# dropless layer is captured too.
# Every run also times its own floor: the layer's expert products alone.
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/moe_$(date +%Y%m%d).md}
shift $(($# < 2 ? $# : 2))
token_counts=${*:-4096 16384}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
ranks=${NP:-$(nvidia-smi -L | grep -c '^GPU')}
read -ra mpirun_args <<<"${MPIRUN_ARGS:-}"
sizes="--hidden 2048 --experts 64 --topk 8 --ffn 768"
value() { awk -v key="$1" '$1 == key {print $2}' <<<"$2"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
rows=()
phases=()
floors=()
capacity=${CAPACITY:-1.25}
floor_row() {  # floor_row <tokens> <bench output> <PyTorch step ms>
  floors+=("| $1 | $(value MODE "$2") | $(value CAPACITY "$2") | $(value EXECUTION "$2") | $(value STEP_MS "$2") | $(value EXPERT_PRODUCTS_MS "$2") | $(value STEP_OVER_PRODUCTS "$2") | $(value STEP_TFLOPS "$2") | $(value PRODUCTS_TFLOPS "$2") | $(ratio "$3" "$(value STEP_MS "$2")") |")
}
for tokens in $token_counts; do
  once=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np "$ranks" "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes 2>&1 || true)
  slot=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np "$ranks" "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --per-slot 2>&1 || true)
  torch=$(MASTER_ADDR=127.0.0.1 MASTER_PORT=29650 mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np "$ranks" \
    python3 bench/torch_moe.py --tokens "$tokens" $sizes 2>&1 || true)
  t=$(value TORCH_STEP_MS "$torch")
  [ -n "$t" ] || { echo "PyTorch reference failed:"; echo "$torch" | tail -20; exit 1; }
  if [ "$ranks" -eq 1 ]; then  # dropless at ep 1 keeps its counts on the device: captured as it is
    droplessGraph=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np 1 "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --graph 2>&1 || true)
    [ -n "$(value STEP_MS "$droplessGraph")" ] || { echo "bulkhead-moe-bench --graph (dropless) failed:"; echo "$droplessGraph" | tail -20; exit 1; }
  fi
  if [ "$capacity" != 0 ]; then
    capped=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np "$ranks" "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --capacity "$capacity" 2>&1 || true)
    [ -n "$(value STEP_MS "$capped")" ] || { echo "bulkhead-moe-bench --capacity failed:"; echo "$capped" | tail -20; exit 1; }
    if [ "$ranks" -eq 1 ]; then  # the captured layer has static shapes, at ep 1
      graphed=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np 1 "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --capacity "$capacity" --graph 2>&1 || true)
      [ -n "$(value STEP_MS "$graphed")" ] || { echo "bulkhead-moe-bench --graph failed:"; echo "$graphed" | tail -20; exit 1; }
      packed=$(mpirun --oversubscribe ${mpirun_args[@]+"${mpirun_args[@]}"} -np 1 "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --capacity "$capacity" --graph --packed 2>&1 || true)
      [ -n "$(value STEP_MS "$packed")" ] || { echo "bulkhead-moe-bench --graph --packed failed:"; echo "$packed" | tail -20; exit 1; }
    fi
  fi
  for run in once slot; do
    r=${!run}
    floor_row "$tokens" "$r" "$t"
    s=$(value STEP_MS "$r")
    [ -n "$s" ] || { echo "bulkhead-moe-bench failed:"; echo "$r" | tail -20; exit 1; }
    phases+=("$tokens $(value MODE "$r"): $(grep PHASES_MS <<<"$r"); exchanges (ms each): $(grep DISPATCHER_EXCHANGES <<<"$r" | grep -v _MS | cut -d' ' -f2-)")
    rows+=("| $tokens | $(value MODE "$r") | $s | $t | $(ratio "$t" "$s") | $(value ROWS_SENT "$r") | $(value DISPATCH_COMBINE_MS "$r") | $(value RAW_ALLTOALL_MS "$r") | $(ratio "$(value RAW_ALLTOALL_MS "$r")" "$(value DISPATCH_COMBINE_MS "$r")") | $(value DISPATCHER_EXCHANGES_MS "$r") | $(value RAW_ALLTOALL_EVENTS_MS "$r") | $(ratio "$(value RAW_ALLTOALL_EVENTS_MS "$r")" "$(value DISPATCHER_EXCHANGES_MS "$r")") | $(value EXCHANGE_ONLY_MS "$r") | $(ratio "$(value RAW_ALLTOALL_MS "$r")" "$(value EXCHANGE_ONLY_MS "$r")") | $(value LOCAL_PASSES_FLOOR_MS "$r") | $(value BW_RATIO_BOUND "$r") | $(value MAX_REL_DIFF_VS_EP1 "$r") |")
  done
  [ "$ranks" -ne 1 ] || floor_row "$tokens" "$droplessGraph" "$t"
  [ "$capacity" = 0 ] || floor_row "$tokens" "$capped" "$t"
  [ "$capacity" = 0 ] || [ "$ranks" -ne 1 ] || floor_row "$tokens" "$graphed" "$t"
  [ "$capacity" = 0 ] || [ "$ranks" -ne 1 ] || floor_row "$tokens" "$packed" "$t"
done
{
  echo "# MoE layer: Bulkhead vs a PyTorch reference, and dispatch + combine vs raw NCCL"
  echo
  echo "Command: \`${MPIRUN_ARGS:+MPIRUN_ARGS=\"$MPIRUN_ARGS\" }bench/run_moe_bench.sh $build $out $token_counts\` ($ranks GPUs: $(nvidia-smi -L | head -1 | cut -d'(' -f1), ep $ranks)."
  echo "bf16, $sizes, tokens per rank as listed. Step = forward + backward of the layer (router, aux loss,"
  echo "dispatch, grouped SwiGLU experts, combine), median of 20 after 3 warm-up steps, wall clock with a device sync."
  echo "PyTorch reference: bench/torch_moe.py (argsort permute, all_to_all_single per slot, torch._grouped_mm; gate and up in one product)."
  echo "Dispatch + combine: Bulkhead's dispatch() and combine() (counts, tokens with their routing, results; index work"
  echo "included) against raw ncclSend/ncclRecv of exactly the same rows both ways, same run; bw ratio = raw / ours."
  echo "Dispatcher exchanges: the time inside the collectives of those same dispatch() and combine() calls (counts,"
  echo "tokens with their routing, results; CUDA events around each, summed); exchange ratio = raw / that, the"
  echo "raw round trip timed by CUDA events too (the other raw NCCL column is wall clock, like dispatch+combine)."
  echo "Exchange only: the same rows both ways through Bulkhead's communicator (deadline and ledger, no index work);"
  echo "transport ratio = raw / exchange only."
  echo "Local passes floor: a device copy of the received rows plus the expert rows (rank 0's counts), about the least"
  echo "memory traffic of expanding received rows into expert rows and summing them back; bound = raw / (raw + that"
  echo "floor), about the best bw ratio of a dispatcher that runs those passes apart from its exchanges."
  echo "Max rel diff: the layer's output at ep $ranks against the same layer with all experts on one GPU (bf16)."
  echo
  echo "| tokens/rank | dispatch | Bulkhead step ms | PyTorch step ms | speed-up | rows sent/rank | dispatch+combine ms | raw NCCL ms | bw ratio | dispatcher exchanges ms | raw NCCL ms (events) | exchange ratio | exchange only ms | transport ratio | local passes floor ms | bound | max rel diff |"
  echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "The step beside its own floor: the layer's expert products alone (grouped or batched, as the step), on the same rows with the same"
  echo "kernels, forward and backward (input and weight gradients), median of 20. TFLOP/s count the router and the"
  echo "experts' products (6 x rows x H x F forward, x3 with the backward); rows: the expert rows after any drops."
  echo
  echo "Graph (one GPU): the step captured once in a CUDA graph and replayed. Dropless, the layer groups its T x k"
  echo "slots by expert on the device; with a capacity it has static shapes, fixed buffers from the capacity:"
  echo "graph/padded gives each expert its capacity of rows (zeros after its kept slots) and multiplies them with"
  echo "batched GEMMs that add each weight gradient to the one held inside the GEMM; graph/packed packs the kept rows"
  echo "expert after expert, so the grouped products multiply T x k rows as dropless ones do, and autograd adds the"
  echo "weight gradients in a pass of their own. Gradients accumulate between steps in every run, Bulkhead's and"
  echo "PyTorch's. None reads anything back to the host. vs PyTorch: the PyTorch step over this one."
  echo
  echo "| tokens/rank | dispatch | capacity | execution | step ms | expert products ms | step / products | step TFLOP/s | products TFLOP/s | vs PyTorch |"
  echo "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${floors[@]}"
  echo
  echo "Where a step's time goes (each phase alone, synced, ms):"
  echo
  echo '```'
  printf '%s\n' "${phases[@]}"
  echo '```'
} | tee "$out"
