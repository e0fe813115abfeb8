#!/usr/bin/env python3
"""Where a step's time goes, from a Chrome trace of bulkhead-moe-bench --profile.

    python3 bench/profile_summary.py trace.json

Per "step" range: wall time, GPU busy time (the union of kernel, memcpy and
memset intervals), GPU idle time, and how many kernels ran; then the kernels
and the ATen ops that take the most time per step.
"""
import collections
import json
import sys

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def main(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == "step" and e.get("cat") == "user_annotation"]
    if not steps:
        sys.exit(f"{path}: no 'step' ranges")
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    kernel_time, op_time = collections.Counter(), collections.Counter()
    op_calls = collections.Counter()
    print("step  wall_ms  gpu_busy_ms  gpu_idle_ms  kernels")
    for index, step in enumerate(steps):
        begin, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in gpu if begin <= e["ts"] < end]
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in inside])
        print(f"{index:4d}  {step['dur'] / 1e3:7.3f}  {busy / 1e3:11.3f}  {(step['dur'] - busy) / 1e3:11.3f}  {len(inside):7d}")
        for e in inside:
            kernel_time[e["name"][:90]] += e["dur"] / len(steps)
        for e in ops:
            if begin <= e["ts"] < end:
                op_time[e["name"]] += e["dur"] / len(steps)
                op_calls[e["name"]] += 1 / len(steps)
    print("\nGPU work per step (ms, top 20):")
    for name, us in kernel_time.most_common(20):
        print(f"  {us / 1e3:7.3f}  {name}")
    print("\nATen ops per step (inclusive ms, calls; top 25):")
    for name, us in op_time.most_common(25):
        print(f"  {us / 1e3:7.3f}  {op_calls[name]:6.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
