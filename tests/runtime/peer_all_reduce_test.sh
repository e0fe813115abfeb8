#!/usr/bin/env bash
# Runs the peer all-reduce tests under mpirun. "every": one rank per GPU (every
# GPU, up to 8), at least 2 ranks, sharing a GPU where the machine has one.
# "other": 4 ranks where "every" runs another count, else 2, so that both 2 and
# 4 ranks run on any machine. Skipped (77) with a clear message without a GPU.
# usage: peer_all_reduce_test.sh every|other <program> <mpirun> [test arguments]
set -u
count=$1 program=$2 mpirun=$3
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 1 ]; then
  echo "SKIPPED: no GPU on this machine (nvidia-smi lists none); the GPU tests run on the device machine"
  exit 77
fi
every=$((gpus < 2 ? 2 : gpus > 8 ? 8 : gpus))
if [ "$count" = every ]; then
  ranks=$every
else
  ranks=$((every == 4 ? 2 : 4))
fi
echo "peer all-reduce: $ranks ranks on $gpus GPU(s)"
exec "$mpirun" --oversubscribe -np "$ranks" "$program" "${@:4}"
