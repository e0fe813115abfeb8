#!/usr/bin/env bash
# The ledger dumps of a 4-rank run (BULKHEAD_LEDGER_DUMP): every rank's Chrome
# trace opens as valid JSON with one process track per rank and one thread
# track per group, and its ledger JSON lists every group with its entries.
# usage: trace_test.sh <bulkhead-collectives> <mpirun>
set -u
program=$1 mpirun=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
BULKHEAD_LEDGER_DUMP=$out "$mpirun" --oversubscribe -np 4 "$program" --iters 2 --sizes 4K >"$out/log" 2>&1 ||
  { echo "FAIL: the run failed"; cat "$out/log"; exit 1; }
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for rank in range(4):
    with open(f"{out}/trace_rank{rank}.json") as f:
        events = json.load(f)["traceEvents"]
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    assert processes == {f"rank {rank}"}, processes
    assert "world" in threads and f"parity[{rank % 2}]" in threads, threads
    assert all(e["pid"] == rank and e["dur"] >= 0 for e in spans), "bad span"
    assert any(e["name"].startswith("all_to_all") for e in spans), "no all_to_all span"
    with open(f"{out}/ledger_rank{rank}.json") as f:
        ledger = json.load(f)
    assert ledger["rank"] == rank
    names = {g["name"] for g in ledger["groups"]}
    assert names == threads, (names, threads)
    world = next(g for g in ledger["groups"] if g["name"] == "world")
    assert world["last_completed"] == world["last_issued"] > 10, world
    assert all(e["state"] == "completed" for e in world["entries"])
    print(f"rank {rank}: {len(spans)} spans on tracks {sorted(threads)}")
print("PASS")
PY
