#!/usr/bin/env bash
# Every tool, example and bench binary has the same command line: --help prints
# the usage on stdout and exits 0, --version prints "<name> <version>" and exits
# 0, and an unknown flag or a bad value names the flag on stderr and exits 2,
# starting nothing.
# usage: cli_test.sh <bin dir> <version> <binary>...
set -u
bin=$1 version=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Two halves of the binaries at once: each check starts a process that loads libtorch.
if [ -z "${CLI_TEST_PART:-}" ] && [ $# -gt 1 ]; then
  half=$((($# + 1) / 2))
  CLI_TEST_PART=1 bash "$0" "$bin" "$version" "${@:1:half}" >"$work/first" 2>&1 &
  first=$!
  CLI_TEST_PART=2 bash "$0" "$bin" "$version" "${@:half+1}" >"$work/second" 2>&1
  second=$?
  wait "$first"
  first=$?
  cat "$work/first" "$work/second"
  [ "$first" -eq 0 ] && [ "$second" -eq 0 ]
  exit
fi
failures=0 checks=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# run <name> <expected exit> <args...>: runs bin/<name>, output in $work/out and $work/err.
run() {
  local name=$1 expected=$2
  shift 2
  checks=$((checks + 1))
  timeout 30 "$bin/$name" "$@" >"$work/out" 2>"$work/err"
  local code=$?
  if [ "$code" -ne "$expected" ]; then
    fail "$name $*: exit $code, expected $expected"
    sed 's/^/    /' "$work/out" "$work/err" | head -20
    return 1
  fi
}
# bad <name> <flag named in the error> <args...>: exit 2 and the flag named on stderr.
bad() {
  local name=$1 flag=$2
  shift 2
  run "$name" 2 "$@" || return
  grep -qF -- "$flag" "$work/err" || fail "$name $*: stderr does not name $flag: $(cat "$work/err")"
  [ -s "$work/out" ] && fail "$name $*: printed on stdout: $(head -3 "$work/out")"
  return 0
}

for name in "$@"; do
  [ -x "$bin/$name" ] || { fail "$name was not built"; continue; }
  if run "$name" 0 --help; then
    grep -q "^Usage: $name" "$work/out" || fail "$name --help: no 'Usage: $name' line on stdout"
    grep -q -- "--version" "$work/out" || fail "$name --help: --version not listed"
    [ -s "$work/err" ] && fail "$name --help wrote to stderr: $(head -3 "$work/err")"
  fi
  if run "$name" 0 -h; then grep -q "^Usage: $name" "$work/out" || fail "$name -h: no usage"; fi
  if run "$name" 0 --version; then
    [ "$(cat "$work/out")" = "$name $version" ] || fail "$name --version printed '$(cat "$work/out")'"
  fi
  bad "$name" --no-such-flag --no-such-flag
  bad "$name" --bogus-option --bogus-option=3
done

# Bad values name their flag.
for name in "$@"; do
  case $name in
    train_moe)
      bad train_moe --tp --tp two
      bad train_moe --ep --ep 0
      bad train_moe --dtype --dtype float16
      bad train_moe --lr --lr -1
      bad train_moe --steps --steps
      bad train_moe --backend --backend gloo-typo ;;
    custom_trainer)
      bad custom_trainer --ep --ep x ;;
    bulkhead-doctor)
      bad bulkhead-doctor --bytes --bytes 4Q
      bad bulkhead-doctor --tp --tp -2
      bad bulkhead-doctor --deadline --deadline 0 ;;
    bulkhead-collectives)
      bad bulkhead-collectives --sizes --sizes 4K,oops
      bad bulkhead-collectives --iters --iters 0 ;;
    bulkhead-ckpt)
      if run bulkhead-ckpt 2; then grep -qi "subcommand" "$work/err" || fail "no subcommand: $(cat "$work/err")"; fi
      bad bulkhead-ckpt DIR inspect
      bad bulkhead-ckpt --threads verify /tmp --threads 0
      bad bulkhead-ckpt frobnicate frobnicate /tmp
      if run bulkhead-ckpt 0 verify --help; then
        grep -q -- "--threads" "$work/out" || fail "bulkhead-ckpt verify --help lists no --threads"
      fi ;;
    bulkhead-data)
      if run bulkhead-data 2; then grep -qi "subcommand" "$work/err" || fail "no subcommand: $(cat "$work/err")"; fi
      bad bulkhead-data --format convert "$bin/bulkhead-data" --out "$work/x" --format csv
      bad bulkhead-data --vocab convert "$bin/bulkhead-data" --out "$work/x" --vocab 0 ;;
    bulkhead-ckpt-bench)
      bad bulkhead-ckpt-bench --dir --phase save
      bad bulkhead-ckpt-bench --phase --dir /tmp --phase both ;;
    bulkhead-nccl-bench)
      bad bulkhead-nccl-bench --max-bytes --max-bytes 1T ;;
    bulkhead-moe-bench)
      bad bulkhead-moe-bench --tokens --tokens many ;;
    bulkhead-groups-bench)
      bad bulkhead-groups-bench --ep --ep 1.5 ;;
  esac
done

echo "cli_test: $checks runs of $# binaries, $failures failures"
[ "$failures" -eq 0 ]
