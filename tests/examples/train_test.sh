#!/usr/bin/env bash
# The training example end to end, under mpirun (MPI backend, CPU):
#   falls    the loss of the README's run falls well below its start
#   resume   2N steps straight == N steps, stop, resume for N (bitwise: losses
#            and every rank's parameter digest); going back to step N in that
#            folder commits step 2N again; resuming at another ep, dp or
#            tp (expert-tp slices the experts' w13 and w2 along F) matches
#            within 1e-9 relative (float64)
#   layouts  (ep1,dp1) (ep2,dp2) (ep4) (tp2,ep2): the same 20-step loss curve
#   pipeline (pp 1) (pp 2) (pp 4) (pp 2, ep 2) (pp 2, tp 2) (pp 2, vpp 2) and one rank, 4
#            micro-batches: the same 10-step loss curve within 1e-12 (float64), and
#            with a tied embedding at (pp 2) (pp 4) (pp 2, vpp 2); a
#            checkpoint saved at (pp 2, ep 2) resumes at (pp 1), (pp 4) and (pp 2, ep 1)
#            within 1e-9 of the straight run; --pp 2 on the README's run: the loss falls
#            like the pp 1 run's
#   width    the first loss is within 10% of ln(256) (a uniform guess over bytes)
#            at widths 64, 256 and 1024 (16 experts, top-2, float32); at width 256
#            on 4 ranks, the first layer's load at step 20 is below twice the
#            mean (imbalance < 2), for two seeds
#   gpu      bf16 on one GPU (the MoE layers' device-side dropless path, the
#            loss read behind its all-reduce, the optimizer's kernels): the
#            first loss is ln(256), the loss falls, every loss and norm is
#            finite; skipped (77) without a GPU
# usage: train_test.sh falls|resume|layouts|pipeline|width|gpu <train_moe> <mpirun>
set -euo pipefail
mode=$1 train=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # run <ranks> <loss-log> [flags...]
  local ranks=$1 log=$2
  shift 2
  "$mpirun" --oversubscribe -np "$ranks" "$train" --loss-log "$log" "$@" > "$work/out.txt" 2>&1 ||
    { tail -30 "$work/out.txt"; echo "FAIL: train_moe $* exited non-zero"; exit 1; }
}
# compare <a> <b> <relative tolerance>: same steps, losses within tolerance (0: bitwise).
compare() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys
def read(path):
    return {int(s): l for s, l, _ in (line.split() for line in open(path))}
a, b, tol = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
assert a.keys() == b.keys() and a, f"steps differ: {sorted(a)} vs {sorted(b)}"
worst = 0.0
for step in sorted(a):
    if tol == 0:
        assert a[step] == b[step], f"step {step}: loss {a[step]} != {b[step]}"
    else:
        x, y = float(a[step]), float(b[step])
        worst = max(worst, abs(x - y) / abs(y))
        assert abs(x - y) <= tol * abs(y), f"step {step}: loss {x} vs {y} (relative {abs(x - y) / abs(y):.3g})"
print(f"{len(a)} steps agree: {sys.argv[1]} vs {sys.argv[2]} (worst relative difference {worst:.3g})")
PY
}
# With a shared expert, so its stacked w13 goes through the checkpoints and every layout too.
small=(--layers 2 --hidden 32 --heads 4 --ffn 48 --experts 8 --topk 2 --shared-ffn 16 --seq 32 --batch 8 --dtype float64
       --warmup 4)

case "$mode" in
  width)
    for hidden in 64 256 1024; do
      run 4 "$work/width$hidden.txt" --ep 2 --hidden "$hidden" --heads 8 --experts 16 --topk 2 --steps 100 \
        --stop-after 2 --seq 32 --batch 8
      python3 - "$work/width$hidden.txt" "$hidden" <<'PY'
import math, sys
first = float(open(sys.argv[1]).readline().split()[1])
print(f"hidden {sys.argv[2]}: first loss {first:.4f}, ln(256) = {math.log(256):.4f}")
assert abs(first - math.log(256)) <= 0.1 * math.log(256), "the first loss is not within 10% of ln(256)"
PY
    done
    for seed in 1 2; do
      run 4 "$work/balance$seed.txt" --hidden 256 --experts 16 --topk 2 --seed "$seed" --stop-after 20 --log-interval 1
      line=$(grep -a "step    20 |" "$work/out.txt") || { tail -5 "$work/out.txt"; echo "FAIL: no step 20 line"; exit 1; }
      imbalance=$(sed 's/.*imbalance \([0-9.]*\).*/\1/' <<< "$line")
      echo "hidden 256, seed $seed: imbalance $imbalance at step 20"
      python3 -c "import sys; sys.exit(0 if float('$imbalance') < 2 else 1)" ||
        { echo "FAIL: the first layer's load at step 20 is $imbalance x the mean (want < 2)"; exit 1; }
    done
    ;;
  falls)
    run 4 "$work/loss.txt" --ep 2 --steps 200 --stop-after 120
    python3 - "$work/loss.txt" <<'PY'
