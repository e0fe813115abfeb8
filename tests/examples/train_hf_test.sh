#!/usr/bin/env bash
# train_moe --hf-model DIR --tokens FILE --steps 0 --logits-out OUT on transformers' own fixtures
# (tests/models/fixtures/hf), under mpirun (MPI backend, CPU, float64):
#   - at 1 rank, tp 2 (beyond the one kv head), ep 2 and pp 2 x ep 2, the logits it writes are
#     transformers' float64 logits within 1e-5 and the loss it prints is the fixture's within 1e-7
#     (docs/models.md#numerics says why not closer), in the dtype --logits-dtype asks for;
#   - trained from the Mixtral fixture on an indexed dataset of random ids, the step losses at 1 rank, ep 2 x dp 2 and
#     pp 2 x ep 2 with --recompute (every layer run again in the backward) agree within 1e-12 relative and fall; stopped at step 5 with a checkpoint and resumed at
#     pp 2 x ep 2, steps 6 to 10 are the straight run's within 1e-12; --model-config trains from random weights;
#   - the trained checkpoint exported by bulkhead-ckpt is a Hugging Face folder (config.json,
#     generation_config.json, save_pretrained's names) whose logits, evaluated at 1 rank, are those of the
#     checkpoint itself evaluated at pp 2 x ep 2 within 1e-12;
#   - an error on one rank (a token id past the vocabulary in its batch) ends the job at once, named;
#   - a config.json that is not JSON, an unsupported rope_scaling, a token id beyond the vocabulary (exit
#     code 2, ConfigError) and weights of another config (exit code 7, CheckpointError) end the run with a
#     message naming the problem.
# usage: train_hf_test.sh <train_moe> <bulkhead-data> <bulkhead-ckpt> <mpirun> <repository root>
set -euo pipefail
train=$1 tool=$2 ckpt=$3 mpirun=$4 root=$5
fixtures=$root/tests/models/fixtures/hf
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

evaluate() {  # evaluate <ranks> <case> <name> [flags...]: output <name>.out, logits <name>.safetensors
  local ranks=$1 case=$2 name=$3
  shift 3
  "$mpirun" --oversubscribe -np "$ranks" "$train" --hf-model "$fixtures/$case" \
    --tokens "$fixtures/$case/tokens.safetensors" --steps 0 --dtype float64 --logits-out "$work/$name.safetensors" \
    "$@" > "$work/$name.out" 2>&1 ||
    { tail -30 "$work/$name.out"; echo "FAIL: train_moe $case $* exited non-zero"; exit 1; }
}

compare() {  # compare <case> <name> <dtype>: the logits and the loss against transformers'
  python3 - "$fixtures/$1/reference.safetensors" "$work/$2.safetensors" "$work/$2.out" "$3" <<'PY'
import array, json, re, struct, sys
def read(path, key):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    entry = json.loads(raw[8:8 + n])[key]
    begin, end = entry["data_offsets"]
    values = array.array({"F64": "d", "F32": "f"}[entry["dtype"]])
    values.frombytes(raw[8 + n + begin:8 + n + end])
    return entry, values
reference, got_path, out_path, dtype = sys.argv[1:]
want_entry, want = read(reference, "logits")
got_entry, got = read(got_path, "logits")
assert got_entry["shape"] == want_entry["shape"], (got_entry["shape"], want_entry["shape"])
assert got_entry["dtype"] == dtype, got_entry["dtype"]
error = max(abs(a - b) for a, b in zip(got, want))
_, loss = read(reference, "loss")
printed = float(re.search(r"lm loss ([0-9.]+) over", open(out_path).read()).group(1))
print(f"{got_path}: max logit error {error:.3g}, loss {printed:.12f} against {loss[0]:.12f}")
assert error <= 1e-5, error
assert abs(printed - loss[0]) <= 1e-7 * loss[0], (printed, loss[0])
PY
}

evaluate 1 qwen3_moe_mixed one
compare qwen3_moe_mixed one F64
evaluate 2 qwen3_moe_kv1 tp2 --tp 2
compare qwen3_moe_kv1 tp2 F64
evaluate 2 mixtral ep2 --ep 2 --logits-dtype float32
compare mixtral ep2 F32
evaluate 4 qwen3_moe_mixed pp2ep2 --pp 2 --ep 2
compare qwen3_moe_mixed pp2ep2 F64

