#!/usr/bin/env bash
# Checkpoints on GPUs, one command: Bulkhead's save and load (bulkhead-ckpt-bench under mpirun),
# torch.distributed.checkpoint's save, async_save and load (bench/dcp_bench.py under
# torch.distributed.run), and dd, all on the same disk and the same MoE-like state (12 layers x 64
# experts x bf16 [1536 x 1024] and [1024 x 768], plus a bf16 [3072 x 1024] per layer per rank:
# about 3.8 GB on 2 ranks). Prints a markdown table with the ratios the acceptance asks for.
#   bench/run_ckpt_bench.sh [build-dir] [checkpoint-dir] [out-file]
# Env: NP (ranks, default 2), ITERS (saves per variant, default 4; the first of each is reported
# apart: it allocates staging memory), RESHARD_NP (also load Bulkhead's checkpoint on this many
# ranks, resharded, and check it bitwise; default: not run). Page caches are dropped before each load when this runs as
# root (else the loads read warm caches, and the table says so).
set -eo pipefail
build=${1:-build}
dir=${2:-${TMPDIR:-/tmp}/bulkhead-ckpt-bench}
out=${3:-bench/results/ckpt_$(date +%Y%m%d).md}
ranks=${NP:-2}
iters=${ITERS:-4}
export NCCL_NVLS_ENABLE=0
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
here=$(cd "$(dirname "$0")" && pwd)
logs=$(mktemp -d)
mkdir -p "$dir" "$(dirname "$out")"
rm -rf "$dir/bulkhead" "$dir/dcp" "$dir"/dd.*

# State size: per rank 12 x (64/ranks x (1536x1024 + 1024x768) + 3072x1024) bf16 values.
bytes=$((ranks * 12 * (64 / ranks * (1536 * 1024 + 1024 * 768) + 3072 * 1024) * 2))
need=$((bytes * 4 / 1024))
avail=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
[ "$avail" -ge "$need" ] || echo "WARNING: $dir has $((avail / 1048576)) GiB free; the bench needs about $((need / 1048576)) GiB" >&2
fs=$(df -PT "$dir" | awk 'NR == 2 {print $2 " (" $1 ")"}')
case $fs in tmpfs*) echo "WARNING: $dir is on tmpfs: this measures memory, not a disk" >&2 ;; esac

cache=warm
drop_caches() {
  sync
  if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then cache=cold; else cache=warm; fi
}
now() { date +%s.%N; }

echo "== dd: $bytes bytes, 1 stream and $ranks streams, conv=fdatasync" >&2
block=$((64 << 20))
dd_run() {  # dd_run STREAMS: seconds for STREAMS parallel dd writing $bytes in all
  local streams=$1 count=$((bytes / block / $1)) start end pids=()
  start=$(now)
  for ((s = 0; s < streams; s++)); do
    dd if=/dev/zero of="$dir/dd.$s" bs=$block count=$count conv=fdatasync status=none &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  end=$(now)
  rm -f "$dir"/dd.*
  echo "$start $end $((count * block * streams))" | awk '{printf "%.4f %d\n", $2 - $1, $3}'
}
# Before and after the checkpoints (disks and their caches drift); the best run is the bar.
dd_run 1 >"$logs/dd1"
dd_run "$ranks" >"$logs/ddn"

echo "== Bulkhead: $iters saves, then a load" >&2
mpirun --oversubscribe -np "$ranks" "$build/bin/bulkhead-ckpt-bench" --dir "$dir/bulkhead" --phase save \
  --iters "$iters" | tee "$logs/bulkhead_save" >&2
drop_caches
bulkhead_cache=$cache
mpirun --oversubscribe -np "$ranks" "$build/bin/bulkhead-ckpt-bench" --dir "$dir/bulkhead" --phase load |
  tee "$logs/bulkhead_load" >&2
if [ -n "${RESHARD_NP:-}" ]; then
  drop_caches
  mpirun --oversubscribe -np "$RESHARD_NP" "$build/bin/bulkhead-ckpt-bench" --dir "$dir/bulkhead" --phase load \
    --saved-world "$ranks" | sed 's/^BULKHEAD_RESULT/RESHARD_RESULT/' | tee -a "$logs/bulkhead_load" >&2
fi
"$build/bin/bulkhead-ckpt" verify "$dir/bulkhead" >&2 || echo "WARNING: bulkhead-ckpt verify found a fault" >&2
rm -rf "$dir/bulkhead"

