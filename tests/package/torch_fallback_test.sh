#!/usr/bin/env bash
# The set-up scripts use a Python PyTorch only when it ships libtorch's CMake
# files. With a PyTorch on the path that has none (as Debian's python3-torch
# installed without its recommended packages), install-deps.sh still asks for
# libtorch-dev and `dev.sh configure` configures against it; with one that has
# them, they use its prefix.
# usage: torch_fallback_test.sh <source dir>
set -u
source_dir=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; [ -f "$work/configure.log" ] && tail -30 "$work/configure.log"; exit 1; }

# fake_torch DIR: a package `torch` whose torch.utils.cmake_prefix_path is DIR/torch/share/cmake.
fake_torch() {
  mkdir -p "$1/torch/utils"
  echo "# a stand-in for a PyTorch without libtorch's CMake files" >"$1/torch/__init__.py"
  cat >"$1/torch/utils/__init__.py" <<'PY'
import os
cmake_prefix_path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "share", "cmake")
PY
}

# 1. A PyTorch without CMake files: it imports, but libtorch-dev is still needed.
fake_torch "$work/bare"
PYTHONPATH=$work/bare python3 -c 'import torch, torch.utils' || fail "the stand-in PyTorch does not import"
PYTHONPATH=$work/bare "$source_dir/install-deps.sh" --print >"$work/bare.txt" || fail "install-deps.sh --print failed"
grep -qx libtorch-dev "$work/bare.txt" || fail "install-deps.sh skips libtorch-dev for a PyTorch without CMake files"

# 2. A PyTorch with TorchConfig.cmake: its prefix is used, libtorch-dev is not asked for.
fake_torch "$work/full"
mkdir -p "$work/full/torch/share/cmake/Torch"
touch "$work/full/torch/share/cmake/Torch/TorchConfig.cmake"
PYTHONPATH=$work/full "$source_dir/install-deps.sh" --print >"$work/full.txt" || fail "install-deps.sh --print failed"
grep -qx libtorch-dev "$work/full.txt" && fail "install-deps.sh asks for libtorch-dev beside a PyTorch with CMake files"
prefix=$(cd "$source_dir" && PYTHONPATH=$work/full bash -c '. cmake/torch-prefix.sh; torch_cmake_prefix')
[ "$prefix" = "$work/full/torch/share/cmake" ] || fail "torch_cmake_prefix printed '$prefix'"

# 3. The configure step with the bare PyTorch first on the path finds libtorch-dev's CMake files.
dpkg-query -W -f='${Status}' libtorch-dev 2>/dev/null | grep -q "install ok installed" ||
  { echo "SKIP: libtorch-dev is not installed here (this machine builds against a Python PyTorch)"; exit 77; }
PYTHONPATH=$work/bare BULKHEAD_BUILD_DIR=$work/build "$source_dir/dev.sh" configure >"$work/configure.log" 2>&1 ||
  fail "dev.sh configure failed beside a PyTorch without CMake files"
torch_dir=$(sed -n 's/^Torch_DIR:PATH=//p' "$work/build/CMakeCache.txt")
case $torch_dir in
  "$work"*|"") fail "Torch_DIR is '$torch_dir'" ;;
esac
[ -f "$torch_dir/TorchConfig.cmake" ] || fail "no TorchConfig.cmake in Torch_DIR $torch_dir"
echo "configured against $torch_dir"
echo "PASS"
