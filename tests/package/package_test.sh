#!/usr/bin/env bash
# Installs the build into a scratch prefix and checks the public API there:
# only the public headers are installed, each compiles on its own; a consumer
# and examples/custom_trainer.cpp build with find_package(Bulkhead) and
# bulkhead::bulkhead; the consumer runs on 2 ranks and the custom trainer on 4
# (ep 2: train a small Qwen3-MoE, save, load back), and its checkpoint exports as a Hugging Face folder.
# usage: package_test.sh <build-dir> <this-dir> <mpirun>
set -eu
build=$1 here=$2 mpirun=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
include="$scratch/prefix/include/bulkhead"
for internal in runtime/nccl/nccl_check.h runtime/nccl/nccl_communicator.h runtime/mpi/mpi_check.h \
    runtime/gloo/gloo_context.h parallel/layout_grid.h optim/parameter_checks.h checkpoint/save_job.h \
    moe/kernel_support.h moe/router_noise.h runtime/store/tcp_store_loop.h runtime/gloo/gloo_state.h \
    runtime/nccl/peer_all_reduce.h runtime/nccl/peer_reduce_kernels.h runtime/cuda/cuda_device.h; do
  if [ -e "$include/$internal" ]; then echo "FAIL: the internal header $internal is installed"; exit 1; fi
done
if find "$include" -path '*/moe/cuda/*' | grep -q .; then echo "FAIL: moe/cuda headers are installed"; exit 1; fi
for public in runtime/communicator.h parallel/process_groups.h moe/moe_layer.h optim/distributed_optimizer.h \
    checkpoint/checkpointer.h launch/init.h; do
  [ -e "$include/$public" ] || { echo "FAIL: the public header $public is not installed"; exit 1; }
done
prefixes="$scratch/prefix;$(grep -E '^CMAKE_PREFIX_PATH:' "$build/CMakeCache.txt" | cut -d= -f2-)"
cmake -S "$here" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$prefixes" -DCMAKE_BUILD_TYPE=Release \
  -DBULKHEAD_EXAMPLES_DIR="$here/../../examples" -DBULKHEAD_INCLUDE_DIR="$include" >/dev/null
cmake --build "$scratch/build" -j "$(nproc)" >"$scratch/build.log" 2>&1 || { tail -40 "$scratch/build.log"; exit 1; }
echo "package: $(find "$include" -name '*.h' | wc -l) public headers installed, each compiled alone"
"$mpirun" --oversubscribe -np 2 "$scratch/build/consumer"
"$mpirun" --oversubscribe -np 4 "$scratch/build/custom_trainer" --ep 2 --steps 40 --ckpt-dir "$scratch/ckpt"
# Its checkpoint holds the model's config.json: bulkhead-ckpt export writes a Hugging Face folder of it.
"$scratch/prefix/bin/bulkhead-ckpt" export "$scratch/ckpt" --to "$scratch/export" >/dev/null
grep -q '"model_type": "qwen3_moe"' "$scratch/export/config.json" ||
  { echo "FAIL: the custom trainer's export has no qwen3_moe config.json"; exit 1; }
grep -qa 'model.layers.1.mlp.experts.7.down_proj.weight' "$scratch/export/"*.safetensors ||
  { echo "FAIL: the custom trainer's export lacks save_pretrained's expert names"; exit 1; }
echo "package: the custom trainer's checkpoint exported as a Hugging Face folder"