echo "== torch.distributed.checkpoint: $iters saves per variant, then a load" >&2
torchrun=(python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" "$here/dcp_bench.py" --dir "$dir/dcp")
# A failure here still leaves Bulkhead's figures in the table (DCP's rows then say so).
"${torchrun[@]}" --phase save --iters "$iters" 2>&1 | tee "$logs/dcp_save" >&2 || echo "DCP save failed" >&2
drop_caches
dcp_cache=$cache
"${torchrun[@]}" --phase load 2>&1 | tee "$logs/dcp_load" >&2 || echo "DCP load failed" >&2
rm -rf "$dir/dcp"

echo "== dd again" >&2
dd_run 1 >>"$logs/dd1"
dd_run "$ranks" >>"$logs/ddn"

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
python3 - "$logs" "$ranks" "$gpu" "$fs" "$bulkhead_cache" "$dcp_cache" "bench/run_ckpt_bench.sh $*" <<'PY' | tee "$out"
import statistics, sys
logs, ranks, gpu, fs, bulkhead_cache, dcp_cache, command = sys.argv[1:]

def records(name, tag):
    rows = []
    for line in open(f"{logs}/{name}"):
        if line.startswith(tag):
            rows.append(dict(field.split("=", 1) for field in line.split()[1:]))
    return rows

def dd(name):
    """The fastest of the runs (before and after the checkpoints): (seconds, bytes), and every rate."""
    runs = [(float(s), int(b)) for s, b in (line.split() for line in open(f"{logs}/{name}") if line.strip())]
    best = min(runs, key=lambda run: run[0] / run[1])
    return best, ", ".join(f"{b / s / 1e9:.2f}" for s, b in runs)

bulkhead = records("bulkhead_save", "BULKHEAD_RESULT")
reserve = [r for r in bulkhead if r["phase"] == "reserve"]
saves = {"Bulkhead save": [r for r in bulkhead if r["phase"] == "save"]}
for row in records("dcp_save", "DCP_RESULT"):
    label = {"sync": "DCP save", "async": "DCP async_save",
             "async_pinned": "DCP async_save (pinned, async staging)"}[row["kind"]]
    saves.setdefault(label, []).append(row)
nbytes = int(saves["Bulkhead save"][0]["bytes"])
gb = nbytes / 1e9
(dd1, dd1_runs), (ddn, ddn_runs) = dd("dd1"), dd("ddn")
disk = max(dd1[1] / dd1[0], ddn[1] / ddn[0]) / 1e9

def steady(rows, key):
    values = [float(r[key]) for r in rows[1:]] or [float(rows[0][key])]
    return statistics.median(values)

print(f"# Checkpoint save and load: Bulkhead vs torch.distributed.checkpoint vs dd\n")
print(f"Command: `{command}` ({ranks} x {gpu}; checkpoint folder on {fs}).")
print(f"State: {gb:.2f} GB of bf16 in all ({ranks} ranks, 12 layers x 64 experts x [1536 x 1024] and [1024 x 768], "
      f"plus [3072 x 1024] per layer per rank), on the GPUs. Times are the slowest rank's; 'steady' is the median of "
      f"saves 2..{len(saves['Bulkhead save'])} (the first allocates staging memory).\n")
if reserve:
    print(f"Bulkhead allocates its (pinned) staging memory once, before the first save (Checkpointer::reserve): "
          f"{float(reserve[0]['seconds']):.2f} s, not counted below.\n")
print("| | blocking, first (s) | blocking, steady (s) | total per save, steady (s) | throughput (GB/s) | of disk |")
print("|---|---:|---:|---:|---:|---:|")
for label, rows in saves.items():
    total = steady(rows, "total")
    print(f"| {label} | {float(rows[0]['blocking']):.3f} | {steady(rows, 'blocking'):.3f} | {total:.2f} | "
          f"{gb / total:.2f} | {gb / total / disk:.0%} |")
print(f"| dd, 1 stream (conv=fdatasync), best of {dd1_runs} GB/s | | | {dd1[0]:.2f} | {dd1[1] / dd1[0] / 1e9:.2f} | |")
print(f"| dd, {ranks} streams (conv=fdatasync), best of {ddn_runs} GB/s | | | {ddn[0]:.2f} | "
      f"{ddn[1] / ddn[0] / 1e9:.2f} | |")
loads = {"Bulkhead": (records("bulkhead_load", "BULKHEAD_RESULT"), bulkhead_cache),
         "DCP": (records("dcp_load", "DCP_RESULT"), dcp_cache)}
resharded = records("bulkhead_load", "RESHARD_RESULT")
if resharded:
    r = resharded[0]
    loads[f"Bulkhead, saved on {r['saved_world']} ranks, loaded on {r['world']} (resharded)"] = (resharded, bulkhead_cache)
print("\n| load | seconds | GB/s | page cache | bitwise equal |")
print("|---|---:|---:|---|---|")
for label, (rows, cache) in loads.items():
    if rows:
        row = rows[0]
        print(f"| {label} | {float(row['seconds']):.2f} | {gb / float(row['seconds']):.2f} | {cache} | "
              f"{'yes' if row['equal'] == '1' else 'NO'} |")
    else:
        print(f"| {label} | failed: see the log above | | | |")

print("\nAcceptance:")
blocking_b = steady(saves["Bulkhead save"], "blocking")
throughput = gb / steady(saves["Bulkhead save"], "total")
if "DCP async_save" in saves:
    blocking_d = steady(saves["DCP async_save"], "blocking")
    print(f"- Bulkhead blocking / DCP async_save blocking: {blocking_b:.3f} / {blocking_d:.3f} s = "
          f"{blocking_b / blocking_d:.3f} (target <= 0.10): {'met' if blocking_b <= 0.1 * blocking_d else 'NOT met'}")
else:
    print("- Bulkhead blocking / DCP async_save blocking: DCP async_save did not run (see the log above)")
print(f"- Bulkhead save throughput / disk (best dd): {throughput:.2f} / {disk:.2f} GB/s = {throughput / disk:.0%} "
      f"(target >= 80%): {'met' if throughput >= 0.8 * disk else 'NOT met'}")
if loads["Bulkhead"][0] and loads["DCP"][0]:
    speed = float(loads["DCP"][0][0]["seconds"]) / float(loads["Bulkhead"][0][0]["seconds"])
    print(f"- load time, DCP / Bulkhead: {speed:.2f} (target >= 1): {'met' if speed >= 1 else 'NOT met'}")
else:
    print("- load time, DCP / Bulkhead: not measured (a load failed; see the log above)")
PY
rm -rf "$logs"
