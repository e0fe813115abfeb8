#!/usr/bin/env bash
# Each rank's peak host memory while train_moe loads a Hugging Face folder of a few GB on 4 CPU ranks,
# beside its own share of the weights, in one command. The folder is a Qwen3-MoE written here in
# save_pretrained's form (bf16, one tensor per expert and projection, sharded files with an index):
# hidden 2048, 4 layers, 32 experts top-4, expert hidden 1536, vocabulary 32,768 (1.39B parameters, 2.8 GB).
# train_moe --hf-model DIR --tokens FILE --steps 0 loads it in float32 at ep 4 and at tp 2 x ep 2 and
# evaluates 4 rows of 16 tokens; each rank's peak resident memory (getrusage, through /usr/bin/time) less
# that of the same run of a tiny model (the process without the weights) is what loading cost it.
#   bench/run_hf_load_memory.sh [build-dir] [out-file]
# Env: COMMIT (the commit to record; default git's HEAD), MPIRUN (default mpirun).
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/hf_load_memory_$(date +%Y%m%d).md}
mpirun=${MPIRUN:-mpirun}
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import json, math, os, random, struct, sys
work = sys.argv[1]
H, L, E, K, F, V, NH, KV, D = 2048, 4, 32, 4, 1536, 32768, 16, 4, 128
config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H,
          "num_hidden_layers": L, "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": F,
          "intermediate_size": 4096, "vocab_size": V, "num_attention_heads": NH, "num_key_value_heads": KV,
          "head_dim": D, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
          "max_position_embeddings": 4096, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "router_aux_loss_coef": 0.001,
          "initializer_range": 0.02, "use_sliding_window": False, "sliding_window": None}
for name, c in (("folder", config), ("tiny", dict(config, hidden_size=64, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, vocab_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=16))):
    os.makedirs(f"{work}/{name}", exist_ok=True)
    json.dump(c, open(f"{work}/{name}/config.json", "w"), indent=2)
shapes = [("model.embed_tokens.weight", (V, H)), ("lm_head.weight", (V, H)), ("model.norm.weight", (H,))]
for i in range(L):
    p = f"model.layers.{i}"
    shapes += [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,)),
               (f"{p}.self_attn.q_proj.weight", (NH * D, H)), (f"{p}.self_attn.k_proj.weight", (KV * D, H)),
               (f"{p}.self_attn.v_proj.weight", (KV * D, H)), (f"{p}.self_attn.o_proj.weight", (H, NH * D)),
               (f"{p}.self_attn.q_norm.weight", (D,)), (f"{p}.self_attn.k_norm.weight", (D,)),
               (f"{p}.mlp.gate.weight", (E, H))]
    for j in range(E):
        shapes += [(f"{p}.mlp.experts.{j}.gate_proj.weight", (F, H)), (f"{p}.mlp.experts.{j}.up_proj.weight", (F, H)),
                   (f"{p}.mlp.experts.{j}.down_proj.weight", (H, F))]
# Random bf16 of magnitude 2^-7 to 2^-5 and random sign: exponent 120 or 121, random mantissa (little-endian:
# the low byte is the exponent's last bit and the mantissa, the high byte the sign and the exponent's first 7).
high = bytes(0x3C | (b & 0x80) for b in range(256))
def values(key, n):
    if key.endswith("norm.weight"):
        return b"\x80\x3f" * n  # 1.0
    out = bytearray(2 * n)
    out[0::2] = os.urandom(n)
    out[1::2] = os.urandom(n).translate(high)
    return bytes(out)
files, current, weight_map, total = [], [], {}, 0
def flush():
    name = f"model-{len(files) + 1:05d}.safetensors"
    header, offset = {}, 0
    for key, shape in current:
        n = math.prod(shape) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
        weight_map[key] = name
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(f"{work}/folder/{name}", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, shape in current:
            f.write(values(key, math.prod(shape)))
    files.append(name)
    current.clear()
size = 0
for key, shape in shapes:
    current.append((key, shape))
    size += math.prod(shape) * 2
    total += math.prod(shape) * 2
    if size >= 1 << 30:
        flush()
        size = 0
if current:
    flush()
json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
          open(f"{work}/folder/model.safetensors.index.json", "w"), indent=2)