import sys
losses = [float(line.split()[1]) for line in open(sys.argv[1])]
first, last = losses[0], sum(losses[-10:]) / 10
print(f"loss {first:.3f} at step 0, {last:.3f} over the last 10 of {len(losses)} steps")
assert last < 0.5 * first, "the loss did not fall below half its starting value"
PY
    ;;
  resume)
    run 4 "$work/straight.txt" --ep 2 --steps 16 "${small[@]}" --digest
    grep -a "parameter digest" "$work/out.txt" | tr -d '\r' | sed 's/.*parameter digest/parameter digest/' > "$work/straight.digest"
    run 4 "$work/resumed.txt" --ep 2 --steps 16 --stop-after 8 --ckpt-dir "$work/ckpt" "${small[@]}"
    run 4 "$work/resumed.txt" --ep 2 --steps 16 --ckpt-dir "$work/ckpt" --resume latest "${small[@]}" --digest
    grep -a "parameter digest" "$work/out.txt" | tr -d '\r' | sed 's/.*parameter digest/parameter digest/' > "$work/resumed.digest"
    compare "$work/resumed.txt" "$work/straight.txt" 0
    diff "$work/straight.digest" "$work/resumed.digest" && echo "parameters bitwise equal: $(cat "$work/straight.digest")"
    # Going back to step 8 in the same folder (past a loss spike, say): the run commits its own step 16,
    # the one it went back from moves aside, and the losses are the straight run's again.
    head -8 "$work/straight.txt" > "$work/back.txt"
    run 4 "$work/back.txt" --ep 2 --steps 16 --ckpt-dir "$work/ckpt" --resume 8 "${small[@]}"
    grep -aq "checkpoint step 16 committed" "$work/out.txt" || { tail -5 "$work/out.txt"; echo "FAIL: no commit after going back"; exit 1; }
    ls -d "$work"/ckpt/step_000016.superseded.* > /dev/null || { ls "$work/ckpt"; echo "FAIL: step 16 not moved aside"; exit 1; }
    compare "$work/back.txt" "$work/straight.txt" 0
    # The step-8 checkpoint (alone in a folder of its own each time) resumed at ep 4 on 4 ranks,
    # at ep 1 on 2 ranks (dp 2), and at tp 2 ep 2 on 4 ranks (expert-tp 2); each run's final
    # save must commit too.
    for variant in "4 ep4 --ep 4" "2 dp2 --ep 1" "4 tp2 --tp 2 --ep 2"; do
      set -- $variant
      rm -rf "$work/$2.ckpt" && mkdir "$work/$2.ckpt" && cp -r "$work/ckpt/step_000008" "$work/$2.ckpt/"
      head -8 "$work/straight.txt" > "$work/$2.txt"
      run "$1" "$work/$2.txt" "${@:3}" --steps 16 --ckpt-dir "$work/$2.ckpt" --resume 8 "${small[@]}"
      grep -aq "checkpoint step 16 committed" "$work/out.txt" || { tail -5 "$work/out.txt"; echo "FAIL: no commit"; exit 1; }
      compare "$work/$2.txt" "$work/straight.txt" 1e-9
    done
    ;;
  layouts)
    run 1 "$work/ep1.txt" --steps 20 "${small[@]}"
    run 4 "$work/ep2.txt" --ep 2 --steps 20 "${small[@]}"
    run 4 "$work/ep4.txt" --ep 4 --steps 20 "${small[@]}"
    run 4 "$work/tp2ep2.txt" --tp 2 --ep 2 --steps 20 "${small[@]}"
    for layout in ep2 ep4 tp2ep2; do compare "$work/$layout.txt" "$work/ep1.txt" 1e-9; done
    ;;
  pipeline)
    piped=(--layers 4 --hidden 32 --heads 4 --ffn 48 --experts 8 --topk 2 --shared-ffn 16 --seq 32 --batch 16
           --dtype float64 --warmup 4 --microbatches 4)
    run 1 "$work/one.txt" --steps 10 "${piped[@]}"
    for variant in "pp1 --ep 2" "pp2 --pp 2" "pp4 --pp 4" "pp2ep2 --pp 2 --ep 2" "pp2tp2 --pp 2 --tp 2" \
                   "pp2vpp2 --pp 2 --vpp 2"; do
      set -- $variant
      run 4 "$work/$1.txt" "${@:2}" --steps 10 "${piped[@]}"
      compare "$work/$1.txt" "$work/one.txt" 1e-12
    done
    # Tied, the last stage holds a copy of the embedding whose gradient is summed with the first stage's.
    run 1 "$work/one_tied.txt" --steps 10 --tied-embedding "${piped[@]}"
    for variant in "pp2 --pp 2" "pp4 --pp 4" "pp2vpp2 --pp 2 --vpp 2"; do
      set -- $variant
      run 4 "$work/$1_tied.txt" "${@:2}" --steps 10 --tied-embedding "${piped[@]}"
      compare "$work/$1_tied.txt" "$work/one_tied.txt" 1e-12
    done
    # Saved at (pp 2, ep 2) at step 6, resumed in three other layouts.
    run 4 "$work/straight.txt" --pp 2 --ep 2 --steps 12 "${piped[@]}"
    run 4 "$work/saved.txt" --pp 2 --ep 2 --steps 12 --stop-after 6 --ckpt-dir "$work/ckpt" "${piped[@]}"
    for variant in "4 pp1 --ep 2" "4 pp4 --pp 4" "4 pp2ep1 --pp 2 --ep 1"; do
      set -- $variant
      rm -rf "$work/$2.ckpt" && mkdir "$work/$2.ckpt" && cp -r "$work/ckpt/step_000006" "$work/$2.ckpt/"
      head -6 "$work/straight.txt" > "$work/resumed_$2.txt"
      run "$1" "$work/resumed_$2.txt" "${@:3}" --steps 12 --ckpt-dir "$work/$2.ckpt" --resume 6 "${piped[@]}"
      compare "$work/resumed_$2.txt" "$work/straight.txt" 1e-9
    done
    # The README's run at pp 2 (2 layers, one a stage): the loss falls as at pp 1.
    run 4 "$work/readme_pp1.txt" --ep 2 --steps 200 --stop-after 60
    run 4 "$work/readme_pp2.txt" --pp 2 --steps 200 --stop-after 60
    python3 - "$work/readme_pp1.txt" "$work/readme_pp2.txt" <<'PY'
