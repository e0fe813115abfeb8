#!/usr/bin/env bash
# bulkhead-ckpt export beside dd, one command, on the same disk: the checkpoint bench's MoE-like
# state (12 layers x 64 experts, bf16; about 3.8 GB saved by 2 ranks through bulkhead-ckpt-bench)
# is saved once and exported to Hugging Face safetensors (every chunk read back and checksummed,
# 5 GB shards, each file fsynced), with the page cache dropped first (as root: the checkpoint read
# from the disk it is written to) and with the checkpoint in the page cache (as right after a save);
# dd writes the same number of bytes with conv=fdatasync. Prints a markdown table.
#   bench/run_export_bench.sh [build-dir] [work-dir] [out-file]
set -eo pipefail
build=${1:-build}
dir=${2:-${TMPDIR:-/tmp}/bulkhead-export-bench}
out=${3:-bench/results/export_$(date +%Y%m%d).md}
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
rm -rf "$dir" && mkdir -p "$dir" "$(dirname "$out")"
mpirun --oversubscribe -np 2 "$build/bin/bulkhead-ckpt-bench" --dir "$dir/ckpt" --iters 1 >"$dir/save.log" 2>&1
cache=warm
drop_caches() {
  sync
  if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then cache=cold; else cache=warm; fi
}
now() { date +%s.%N; }
settle() {  # lets the disk finish the work a removal leaves, then empties the page cache
  sync
  sleep 3
  drop_caches
}
elapsed() { echo "$(now) - $1" | bc -l; }
best() { printf '%s\n' "$@" | sort -g | head -1; }
run_export() {  # run_export: appends the wall and the tool's own time to export_runs/inner_runs
  local start
  start=$(now)
  "$build/bin/bulkhead-ckpt" export "$dir/ckpt" --to "$dir/hf" >"$dir/export.log" 2>&1
  export_runs+=("$(elapsed "$start")")
  # The tool's own timing, from the manifest read to the last fsync (the wall time adds the process start).
  inner_runs+=("$(grep -o 'files, [0-9.]* s' "$dir/export.log" | grep -o '[0-9.]* s' | cut -d' ' -f1)")
  bytes=$(du -cb "$dir"/hf/*.safetensors | tail -1 | cut -f1)
  rm -rf "$dir/hf"
}
# Each measured ROUNDS times (default 3), alternating; the best of each is reported.
export_runs=() inner_runs=() dd_runs=()
for round in $(seq "${ROUNDS:-3}"); do
  settle
  start=$(now)
  dd if=/dev/zero of="$dir/dd.bin" bs=64M count=56 conv=fdatasync 2>/dev/null
  dd_runs+=("$(elapsed "$start")")
  dd_bytes=$(stat -c %s "$dir/dd.bin")
  rm -f "$dir/dd.bin"
  settle
  run_export
done
cold_cache=$cache
export_s=$(best "${export_runs[@]}") inner_s=$(best "${inner_runs[@]}") dd_s=$(best "${dd_runs[@]}")
cold_runs=("${export_runs[@]}")
export_runs=() inner_runs=()
for round in $(seq "${ROUNDS:-3}"); do
  sync
  sleep 3
  cat "$dir"/ckpt/step_*/* >/dev/null  # in the page cache, as right after the save
  run_export
done
warm_s=$(best "${export_runs[@]}") warm_inner_s=$(best "${inner_runs[@]}")
rm -rf "$dir"
export_mbs=$(echo "$bytes / $export_s / 1000000" | bc -l)
inner_mbs=$(echo "$bytes / $inner_s / 1000000" | bc -l)
warm_mbs=$(echo "$bytes / $warm_s / 1000000" | bc -l)
warm_inner_mbs=$(echo "$bytes / $warm_inner_s / 1000000" | bc -l)
dd_mbs=$(echo "$dd_bytes / $dd_s / 1000000" | bc -l)
fs=$(df -PT "$(dirname "$dir")" | awk 'NR == 2 {print $2}')
{
  echo "# bulkhead-ckpt export beside dd"
  echo
  echo "- Command: \`bench/run_export_bench.sh $build\`"
  echo "- Machine: $(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GiB, $fs file system"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`"
  echo
  echo "| what | bytes | seconds | MB/s | export / dd |"
  echo "|---|---:|---:|---:|---:|"
  printf '| export, checkpoint in the page cache (as right after a save): wall clock of the command | %d | %.2f | %.0f | %.2f |\n' "$bytes" "$warm_s" "$warm_mbs" "$(echo "$warm_mbs / $dd_mbs" | bc -l)"
  printf '| the same, the export itself (its own report: manifest read to last fsync) | %d | %.2f | %.0f | %.2f |\n' "$bytes" "$warm_inner_s" "$warm_inner_mbs" "$(echo "$warm_inner_mbs / $dd_mbs" | bc -l)"
  printf '| export, page cache %s (the checkpoint read from the disk written to): wall clock | %d | %.2f | %.0f | %.2f |\n' "$cold_cache" "$bytes" "$export_s" "$export_mbs" "$(echo "$export_mbs / $dd_mbs" | bc -l)"
  printf '| the same, the export itself | %d | %.2f | %.0f | %.2f |\n' "$bytes" "$inner_s" "$inner_mbs" "$(echo "$inner_mbs / $dd_mbs" | bc -l)"
  printf '| dd, conv=fdatasync | %d | %.2f | %.0f | |\n' "$dd_bytes" "$dd_s" "$dd_mbs"
  echo
  echo "Export reads every chunk of the checkpoint through the page cache, each checksum verified, one tensor ahead"
  echo "of the write, and writes with O_DIRECT from two 32 MB buffers, one filled while the other is written. With"
  echo "the cache dropped, the reads and the writes share one disk. The command's wall clock includes loading the"
  echo "program (libtorch). Best of ${ROUNDS:-3} rounds each (cold export: $(printf '%.2f ' "${cold_runs[@]}")s; warm export:"
  echo "$(printf '%.2f ' "${export_runs[@]}")s; dd: $(printf '%.2f ' "${dd_runs[@]}")s); before each cold export and dd the disk settled and the"
  echo "page cache was dropped."
} | tee "$out"
