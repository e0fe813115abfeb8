#!/usr/bin/env bash
# The MoE layer's expert products on one GPU, in one command: each product
# (forward, dgrad, wgrad of both projections) through Bulkhead's Hopper kernels
# beside at::_grouped_mm and a dense GEMM of the same FLOPs; and the whole layer,
# forward + backward (dropless, captured in a CUDA graph), with Bulkhead's
# kernels and with at::_grouped_mm, beside the same layer in PyTorch under
# torch.compile and eager (bench/torch_moe.py). bf16, hidden 2048, top-8, expert
# hidden 768, at E = 64 and E = 128 (Qwen3-30B-A3B's layer), T tokens.
#   bench/run_products_bench.sh [build-dir] [out-file] [token counts, default "4096 16384"]
# Env: EXPERTS (default "64 128"), COMMIT (recorded; default: git rev-parse).
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/products_$(date +%Y%m%d).md}
shift $(($# < 2 ? $# : 2))
token_counts=${*:-4096 16384}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
value() { awk -v key="$1" '$1 == key {print $2}' <<<"$2"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
need() { [ -n "$1" ] || { echo "$2 failed:"; echo "$3" | tail -20; exit 1; }; }
tables=()
layers=()
for experts in ${EXPERTS:-64 128}; do
  sizes="--hidden 2048 --experts $experts --topk 8 --ffn 768"
  for tokens in $token_counts; do
    products=$("$build/bin/bulkhead-products-bench" --tokens "$tokens" $sizes 2>&1 || true)
    need "$(value PRODUCTS_TFLOPS "$products")" bulkhead-products-bench "$products"
    tables+=("$(grep -v '_TFLOPS ' <<<"$products")")
    layer() {  # layer [env...]: the captured dropless layer's bench output
      env "$@" mpirun --oversubscribe -np 1 "$build/bin/bulkhead-moe-bench" --tokens "$tokens" $sizes --graph 2>&1 || true
    }
    ours=$(layer BULKHEAD_GROUPED_PRODUCTS=hopper)
    need "$(value STEP_MS "$ours")" "bulkhead-moe-bench --graph" "$ours"
    aten=$(layer BULKHEAD_GROUPED_PRODUCTS=aten)
    need "$(value STEP_MS "$aten")" "bulkhead-moe-bench --graph (aten)" "$aten"
    torch_run() {
      MASTER_ADDR=127.0.0.1 MASTER_PORT=29651 mpirun --oversubscribe -np 1 python3 bench/torch_moe.py --tokens "$tokens" \
        $sizes "$@" 2>&1 || true
    }
    compiled=$(torch_run --compile)
    need "$(value TORCH_STEP_MS "$compiled")" "bench/torch_moe.py --compile" "$compiled"
    eager=$(torch_run)
    need "$(value TORCH_STEP_MS "$eager")" "bench/torch_moe.py" "$eager"
    s=$(value STEP_MS "$ours") c=$(value TORCH_STEP_MS "$compiled")
    layers+=("| $experts | $tokens | $s | $(value EXPERT_PRODUCTS_MS "$ours") | $(value PRODUCTS_TFLOPS "$ours") | $(value STEP_MS "$aten") | $(value EXPERT_PRODUCTS_MS "$aten") | $c | $(value TORCH_STEP_MS "$eager") | **$(ratio "$c" "$s")** | $(ratio "$(value TORCH_STEP_MS "$eager")" "$s") |")
  done
done
{
  echo "# The MoE layer's expert products: Bulkhead's Hopper kernels beside at::_grouped_mm and torch.compile"
  echo
  echo "Command: \`bench/run_products_bench.sh $build $out $token_counts\` on $(nvidia-smi -L | head -1 | cut -d'(' -f1| sed 's/GPU 0: //'), $(date -u +%Y-%m-%d), commit $commit."
  echo "bf16, hidden 2048, top-8, expert hidden 768, dropless; T tokens, so T x 8 rows over the experts."
  echo
  echo "## The layer, forward + backward"
  echo "Bulkhead: \`bulkhead-moe-bench --graph\` (router, dispatch, experts, combine captured in a CUDA graph; median of 20),"
  echo "with its own grouped products (\`BULKHEAD_GROUPED_PRODUCTS=hopper\`, the default) and with at::_grouped_mm (\`aten\`);"
  echo "products: the layer's expert products alone on the same rows, forward and backward. PyTorch: \`bench/torch_moe.py\`,"
  echo "the same math (fp32 router, top-k, argsort permute, \`torch._grouped_mm\` with SwiGLU, weighted \`index_add\`),"
  echo "its forward under \`torch.compile\` (\`--compile\`) and eager; median of 20 steps after 3."
  echo
  echo "| E | T | Bulkhead ms | its products ms | products TFLOP/s | with \`_grouped_mm\` ms | those products ms | PyTorch compiled ms | PyTorch eager ms | Bulkhead vs compiled | vs eager |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${layers[@]}"
  echo
  echo "## Each product alone (\`bulkhead-products-bench\`, 20 calls after 3, wall clock)"
  for t in "${tables[@]}"; do
    echo
    echo "$t"
  done
} | tee "$out"