import sys
curves = [[float(line.split()[1]) for line in open(path)] for path in sys.argv[1:]]
ends = [sum(c[-10:]) / 10 for c in curves]
print(f"loss over steps 51-60: pp 1 {ends[0]:.4f}, pp 2 {ends[1]:.4f} (from {curves[1][0]:.4f})")
assert ends[1] < 0.6 * curves[1][0], "the pp 2 run's loss did not fall"
assert abs(ends[1] - ends[0]) < 0.05 * ends[0], "the pp 2 run's loss falls unlike the pp 1 run's"
PY
    ;;
  gpu)
    if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
      echo "SKIPPED: no GPU on this machine (nvidia-smi lists none); the GPU tests run on the device machine"
      exit 77
    fi
    run 1 "$work/gpu.txt" --backend nccl --dtype bfloat16 --layers 2 --hidden 256 --heads 4 --ffn 256 --experts 8 \
      --topk 2 --seq 128 --batch 16 --steps 60 --warmup 10 --log-interval 20
    line=$(grep -a "step    60 |" "$work/out.txt") || { tail -5 "$work/out.txt"; echo "FAIL: no step 60 line"; exit 1; }
    echo "$line"
    grep -q "TFLOP/s" <<< "$line" || { echo "FAIL: the GPU log line has no TFLOP/s"; exit 1; }
    python3 - "$work/gpu.txt" "$line" <<'PY'
import math, sys
rows = [line.split() for line in open(sys.argv[1])]
losses = [float(r[1]) for r in rows]
assert len(losses) == 60 and all(math.isfinite(x) for x in losses), "a loss is missing or not finite"
assert all(math.isfinite(float(r[2])) for r in rows), "a gradient norm is not finite"
print(f"bf16 on one GPU: first loss {losses[0]:.4f} (ln 256 = {math.log(256):.4f}), step 60 {losses[-1]:.4f}")
assert abs(losses[0] - math.log(256)) <= 0.01 * math.log(256), "the first loss is not ln(256)"
assert sum(losses[-10:]) / 10 < 0.7 * losses[0], "the loss did not fall"
printed = float(sys.argv[2].split("| loss ")[1].split()[0])
assert abs(printed - losses[-1]) <= 5e-5, f"the logged loss {printed} is not the step's {losses[-1]}"
PY
    ;;
  *) echo "usage: $0 falls|resume|layouts|pipeline|width|gpu <train_moe> <mpirun>" >&2; exit 2 ;;
esac
