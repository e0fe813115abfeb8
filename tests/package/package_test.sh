#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds a consumer and
# examples/custom_trainer.cpp with find_package(Bulkhead), runs the consumer on
# 2 ranks and the custom trainer on 4 (ep 2: train, save, load back).
# usage: package_test.sh <build-dir> <this-dir> <mpirun>
set -eu
build=$1 here=$2 mpirun=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
prefixes="$scratch/prefix;$(grep -E '^CMAKE_PREFIX_PATH:' "$build/CMakeCache.txt" | cut -d= -f2-)"
cmake -S "$here" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$prefixes" -DCMAKE_BUILD_TYPE=Release \
  -DBULKHEAD_EXAMPLES_DIR="$here/../../examples" >/dev/null
cmake --build "$scratch/build" >/dev/null
"$mpirun" --oversubscribe -np 2 "$scratch/build/consumer"
"$mpirun" --oversubscribe -np 4 "$scratch/build/custom_trainer" --ep 2 --steps 40 --ckpt-dir "$scratch/ckpt"
