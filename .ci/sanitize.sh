#!/usr/bin/env bash
# Builds only what a sanitizer run needs (a build folder of its own, no NCCL)
# and runs it:
#   .ci/sanitize.sh address   the unit tests (store protocol, fault specs, env, layouts, ledger), the checkpoint
#                             unit tests (hostile safetensors and manifests), the data unit tests (hostile and
#                             10,000 mutated dataset indexes), the model config reader (5,000 mutated configs), the
#                             Hugging Face importer (600 mutated shard headers and indexes) and the checkpoint
#                             corruption test on 4 ranks, under AddressSanitizer and UndefinedBehaviorSanitizer
#   .ci/sanitize.sh thread    the store, store server, client, node relay, monitor and ledger tests under
#                             ThreadSanitizer
# Any report fails the run. BULKHEAD_BUILD_DIR (default build) names the main build; this one is <it>-<kind>.
# --build-only builds and runs nothing (.ci/run builds both while the main suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
. cmake/torch-prefix.sh
kind=${1:?usage: .ci/sanitize.sh address|thread [--build-only]}
build_only=0
[ "${2:-}" = --build-only ] && build_only=1
build=${BULKHEAD_BUILD_DIR:-build}-$kind
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
prefix=$(torch_cmake_prefix)
# Unity build (sources compiled in batches), as ./dev.sh builds: at -O0 most of a source's time is its headers.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O0" -DBULKHEAD_SANITIZE="$kind" \
  -DCMAKE_UNITY_BUILD=ON \
  -DBULKHEAD_NCCL=OFF ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"} >/dev/null
bin=$build/bin
case "$kind" in
  address)
    cmake --build "$build" -j "$(nproc)" --target bulkhead_runtime_unit_tests bulkhead_parallel_unit_tests \
      bulkhead_launch_unit_tests bulkhead_checkpoint_unit_tests bulkhead_checkpoint_mpi_tests bulkhead_data_unit_tests \
      bulkhead_models_unit_tests bulkhead_models_tests
    [ $build_only = 1 ] && exit 0
    # Leaks at exit are libtorch's and Open MPI's, not reports about Bulkhead's memory use.
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    "$bin/bulkhead_runtime_unit_tests"
    "$bin/bulkhead_parallel_unit_tests"
    "$bin/bulkhead_launch_unit_tests"
    "$bin/bulkhead_checkpoint_unit_tests"
    "$bin/bulkhead_data_unit_tests"
    "$bin/bulkhead_models_unit_tests"
    mpirun -np 1 -x ASAN_OPTIONS -x UBSAN_OPTIONS "$bin/bulkhead_models_tests" "[fuzz]"
    BULKHEAD_COLLECTIVE_TIMEOUT=120 mpirun --oversubscribe -np 4 -x ASAN_OPTIONS -x UBSAN_OPTIONS \
      "$bin/bulkhead_checkpoint_mpi_tests" "every kind of damage*"
    ;;
  thread)
    cmake --build "$build" -j "$(nproc)" --target bulkhead_runtime_unit_tests
    [ $build_only = 1 ] && exit 0
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/.ci/tsan.supp"
    "$bin/bulkhead_runtime_unit_tests" "[store],*server*,*client*,*relay*,*ledger*,*thread*"
    ;;
  *)
    echo "usage: .ci/sanitize.sh address|thread [--build-only]" >&2
    exit 2
    ;;
esac
echo "sanitize: $kind: passed"
