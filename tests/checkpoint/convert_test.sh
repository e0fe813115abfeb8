#!/usr/bin/env bash
# Checkpoints that travel, whole jobs: train_moe (float64) saves at ep 2 on 4
# ranks; bulkhead-ckpt exports it as safetensors (an independent Python reader
# checks every tensor against the HDF5 rank files), imports it back, and
# train_moe resumes from the import at ep 1 on 2 ranks and at ep 4 on 4 ranks:
# the first step's loss equals the straight run's within 1e-9. With the
# optimizer state exported too, `diff` finds every key equal and the resumed
# run follows the straight one step for step. A damaged file is refused with
# exit code 7.
# usage: convert_test.sh <train_moe> <bulkhead-ckpt> <mpirun> <key map> <read_safetensors.py>
set -u
train=$1 tool=$2 mpirun=$3 map=$4 reader=$5
python=/usr/bin/python3  # the distribution's, where python3-numpy and python3-h5py install
[ -x "$python" ] || python=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*"; for log in "$work"/*.log; do echo "--- $log:"; tail -30 "$log"; done; exit 1; }
flags=(--dtype float64 --steps 40 --hidden 64 --experts 8 --topk 2)
run() {  # run LOG NP ARGS...
  local log=$1 np=$2
  shift 2
  timeout 180 "$mpirun" --oversubscribe -np "$np" "$train" "${flags[@]}" "$@" >"$log" 2>&1
}
loss_at() { awk -v s="$2" '$1 == s { print $2 }' "$1"; }
same_loss() {  # same_loss A B: within 1e-9
  awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-9) }'
}

run straight.log 4 --ep 2 --stop-after 7 --loss-log straight.txt || fail "the straight run failed"
run save.log 4 --ep 2 --stop-after 5 --ckpt-dir A || fail "the run that saves step 5 failed"

"$tool" export A --to hf --map "$map" --shard-size 1MB >export.log 2>&1 || fail "export failed"
[ "$(ls hf/model-*.safetensors | wc -l)" -gt 1 ] || fail "a 1 MB shard size gave one file"
"$python" "$reader" hf A/step_000005 >reader.log 2>&1 || fail "the Python reader disagrees with the checkpoint"
cat reader.log
"$tool" import hf --to B --map "$map" --step 5 >import.log 2>&1 || fail "import failed"

expected=$(loss_at straight.txt 5)
for layout in "2 1" "4 4"; do
  set -- $layout
  cp -r B "B$2"
  run "resume_ep$2.log" "$1" --ep "$2" --stop-after 6 --ckpt-dir "B$2" --resume latest --loss-log "ep$2.txt" ||
    fail "the run resumed at ep $2 on $1 ranks failed"
  grep -q "optimizer starts afresh" "resume_ep$2.log" || fail "the resumed run did not say its optimizer starts afresh"
  got=$(loss_at "ep$2.txt" 5)
  same_loss "$expected" "$got" || fail "resumed at ep $2 on $1 ranks: first loss $got, the straight run's $expected"
  echo "ep $2 on $1 ranks: first loss $got (straight run: $expected)"
done

# Weights and optimizer state: every key equal, and the resumed run follows the straight one.
"$tool" export A --to hf_all --map "$map" --with-optimizer >>export.log 2>&1 || fail "export --with-optimizer failed"
"$tool" import hf_all --to C --map "$map" --step 5 >>import.log 2>&1 || fail "import with the optimizer state failed"
"$tool" diff A C >diff.log 2>&1 || fail "diff of the original and the re-imported checkpoint exited $?"
grep -q " 0 differ, 0 only in A, 0 only in B" diff.log || fail "diff: $(tail -1 diff.log)"
grep -q "equal" diff.log && ! grep -v -E "equal|^A:|^B:|^key|^$| 0 differ" diff.log | grep -q . || fail "diff: a key is not equal"
run resume_all.log 4 --ep 4 --stop-after 7 --ckpt-dir C --resume latest --loss-log all.txt || fail "the run resumed with optimizer state failed"
for step in 5 6; do
  same_loss "$(loss_at straight.txt $step)" "$(loss_at all.txt $step)" ||
    fail "with optimizer state, step $step: $(loss_at all.txt $step) against $(loss_at straight.txt $step)"
done
"$tool" diff A C --step-b 7 >diff2.log 2>&1
[ $? -eq 1 ] || fail "diff of different steps did not exit 1"

# A damaged file: exit code 7 and the problem named.
cp -r hf broken
file=$(ls broken/model-*.safetensors | head -1)
truncate -s 100 "$file"
"$tool" import broken --to D --map "$map" >broken.log 2>&1
code=$?
[ $code -eq 7 ] || fail "importing a truncated file exited $code"
grep -q "runs past the end of the file\|outside the" broken.log || fail "the refusal does not name the problem: $(cat broken.log)"
[ ! -e D/latest ] || fail "a refused import committed a checkpoint"
echo "convert_test: passed"
