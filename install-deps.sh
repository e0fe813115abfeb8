#!/usr/bin/env bash
# Installs the system packages Bulkhead builds with, where they are missing
# (Debian 12, Ubuntu 22.04 and 24.04). As root it runs apt-get; otherwise it
# prints the exact command to run and exits 1. Nothing is downloaded at build
# time: this script is the whole list.
set -euo pipefail

missing=()
need_command() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need_package() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || missing+=("$1"); }

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
# libtorch: the distribution's libtorch-dev (CPU), unless a PyTorch with its
# CMake files is installed (as on the GPU machine, whose libtorch has CUDA).
if ! python3 -c 'import torch' >/dev/null 2>&1; then need_package libtorch-dev; fi

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
