#!/usr/bin/env bash
# Bulkhead's developer entry point (the README's quickstart).
#   ./dev.sh run     install what is missing, build, run the main job on 4 ranks
#   ./dev.sh test    install what is missing, build, run the whole test suite
#   ./dev.sh build   install what is missing and build
#   ./dev.sh configure   install what is missing and run CMake's configure step
# BULKHEAD_BUILD_DIR picks the build folder (default: build). BULKHEAD_UNITY=OFF compiles each source alone
# (CMake's default); ./dev.sh compiles each target's sources in batches (CMake's unity build), which takes
# about a third less time from scratch and more for a rebuild after editing one file.
set -euo pipefail
cd "$(dirname "$0")"
. cmake/torch-prefix.sh
build_dir=${BULKHEAD_BUILD_DIR:-build}
# Open MPI refuses root without these (containers and CI run as root).
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

configure() {
  ./install-deps.sh
  local generator=() prefix
  command -v ninja >/dev/null && generator=(-G Ninja)
  # A Python PyTorch with libtorch's CMake files (with CUDA on GPU machines),
  # else the distribution's libtorch-dev.
  prefix=$(torch_cmake_prefix)
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="${BULKHEAD_UNITY:-ON}" \
    ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"}
}

build() {
  configure
  cmake --build "$build_dir" -j "$(nproc)"
}

case "${1:-}" in
  build) build ;;
  configure) configure ;;
  run)
    build
    # The main job: a byte-level MoE transformer on 4 ranks (ep 2 x expert-dp 2), trained on
    # an indexed dataset of this repository's own documentation (a line a document, written
    # by bulkhead-data and read in Megatron-LM's sample order), validated every 60 steps,
    # checkpointed at step 60 and 120, stopped, then resumed from the latest checkpoint.
    ckpt=${BULKHEAD_CKPT_DIR:-$build_dir/train_moe_ckpt}
    rm -rf "$ckpt"
    mkdir -p "$build_dir/corpus"
    "$build_dir/bin/bulkhead-data" convert README.md docs/*.md --format text --per-line \
      --out "$build_dir/corpus/docs_text_document"
    job=(--ep 2 --steps 200 --data-path "$build_dir/corpus/docs_text_document" --split 95,5,0
         --eval-interval 60 --eval-iters 4 --data-cache-path "$build_dir/corpus/cache" --ckpt-dir "$ckpt")
    mpirun --oversubscribe -np 4 "$build_dir/bin/train_moe" "${job[@]}" --stop-after 120 --ckpt-interval 60
    mpirun --oversubscribe -np 4 "$build_dir/bin/train_moe" "${job[@]}" --resume latest
    ;;
  test)
    build
    ctest --test-dir "$build_dir" --output-on-failure
    ;;
  *)
    echo "usage: $0 run|test|build|configure" >&2
    exit 2
    ;;
esac
