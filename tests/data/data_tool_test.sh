#!/usr/bin/env bash
# bulkhead-data convert and inspect: JSONL of token ids (arrays and objects, merged from two files, an EOD
# appended) and text as bytes become indexed datasets whose figures inspect reports; a bad line is named
# by file and line, and nothing is written for it.
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
echo "data_tool_test: passed"