rng = random.Random(1)
ids = [rng.randrange(256) for _ in range(4 * 16)]  # below both vocabularies
header = json.dumps({"input_ids": {"dtype": "I64", "shape": [4, 16], "data_offsets": [0, 8 * len(ids)]}}).encode()
header += b" " * (-len(header) % 8)
open(f"{work}/tokens.safetensors", "wb").write(struct.pack("<Q", len(header)) + header + struct.pack(f"<{len(ids)}q", *ids))
print(f"wrote {len(files)} files, {total / 1e9:.2f} GB")
PY
gb=$(du -sb "$work/folder" | awk '{ printf "%.2f", $1 / 1e9 }')

peaks() {  # peaks <name> <model flags...>: each rank's peak RSS in kB, one per line, rank order
  local name=$1
  shift
  "$mpirun" --oversubscribe -np 4 bash -c 'exec /usr/bin/time -o "$0.$OMPI_COMM_WORLD_RANK" -f %M "$@"' \
    "$work/$name" "$build/bin/train_moe" "$@" --tokens "$work/tokens.safetensors" --steps 0 --dtype float32 \
    >"$work/$name.out" 2>&1 || { tail -20 "$work/$name.out"; echo "FAIL: train_moe $*" >&2; exit 1; }
  for r in 0 1 2 3; do tail -1 "$work/$name.$r"; done
}
rows=()
for layout in "--ep 4" "--tp 2 --ep 2"; do
  # shellcheck disable=SC2086
  mapfile -t base < <(peaks base --model-config "$work/tiny/config.json" $layout)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  mapfile -t load < <(peaks load --hf-model "$work/folder" $layout)
  seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  loaded=$(grep -o 'loaded .*' "$work/load.out" | head -1)
  echo "$layout: $loaded; run ${seconds} s"
  for r in 0 1 2 3; do
    rows+=("$(python3 - "$layout" "$r" "${base[$r]}" "${load[$r]}" <<'PY'
import sys
layout, rank, base_kb, load_kb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tp = int(layout.split("--tp ")[1].split()[0]) if "--tp" in layout else 1
ep = int(layout.split("--ep ")[1].split()[0])
H, L, E, F, V, NH, KV, D = 2048, 4, 32, 1536, 32768, 16, 4, 128
dense = 2 * V * H // tp + H + L * (2 * H + NH * D * H * 2 // tp + 2 * KV * D * H // (tp if KV % tp == 0 else 1) + 2 * D + E * H)
experts = L * (E // ep) * 3 * H * (F // tp)
share = 4 * (dense + experts)  # float32
expert = 4 * 3 * H * F  # one expert's three matrices, float32
grew = (load_kb - base_kb) * 1024
print(f"| {layout.replace('--', '').replace(' 2 ', ' 2 x ')} | {rank} | {share / 1e6:.0f} | {expert / 1e6:.1f} | "
      f"{load_kb / 1e3:.0f} | {base_kb / 1e3:.0f} | {grew / 1e6:.0f} | {(grew - share) / 1e6:+.1f} | "
      f"{'yes' if grew <= share + expert else 'no'} |")
PY
)")
  done
done
{
  echo "# Peak host memory of each rank loading a Hugging Face folder, 4 CPU ranks"
  echo
  echo "- Command: \`bench/run_hf_load_memory.sh $build $out\`"
  echo "- Machine: $(nproc) CPU cores, $(awk '/MemTotal/ { printf "%.0f GB", $2 / 1e6 }' /proc/meminfo) memory, $(. /etc/os-release; echo "$PRETTY_NAME")"
  echo "- Date: $(date -u +%Y-%m-%d)"
  echo "- Commit: \`${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}\`"
  echo "- Folder: a Qwen3-MoE in save_pretrained's form, $gb GB of bf16 (hidden 2048, 4 layers, 32 experts,"
  echo "  expert hidden 1536, vocabulary 32,768), loaded in float32 (5.6 GB for the whole model) by"
  echo "  \`train_moe --hf-model DIR --tokens FILE --steps 0\`, which then evaluates 4 rows of 16 tokens."
  echo "- Peak: the process's peak resident memory (getrusage). Without the weights: the same run of a tiny"
  echo "  model (hidden 64). Share: the rank's own parameters in float32. Bound: share plus one expert's"
  echo "  three matrices."
  echo
  echo "| layout | rank | share MB | one expert MB | peak MB | peak without the weights MB | grew MB | grew - share MB | within the bound |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  printf '%s\n' "${rows[@]}"
} >"$out"
cat "$out"
echo "wrote $out"
