#!/usr/bin/env bash
# train_moe on indexed datasets (a blend of two written by bulkhead-data from this repository's own text
# and from random ids), under mpirun (MPI backend, CPU, float64):
#   - every global training sample the ranks train on (--data-log: step, sample, digest of its tokens) is
#     the row `bulkhead-data samples` writes for it, each taken once, in the step that should take it;
#   - a 4-rank run killed with SIGKILL and resumed on 2 ranks at another layout (tp 2) trains on the
#     straight run's global batches, step for step (a digest of each step's batch);
#   - stopped and resumed in the same layout, the losses and validation losses are bitwise the straight
#     run's;
#   - resuming against another split is refused naming the split, and goes on with --data-changed-ok;
#   - --eod-mask-loss changes the loss.
# usage: train_data_test.sh <train_moe> <bulkhead-data> <mpirun> <repository root>
set -euo pipefail
train=$1 tool=$2 mpirun=$3 root=$4
work=$(mktemp -d)
trap 'pkill -9 -f -- "--data-log $work" 2>/dev/null || true; rm -rf "$work"' EXIT

"$tool" convert "$root"/README.md "$root"/docs/*.md --format text --per-line --out "$work/text" > /dev/null
python3 - "$work/ids.jsonl" <<'PY'
import random, sys
rng = random.Random(12)
with open(sys.argv[1], "w") as f:
    for _ in range(300):
        f.write(str([rng.randrange(256) for _ in range(rng.randrange(1, 90))]) + "\n")
PY
"$tool" convert "$work/ids.jsonl" --out "$work/ids" --vocab 256 > /dev/null
data=(--data-path 0.3 "$work/text" 0.7 "$work/ids" --split 90,8,2 --seed 5 --data-cache-path "$work/cache")
model=(--layers 2 --hidden 32 --heads 4 --ffn 48 --experts 8 --topk 2 --seq 32 --batch 8 --dtype float64 --warmup 4
       --steps 16)
evals=(--eval-interval 4 --eval-iters 2)

run() {  # run <ranks> <name> [flags...]: loss log <name>.loss, data log folder <name>.data, output <name>.out
  local ranks=$1 name=$2
  shift 2
  mkdir -p "$work/$name.data"
  "$mpirun" --oversubscribe -np "$ranks" "$train" "${data[@]}" "${model[@]}" --loss-log "$work/$name.loss" \
    --data-log "$work/$name.data" "$@" > "$work/$name.out" 2>&1 ||
    { tail -30 "$work/$name.out"; echo "FAIL: train_moe $* exited non-zero"; exit 1; }
}

# The straight run, and the samples bulkhead-data says it reads.
run 4 straight --ep 2 "${evals[@]}"
"$tool" samples "${data[@]}" --seq 32 --steps 16 --batch 8 --out "$work/samples.npy" > /dev/null
python3 - "$work" <<'PY'
import glob, os, struct, sys
work = sys.argv[1]
raw = open(os.path.join(work, "samples.npy"), "rb").read()
header_len = struct.unpack("<H", raw[8:10])[0]
header = raw[10:10 + header_len].decode()
assert "'<i8'" in header and "(128, 33)" in header, header
values = struct.unpack(f"<{128 * 33}q", raw[10 + header_len:])
def digest(row):
    h = 1469598103934665603
    for v in row:
        h = ((h ^ (v & (2**64 - 1))) * 1099511628211) % 2**64
    return f"{h:016x}"
want = {(s // 8, s, digest(values[s * 33:(s + 1) * 33])) for s in range(128)}
got = set()
for path in glob.glob(os.path.join(work, "straight.data", "*.txt")):
    got |= {(int(a), int(b), c) for a, b, c in (line.split() for line in open(path))}
assert got == want, f"{len(got ^ want)} rows differ, e.g. {sorted(got ^ want)[:3]}"
print(f"the ranks trained on bulkhead-data's 128 samples, each once, in its step")
PY
grep -aq "validation after step    16 | loss" "$work/straight.out" || { tail "$work/straight.out"; echo "FAIL: no validation"; exit 1; }

# SIGKILL at step 10 or later, then a resume on 2 ranks at tp 2 from the latest committed checkpoint.
mkdir -p "$work/killed.data"
"$mpirun" --oversubscribe -np 4 "$train" "${data[@]}" "${model[@]}" "${evals[@]}" --ep 2 --loss-log "$work/killed.loss" \
  --data-log "$work/killed.data" --ckpt-dir "$work/ckpt" --ckpt-interval 4 > "$work/killed.out" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  [ -e "$work/killed.loss" ] && [ "$(wc -l < "$work/killed.loss")" -ge 10 ] && break
  sleep 0.1
done
pkill -9 -f -- "--data-log $work/killed.data" || true
wait "$launcher" 2>/dev/null || true
[ -e "$work/ckpt/latest" ] || { tail "$work/killed.out"; echo "FAIL: nothing committed before the kill"; exit 1; }
echo "killed after $(wc -l < "$work/killed.loss") steps; resuming from $(cat "$work/ckpt/latest")"
run 2 resumed --tp 2 "${evals[@]}" --ckpt-dir "$work/ckpt" --resume latest
python3 - "$work" <<'PY'
import collections, glob, os, sys
work = sys.argv[1]
def batches(*names):
    rows = collections.defaultdict(set)
    for name in names:
        for path in glob.glob(os.path.join(work, name + ".data", "*.txt")):
            for line in open(path):
                step, sample, digest = line.split()
                rows[int(step)].add((int(sample), digest))
    return {step: hash(tuple(sorted(r))) for step, r in rows.items()}, rows
straight, _ = batches("straight")
resumed, rows = batches("killed", "resumed")
assert sorted(resumed) == list(range(16)), sorted(resumed)
for step in range(16):
    assert len(rows[step]) == 8, f"step {step}: {len(rows[step])} distinct rows"
    assert resumed[step] == straight[step], f"step {step}: another global batch"
print("the killed and resumed run (4 ranks ep 2, then 2 ranks tp 2) trained on the straight run's 16 global batches")
PY

# Stopped and resumed in the same layout: bitwise.
run 4 first --ep 2 "${evals[@]}" --stop-after 8 --ckpt-dir "$work/same"
run 4 second --ep 2 "${evals[@]}" --ckpt-dir "$work/same" --resume latest
cat "$work/first.loss" "$work/second.loss" > "$work/both.loss"
cmp "$work/both.loss" "$work/straight.loss" || { echo "FAIL: the resumed losses differ from the straight run's"; exit 1; }
diff <(grep -a "validation after" "$work/straight.out" | tail -2) <(grep -a "validation after" "$work/second.out") ||
  { echo "FAIL: the validation losses differ"; exit 1; }
echo "resumed in the same layout: 16 losses and the validations bitwise the straight run's"

# Other data: refused with the field named (exit 2), then allowed.
set +e
"$mpirun" --oversubscribe -np 4 "$train" "${data[@]/90,8,2/80,18,2}" "${model[@]}" --ep 2 --ckpt-dir "$work/same" \
  --resume 8 > "$work/changed.out" 2>&1
code=$?
set -e
[ "$code" -ne 0 ] && grep -aq "split: \"90,8,2\" -> \"80,18,2\"" "$work/changed.out" ||
  { tail "$work/changed.out"; echo "FAIL: a resume against another split was not refused naming it"; exit 1; }
rm -rf "$work/ok" && mkdir "$work/ok" && cp -r "$work/same/step_000008" "$work/ok/"
"$mpirun" --oversubscribe -np 4 "$train" "${data[@]/90,8,2/80,18,2}" "${model[@]}" --ep 2 --ckpt-dir "$work/ok" \
  --resume 8 --data-changed-ok > "$work/ok.out" 2>&1 || { tail "$work/ok.out"; echo "FAIL: --data-changed-ok"; exit 1; }
echo "another split: refused by name, and resumed with --data-changed-ok"

# Validation through the pipeline's forward-only schedule: pp 2 x vpp 2 on 2 ranks, and pp 2 x ep 2 on 4,
# give one rank's validation losses (printed to 6 places).
piped=(--layers 4 --hidden 32 --heads 4 --ffn 48 --experts 8 --topk 2 --seq 32 --batch 8 --dtype float64
       --warmup 2 --steps 4 --microbatches 2 --eval-interval 2 --eval-iters 2)
for variant in "1 one" "2 pp2 --pp 2 --vpp 2" "4 pp2ep2 --pp 2 --ep 2"; do
  set -- $variant
  "$mpirun" --oversubscribe -np "$1" "$train" "${data[@]}" "${piped[@]}" "${@:3}" > "$work/$2.out" 2>&1 ||
    { tail "$work/$2.out"; echo "FAIL: $variant"; exit 1; }
done
python3 - "$work" <<'PY'
import re, sys
def losses(name):
    found = [float(x) for x in re.findall(r"validation after step +\d+ \| loss ([0-9.]+)", open(f"{sys.argv[1]}/{name}.out").read())]
    assert len(found) == 2, (name, found)
    return found
one = losses("one")
for name in ("pp2", "pp2ep2"):
    for a, b in zip(losses(name), one):
        assert abs(a - b) <= 2e-6, (name, a, b)
print(f"validation losses at (pp 2, vpp 2) and (pp 2, ep 2) match one rank's: {one}")
PY

# EOD masking (the text's documents end with no EOD of their own: mask the spaces, id 32). The first
# loss is ln(256) for every target (the output layer starts at zero): compare the third.
run 1 masked --stop-after 3 --eod 32 --eod-mask-loss
run 1 unmasked --stop-after 3
python3 - "$work/masked.loss" "$work/unmasked.loss" <<'PY'
import sys
a, b = (float(open(p).readlines()[2].split()[1]) for p in sys.argv[1:])
assert a != b, "masking changed nothing"
print(f"--eod-mask-loss: third loss {a:.6f} against {b:.6f} unmasked")
PY
echo PASS
