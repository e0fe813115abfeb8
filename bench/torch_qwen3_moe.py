"""The references of bench/run_hf_train_bench.sh: one training step of a Qwen3-MoE model from a Hugging Face
config.json on one GPU, in bf16, on uniformly random token ids, in four ways:

  torch-eager, torch-compiled  the architecture in plain PyTorch (below), eager and under torch.compile:
                               fp32 RMSNorm (also of q and k over head_dim), rotate-half RoPE, grouped-query
                               scaled-dot-product attention, the router's fp32 softmax, top-k and renormalised
                               weights, the Switch aux loss with router_aux_loss_coef, SwiGLU experts through
                               torch._grouped_mm (dropless, no host sync), cross-entropy in fp32
  hf-eager, hf-compiled        transformers' own Qwen3MoeForCausalLM (SDPA, its default experts kernel,
                               output_router_logits so that its aux loss is in the loss), eager and compiled

Every mode: bf16 weights, fused AdamW (weight decay 0.01), gradient clipping at 1.0. Prints a line a mode:

    QWEN3_TRAIN <mode> tokens_per_s=... step_ms=... peak_gib=... first_loss=... last_loss=...

    python3 bench/torch_qwen3_moe.py CONFIG.json --seq 4096 --batch 2 [--steps 40] [--modes torch-eager,...]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("config")
for name, default in [("seq", 4096), ("batch", 2), ("steps", 40), ("seed", 1)]:
    parser.add_argument(f"--{name}", type=int, default=default)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--modes", default="torch-eager,torch-compiled,hf-eager,hf-compiled")
args = parser.parse_args()
c = json.load(open(args.config))
device = torch.device("cuda", torch.cuda.current_device())
dtype = torch.bfloat16
H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
NH, KV, D = c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
E, K, Fh = c["num_experts"] if "num_experts" in c else c["num_local_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
EPS, STD, AUX = c["rms_norm_eps"], c.get("initializer_range", 0.02), c.get("router_aux_loss_coef", 0.001)
THETA = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))


def rms_norm(x, weight):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        normal = lambda *shape: torch.nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * STD)
        ones = lambda n: torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype))
        self.embed, self.lm_head, self.final_norm = normal(V, H), normal(V, H), ones(H)
        lists = lambda make: torch.nn.ParameterList([make() for _ in range(L)])
        self.input_norm, self.post_norm = lists(lambda: ones(H)), lists(lambda: ones(H))
        self.q, self.k, self.v = lists(lambda: normal(NH * D, H)), lists(lambda: normal(KV * D, H)), lists(lambda: normal(KV * D, H))
        self.o = lists(lambda: normal(H, NH * D))
        self.q_norm, self.k_norm = lists(lambda: ones(D)), lists(lambda: ones(D))
        self.gate = lists(lambda: normal(E, H))
        self.w13, self.w2 = lists(lambda: normal(E, 2 * Fh, H)), lists(lambda: normal(E, H, Fh))
        inverse = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        angles = torch.outer(torch.arange(args.seq, dtype=torch.float32), inverse)
        both = torch.cat([angles, angles], -1)
        self.register_buffer("cos", both.cos().to(device, dtype))
        self.register_buffer("sin", both.sin().to(device, dtype))

    def rope(self, x):
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], -1) * self.sin

    def attention(self, i, x):
        B, S, _ = x.shape
        q = rms_norm((x @ self.q[i].t()).view(B, S, NH, D), self.q_norm[i]).transpose(1, 2)
        k = rms_norm((x @ self.k[i].t()).view(B, S, KV, D), self.k_norm[i]).transpose(1, 2)
        v = (x @ self.v[i].t()).view(B, S, KV, D).transpose(1, 2)
        mixed = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=True)
        return mixed.transpose(1, 2).reshape(B, S, NH * D) @ self.o[i].t()

    def moe(self, i, x):
        shape = x.shape
        x = x.reshape(-1, H)
        T = x.shape[0]
        probs = torch.softmax((x @ self.gate[i].t()).float(), -1)
        weights, experts = torch.topk(probs, K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(experts.view(-1), minlength=E)
        aux = AUX * E * ((counts.float() / (T * K)) * probs.mean(0)).sum()
        order = torch.argsort(experts.view(-1), stable=True)
        rows = x.index_select(0, order // K)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        g, u = torch._grouped_mm(rows, self.w13[i].transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(g) * u, self.w2[i].transpose(-2, -1), offs=offsets)
        slot_weights = weights.view(-1).index_select(0, order).to(out.dtype)
        y = torch.zeros_like(x).index_add(0, order // K, out * slot_weights.unsqueeze(1))
        return y.view(shape), aux

    def forward(self, ids, targets):
        x = F.embedding(ids, self.embed)
        aux = torch.zeros((), device=device)
        for i in range(L):
            x = x + self.attention(i, rms_norm(x, self.input_norm[i]))
            y, a = self.moe(i, rms_norm(x, self.post_norm[i]))
            x, aux = x + y, aux + a
        logits = rms_norm(x, self.final_norm) @ self.lm_head.t()
        return F.cross_entropy(logits.view(-1, V).float(), targets.reshape(-1)) + aux


def hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.config)
    config.output_router_logits = True  # its aux loss in the loss, as the other modes
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    model.train()

    def forward(ids, targets):
        # transformers shifts the labels inside its loss: give it the window without the last target.
        return model(input_ids=ids, labels=ids).loss

    return model, forward


def run(mode):
    torch.manual_seed(args.seed)
    torch.cuda.reset_peak_memory_stats()
    if mode.startswith("torch"):
        model = Model()
        forward = model
    else:
        model, forward = hf_model()
    if mode.endswith("compiled"):
        forward = torch.compile(forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    times, losses = [], []
    for step in range(args.steps):
        window = torch.randint(0, V, (args.batch, args.seq + 1), device=device, generator=generator)
        ids, targets = (window[:, :-1], window[:, 1:]) if mode.startswith("torch") else (window[:, :-1], None)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = forward(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    step_s = statistics.median(times[len(times) // 2:])  # the second half: compiled and warm
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"QWEN3_TRAIN {mode} tokens_per_s={args.batch * args.seq / step_s:.0f} step_ms={step_s * 1e3:.2f} "
          f"peak_gib={peak:.2f} first_loss={losses[0].item():.4f} last_loss={losses[-1].item():.4f}", flush=True)
    del model, forward, optimizer
    torch.cuda.empty_cache()


for mode in args.modes.split(","):
    run(mode)
