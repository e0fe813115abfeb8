#!/usr/bin/env bash
# Installs the system packages Bulkhead builds with, where they are missing
# (Debian 12, Ubuntu 22.04 and 24.04). As root it runs apt-get; otherwise it
# prints the exact command to run and exits 1. Nothing is downloaded at build
# time: this script is the whole list.
#
#   ./install-deps.sh           install what is missing (as root), or print the command
#   ./install-deps.sh --print   print the packages this machine needs, one a line, and exit
set -euo pipefail
cd "$(dirname "$0")"
. cmake/torch-prefix.sh

missing=() needed=()
need_command() { needed+=("$2"); command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need_package() {
  needed+=("$1")
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || missing+=("$1")
}

need_command g++ g++
need_command make make
need_command cmake cmake
need_command ninja ninja-build
need_command python3 python3  # the ledger-trace test reads JSON with it
need_package libopenmpi-dev
need_package openmpi-bin
need_package libhdf5-dev
need_package libfmt-dev
need_package catch2
need_package libcli11-dev        # command lines
need_package nlohmann-json3-dev  # JSON output
need_package libgloo-dev        # the gloo backend (jobs started without MPI)
need_package python3-numpy      # tests: an independent safetensors reader
need_package python3-h5py       # tests: checkpoint rank files read without Bulkhead
# libtorch: the distribution's libtorch-dev (CPU), unless a Python PyTorch that
# ships libtorch's CMake files is installed (as on GPU machines, with CUDA).
if [ -z "$(torch_cmake_prefix)" ]; then need_package libtorch-dev; fi

if [ "${1:-}" = "--print" ]; then
  printf '%s\n' "${needed[@]}"
  exit 0
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all build dependencies are installed"
  exit 0
fi
command="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing: ${missing[*]}"
  echo "install-deps: run as root:  sudo sh -c '$command'"
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
sh -c "$command"
