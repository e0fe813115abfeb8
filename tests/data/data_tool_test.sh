#!/usr/bin/env bash
# bulkhead-data convert and inspect: JSONL of token ids (arrays and objects, merged from two files, an EOD
# appended) and text as bytes become indexed datasets whose figures inspect reports; a bad line is named
# by file and line, and nothing is written for it.
# samples writes, for each case in fixtures/cases.json, the training samples Megatron-LM's GPTDataset and
# BlendedDataset drew there (fixtures/*_train.npy), token for token.
# usage: data_tool_test.sh <bulkhead-data>
set -u
tool=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

printf '[5, 6, 7]\n{"input_ids": [70000, 1]}\n\n' >"$work/a.jsonl"
printf '[9]\n' >"$work/b.jsonl"
"$tool" convert "$work/a.jsonl" "$work/b.jsonl" --out "$work/ids" --eod 0 >"$work/out" 2>&1 || fail "convert: $(cat "$work/out")"
grep -q "3 documents, 9 tokens, int32" "$work/out" || fail "convert printed: $(cat "$work/out")"
"$tool" inspect "$work/ids" --json >"$work/ids.json" || fail "inspect failed"
python3 - "$work/ids.json" <<'PY' || fail "inspect --json: $(cat "$work/ids.json")"
import json, sys
figures = json.load(open(sys.argv[1]))
assert figures["dtype"] == "int32" and figures["documents"] == 3 and figures["tokens"] == 9, figures
assert figures["document_tokens"]["max"] == 4 and figures["document_tokens"]["min"] == 2, figures
assert figures["bin_bytes"] == 36, figures
PY

printf 'hello\nworld!\n' >"$work/text.txt"
"$tool" convert "$work/text.txt" --format text --per-line --out "$work/bytes" >/dev/null || fail "text convert failed"
"$tool" inspect "$work/bytes" >"$work/out" || fail "inspect of the text dataset failed"
grep -q "uint16" "$work/out" && grep -q "documents  2" "$work/out" && grep -q "tokens     13" "$work/out" ||
  fail "inspect printed: $(cat "$work/out")"

printf '[1, 2]\n[3, "x"]\n' >"$work/bad.jsonl"
"$tool" convert "$work/bad.jsonl" --out "$work/bad" >"$work/out" 2>&1
[ $? -eq 2 ] || fail "a bad token id did not exit 2: $(cat "$work/out")"
grep -q "bad.jsonl:2" "$work/out" || fail "the bad line is not named: $(cat "$work/out")"
[ -e "$work/bad.idx" ] && fail "an index was written for a refused input"
"$tool" convert "$work/bad.jsonl" --vocab 10 --out "$work/bad" >"$work/out" 2>&1  # refused while writing
[ $? -eq 2 ] || fail "a bad token id with --vocab did not exit 2: $(cat "$work/out")"
ls "$work" | grep -qE '^bad\.(idx|bin)' && fail "files were left for a refused input: $(ls "$work")"
"$tool" inspect "$work/missing" >"$work/out" 2>&1
[ $? -eq 2 ] && grep -q "missing.idx does not exist" "$work/out" || fail "a missing dataset: $(cat "$work/out")"
# samples: the 13 bytes as 2 samples of 4 + 1 tokens (an epoch holds (13 - 1) / 4 = 3); a range past
# the run's samples and a split that leaves the train split empty are refused (exit 2).
"$tool" samples --data-path "$work/bytes" --split 1 --seq 4 --steps 1 --batch 2 --out "$work/s.npy" >"$work/out" ||
  fail "samples: $(cat "$work/out")"
python3 - "$work/s.npy" <<'PY' || fail "samples wrote something else"
import struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<H", raw[8:10])[0]
assert "(2, 5)" in raw[10:10 + n].decode()
rows = struct.unpack("<10q", raw[10 + n:])
# The two documents (lines) in either order: each sample is 5 bytes of them, back to back.
for r in range(2):
    row = bytes(rows[5 * r:5 * r + 5])
    assert row in b"hello\nworld!\n" or row in b"world!\nhello\n", rows
PY
"$tool" samples --data-path "$work/bytes" --split 1 --seq 4 --steps 1 --batch 2 --first 1 --count 2 \
  --out "$work/s.npy" >"$work/out" 2>&1
[ $? -eq 2 ] && grep -q "at most 2" "$work/out" || fail "a range past the run: $(cat "$work/out")"
"$tool" samples --data-path "$work/bytes" --split 0,1 --seq 4 --steps 1 --batch 2 --out "$work/s.npy" >"$work/out" 2>&1
[ $? -eq 2 ] && grep -q "leaves the train split empty" "$work/out" || fail "an empty train split: $(cat "$work/out")"
# Megatron-LM's own samples: one run of `sizes[0]` steps of one sample per case.
python3 - "$tool" "$(dirname "$0")/fixtures" "$work" <<'PY' || fail "samples differ from Megatron-LM's"
import json, struct, subprocess, sys
tool, fixtures, work = sys.argv[1:]
def rows(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<H", raw[8:10])[0]
    return raw[10 + n:]
for case in json.load(open(f"{fixtures}/cases.json"))["cases"]:
    words = [w if w.replace(".", "").isdigit() else f"{fixtures}/{w}" for w in case["blend"]]
    out = f"{work}/{case['name']}.npy"
    subprocess.run([tool, "samples", "--data-path", *words, "--split", case["split"], "--seq", str(case["seq"]),
                    "--seed", str(case["seed"]), "--steps", str(case["sizes"][0]), "--batch", "1", "--out", out],
                   check=True, stdout=subprocess.DEVNULL)
    mine, theirs = rows(out), rows(f"{fixtures}/{case['name']}_train.npy")
    assert len(theirs) == case["sizes"][0] * (case["seq"] + 1) * 8, case["name"]
    assert mine == theirs, f"{case['name']}: the samples differ from Megatron-LM's"
PY
echo "data_tool_test: passed"