# Training from the fixture.
python3 - "$work/ids.jsonl" <<'PY'
import random, sys
rng = random.Random(61)
with open(sys.argv[1], "w") as f:
    for _ in range(200):
        f.write(str([rng.randrange(151) for _ in range(rng.randrange(5, 80))]) + "\n")
PY
"$tool" convert "$work/ids.jsonl" --out "$work/ids" --vocab 151 > /dev/null
training=(--hf-model "$fixtures/mixtral" --data-path "$work/ids" --split 100,0,0 --seq 16 --batch 8
          --steps 10 --warmup 2 --dtype float64)
train() {  # train <ranks> <name> [flags...]: loss log <name>.loss
  local ranks=$1 name=$2
  shift 2
  "$mpirun" --oversubscribe -np "$ranks" "$train" "${training[@]}" --loss-log "$work/$name.loss" "$@" \
    > "$work/$name.out" 2>&1 || { tail -30 "$work/$name.out"; echo "FAIL: train_moe $* exited non-zero"; exit 1; }
}
train 1 straight
train 4 ep2 --ep 2
train 4 pp2ep2 --pp 2 --ep 2 --recompute  # each layer recomputed in the backward: the same losses
train 4 stopped --ep 2 --stop-after 5 --ckpt-dir "$work/ckpt"
train 4 resumed --pp 2 --ep 2 --ckpt-dir "$work/ckpt" --resume latest
python3 - "$work" <<'PY'
import sys
work = sys.argv[1]
def losses(name):
    return {int(s): float(l) for s, l, _ in (line.split() for line in open(f"{work}/{name}.loss"))}
straight = losses("straight")
assert sorted(straight) == list(range(10)), sorted(straight)
assert straight[9] < straight[0] - 0.01, (straight[0], straight[9])
for name in ("ep2", "pp2ep2", "stopped", "resumed"):
    got = losses(name)
    for step, loss in got.items():
        assert abs(loss - straight[step]) <= 1e-12 * straight[step], (name, step, loss, straight[step])
    print(f"{name}: steps {min(got)}..{max(got)} within 1e-12 of one rank's losses")
assert sorted(losses("resumed")) == list(range(5, 10)), sorted(losses("resumed"))
PY
# The export of the trained checkpoint (step 10) against the checkpoint itself.
"$ckpt" export "$work/ckpt" --to "$work/export" > "$work/export.out"
cmp "$work/export/config.json" "$fixtures/mixtral/config.json"
grep -q '"eos_token_id"' "$work/export/generation_config.json"
grep -q '"model.layers.1.block_sparse_moe.experts.3.w3.weight"' "$work/export/model.safetensors.index.json" ||
  grep -qa 'model.layers.1.block_sparse_moe.experts.3.w3.weight' "$work/export/"*.safetensors
tokens=(--tokens "$fixtures/mixtral/tokens.safetensors" --steps 0 --dtype float64)
"$mpirun" --oversubscribe -np 4 "$train" --model-config "$fixtures/mixtral/config.json" --ckpt-dir "$work/ckpt" \
  --resume latest --pp 2 --ep 2 "${tokens[@]}" --logits-out "$work/trained.safetensors" > "$work/trained.out" 2>&1 ||
  { tail -20 "$work/trained.out"; echo "FAIL: evaluating the checkpoint"; exit 1; }
"$mpirun" --oversubscribe -np 1 "$train" --hf-model "$work/export" "${tokens[@]}" \
  --logits-out "$work/exported.safetensors" > "$work/exported.out" 2>&1 ||
  { tail -20 "$work/exported.out"; echo "FAIL: evaluating the export"; exit 1; }
python3 - "$work/trained.safetensors" "$work/exported.safetensors" "$fixtures/mixtral/reference.safetensors" <<'PY'
import array, json, struct, sys
def logits(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + n])["logits"]["data_offsets"]
    values = array.array("d")
    values.frombytes(raw[8 + n + begin:8 + n + end])
    return values
