#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds a consumer with
# find_package(Bulkhead) and runs it on 2 ranks.
# usage: package_test.sh <build-dir> <this-dir> <mpirun>
set -eu
build=$1 here=$2 mpirun=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
prefixes="$scratch/prefix;$(grep -E '^CMAKE_PREFIX_PATH:' "$build/CMakeCache.txt" | cut -d= -f2-)"
cmake -S "$here" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$prefixes" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$scratch/build" >/dev/null
"$mpirun" --oversubscribe -np 2 "$scratch/build/consumer"
