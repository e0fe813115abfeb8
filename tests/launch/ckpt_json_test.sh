#!/usr/bin/env bash
# `bulkhead-ckpt inspect --json` of a checkpoint saved by 4 ranks (tp 2, ep 2)
# parses with Python's json module and says what is on disk: the step, the
# world size, each rank file with its size, and for every tensor its dtype,
# shape and slices, which cover it exactly once. The text forms of inspect and
# list name the same step.
# usage: ckpt_json_test.sh <bulkhead_ckpt_job> <bulkhead-ckpt> <mpirun>
set -u
job=$1 tool=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; for log in "$work"/*.log; do echo "--- $log:"; cat "$log"; done; exit 1; }

timeout 180 "$mpirun" --oversubscribe -np 4 "$job" "$work/ckpt" tp=2 ep=2 seed=7 saves=100,200 >"$work/job.log" 2>&1 ||
  fail "the saving job failed"
"$tool" inspect "$work/ckpt" --json >"$work/latest.json" 2>"$work/inspect.log" || fail "inspect --json failed"
"$tool" inspect "$work/ckpt" --step 100 --json >"$work/step100.json" 2>>"$work/inspect.log" ||
  fail "inspect --step 100 --json failed"
"$tool" inspect "$work/ckpt" >"$work/text.log" 2>&1 || fail "inspect failed"
"$tool" list "$work/ckpt" >"$work/list.log" 2>&1 || fail "list failed"

python3 - "$work" <<'PY' || fail "the JSON does not describe the checkpoint"
import json, math, os, sys
work = sys.argv[1]
for name, step in (("latest.json", 200), ("step100.json", 100)):
    with open(os.path.join(work, name)) as f:
        manifest = json.load(f)
    assert manifest["step"] == step, (name, manifest["step"])
    assert manifest["world_size"] == 4, manifest["world_size"]
    assert os.path.isdir(manifest["path"]) and manifest["path"].endswith(f"step_{step:06d}"), manifest["path"]
    assert "tp=2" in manifest["layout"].replace(" ", "") or "tp 2" in manifest["layout"], manifest["layout"]
    files = manifest["files"]
    assert sorted(f["rank"] for f in files) == [0, 1, 2, 3], files
    for f in files:
        on_disk = os.path.getsize(os.path.join(manifest["path"], f["name"]))
        assert f["bytes"] == on_disk, (f, on_disk)
    assert manifest["bytes"] == sum(f["bytes"] for f in files)
    model = [t for t in manifest["tensors"] if not t["internal"]]
    assert len(model) >= 4, [t["key"] for t in manifest["tensors"]]
    for t in model:
        assert t["dtype"] in ("float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8"), t["dtype"]
        volume = math.prod(t["shape"])
        covered = sum(math.prod(s["shape"]) for s in t["slices"])
        assert covered == volume, (t["key"], covered, volume)
        for s in t["slices"]:
            assert len(s["offsets"]) == len(t["shape"]) == len(s["shape"]), (t["key"], s)
            assert all(0 <= o and o + n <= d for o, n, d in zip(s["offsets"], s["shape"], t["shape"])), s
            assert len(s["digest"]) == 16 and int(s["digest"], 16) >= 0, s["digest"]
            assert 0 <= s["rank"] < 4 and s["dataset"], s
    sliced = [t for t in model if len(t["slices"]) > 1]
    assert sliced, "no tensor is split over ranks in a tp 2 / ep 2 checkpoint"
    print(f"{name}: step {step}, {len(files)} files, {len(model)} tensors, {len(sliced)} split over ranks")
PY
grep -q "^step 200 " "$work/text.log" || fail "inspect's text names no step 200"
grep -q "step_000100" "$work/list.log" && grep -q "step_000200" "$work/list.log" || fail "list misses a step"
echo "PASS"