trained, exported, untrained = (logits(p) for p in sys.argv[1:])
same = max(abs(a - b) for a, b in zip(trained, exported))
moved = max(abs(a - b) for a, b in zip(trained, untrained))
print(f"export: logits {same:.3g} from the checkpoint's, {moved:.3g} from the untrained fixture's")
assert same <= 1e-12, same
assert moved > 1e-3, moved
PY
grep -q "loaded the weights of step 10" "$work/trained.out" || { cat "$work/trained.out"; echo "FAIL: step 10"; exit 1; }

# An error on one rank ends the job at once: rank 1's batch holds id 150, past qwen3_moe_kv1's 150 words.
started=$(date +%s) status=0
"$mpirun" --oversubscribe -np 2 "$train" --hf-model "$fixtures/qwen3_moe_kv1" --ep 2 --data-path "$work/ids" \
  --split 100,0,0 --seq 16 --batch 8 --steps 4 --warmup 2 --dtype float64 > "$work/one_rank.out" 2>&1 || status=$?
elapsed=$(($(date +%s) - started))
grep -q "holds token id 150, outside the model's vocabulary of 150" "$work/one_rank.out" && [ "$status" = 2 ] &&
  [ "$elapsed" -lt 20 ] || { tail -20 "$work/one_rank.out"; echo "FAIL: exit $status after $elapsed s"; exit 1; }
echo "one rank's error: exit $status after $elapsed s"

"$mpirun" --oversubscribe -np 1 "$train" --model-config "$fixtures/qwen3_moe_mixed/config.json" --data-path "$work/ids" \
  --split 100,0,0 --seq 16 --batch 4 --steps 3 --warmup 1 > "$work/random.out" 2>&1 ||
  { tail -20 "$work/random.out"; echo "FAIL: --model-config"; exit 1; }
grep -qF "qwen3_moe from $fixtures/qwen3_moe_mixed/config.json, random weights" "$work/random.out" ||
  { cat "$work/random.out"; echo "FAIL: --model-config did not say what it trains"; exit 1; }

refused() {  # refused <code> <text> <folder> <tokens>: train_moe exits <code>, naming <text>
  local code=$1 text=$2 folder=$3 tokens=$4 status=0
  "$mpirun" --oversubscribe -np 1 "$train" --hf-model "$folder" --tokens "$tokens" --steps 0 --dtype float64 \
    > "$work/refused.out" 2>&1 || status=$?
  if [ "$status" != "$code" ] || ! grep -qF -- "$text" "$work/refused.out"; then
    tail -20 "$work/refused.out"
    echo "FAIL: expected exit $code naming '$text', got exit $status"
    exit 1
  fi
}
tokens=$fixtures/qwen3_moe_mixed/tokens.safetensors
cp -r "$fixtures/qwen3_moe_mixed" "$work/broken"
printf '{"model_type": "qwen3_moe", ' > "$work/broken/config.json"
refused 2 "broken/config.json: not JSON" "$work/broken" "$tokens"
python3 - "$fixtures/qwen3_moe_mixed/config.json" "$work/broken/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
json.dump(config, open(sys.argv[2], "w"))
PY
refused 2 "rope_scaling.rope_type" "$work/broken" "$tokens"
python3 - "$work/high.safetensors" <<'PY'
import json, struct, sys
ids = [5, 17, 151, 3]  # 151: one past the vocabulary of qwen3_moe_mixed
header = json.dumps({"input_ids": {"dtype": "I64", "shape": [1, 4], "data_offsets": [0, 32]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + struct.pack("<4q", *ids))
PY
refused 2 "ids run from 3 to 151, outside the model's vocabulary [0, 151)" "$fixtures/qwen3_moe_mixed" \
  "$work/high.safetensors"
cp -r "$fixtures/qwen3_moe_kv1" "$work/shape"
cp "$fixtures/qwen3_moe_mixed/config.json" "$work/shape/config.json"
refused 7 "tensor 'lm_head.weight' is missing: the config (vocab_size, hidden_size = [151, 32])" "$work/shape" "$tokens"
echo "train_hf: passed"
