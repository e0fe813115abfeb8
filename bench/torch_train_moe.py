"""train_moe's model in plain PyTorch, the reference of bench/run_train_bench.sh: on one GPU, or under
torchrun on several with DistributedDataParallel (bucketed all-reduce overlapped with the backward;
--batch sequences per GPU, each rank its own rows).

The same model as examples/train_moe (the same shapes, initial scales and data): a unit-size byte
embedding plus 0.1 x sinusoidal positions; per layer RMSNorm -> q, k, v, out projections with
causal scaled-dot-product attention -> RMSNorm -> MoE (fp32 router, softmax, top-k of the scores plus
Gaussian selection noise of std 0.05, renormalised clean weights,
Switch aux loss and z-loss; SwiGLU experts through torch._grouped_mm, dropless, no host sync); a final
RMSNorm and an output layer that starts at zero; AdamW (fused, weight decay 0.01), gradient clipping at 1.0, the same
warm-up and cosine schedule shape. Prints one line per mode:

    TORCH_TRAIN eager|compiled tokens_per_s=... step_ms=...

    python3 bench/torch_train_moe.py --layers 4 --hidden 1024 --heads 8 --ffn 512 --experts 16 --topk 2 \\
        --seq 1024 --batch 16 [--steps 40] [--modes eager,compiled]
    torchrun --nproc-per-node 4 bench/torch_train_moe.py ...   (tokens_per_s over all GPUs, printed by rank 0)
"""
import argparse
import math
import statistics
import time

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
for name, default in [("layers", 4), ("hidden", 1024), ("heads", 8), ("ffn", 512), ("experts", 16), ("topk", 2),
                      ("seq", 1024), ("batch", 16), ("steps", 40), ("warmup", 20), ("seed", 1)]:
    parser.add_argument(f"--{name}", type=int, default=default)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--aux-coeff", type=float, default=1e-2)
parser.add_argument("--z-coeff", type=float, default=1e-3)
parser.add_argument("--router-noise", type=float, default=0.05)
parser.add_argument("--modes", default="eager,compiled")
args = parser.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
device = torch.device("cuda", torch.cuda.current_device())
dtype = torch.bfloat16
MASK = (1 << 64) - 1


def mix(x):
    """splitmix64, as examples/train_moe/data.cc."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def corpus(seed, size):
    subjects = ["the cat", "a dog", "the old man", "my sister", "the robot", "a bird", "the teacher", "our neighbour"]
    verbs = ["sees", "likes", "follows", "paints", "finds", "carries", "hears", "greets"]
    objects = ["the red ball", "a small house", "the river", "a green apple", "the moon", "an open door",
               "the garden", "a quiet song"]
    endings = [" today.", " every morning.", " again.", "."]
    parts, length, state = [], 0, seed

    def pick(n):
        nonlocal state
        state = mix(state)
        return state % n

    while length < size:
        s = subjects[pick(8)] + " " + verbs[pick(8)] + " " + objects[pick(8)] + endings[pick(4)]
        s += "\n" if pick(5) == 0 else " "
        parts.append(s)
        length += len(s)
    return np.frombuffer("".join(parts)[:size].encode(), dtype=np.uint8)


text = corpus(args.seed, 1 << 20)
span = len(text) - args.seq - 1


def batch(step):
    first = (step * world + rank) * args.batch  # each rank its own rows
    starts = [mix(args.seed ^ mix(first + row)) % span for row in range(args.batch)]
    window = np.stack([text[s:s + args.seq + 1] for s in starts]).astype(np.int64)
    window = torch.from_numpy(window).pin_memory().to(device, non_blocking=True)
    return window[:, :-1], window[:, 1:]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        H, E, Fh, L = args.hidden, args.experts, args.ffn, args.layers
        proj_std = 0.02 / math.sqrt(2.0 * L)
        normal = lambda *shape, std: torch.nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * std)
        ones = lambda: torch.nn.Parameter(torch.ones(H, device=device, dtype=dtype))
        self.embed = normal(256, H, std=1.0)
        self.output = torch.nn.Parameter(torch.zeros(256, H, device=device, dtype=dtype))
        self.attn_norm = torch.nn.ParameterList([ones() for _ in range(L)])
        self.moe_norm = torch.nn.ParameterList([ones() for _ in range(L)])
        self.qkv = torch.nn.ParameterList([normal(3 * H, H, std=0.02) for _ in range(L)])
        self.out = torch.nn.ParameterList([normal(H, H, std=proj_std) for _ in range(L)])
        self.gate = torch.nn.ParameterList([normal(E, H, std=0.02) for _ in range(L)])
        self.w13 = torch.nn.ParameterList([normal(E, 2 * Fh, H, std=0.02) for _ in range(L)])
        self.w2 = torch.nn.ParameterList([normal(E, H, Fh, std=proj_std) for _ in range(L)])
        self.final_norm = ones()
        position = torch.arange(args.seq, dtype=torch.float64).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, H, 2, dtype=torch.float64) * (-math.log(10000.0) / H))
        table = torch.zeros(args.seq, H, dtype=torch.float64)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("positions", table.to(device, dtype))

    @staticmethod
    def norm(weight, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def attention(self, layer, x):
        B, S, H = x.shape
        q, k, v = (x @ self.qkv[layer].t()).view(B, S, 3, args.heads, H // args.heads).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return mixed.transpose(1, 2).reshape(B, S, H) @ self.out[layer].t()

    def moe(self, layer, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], args.experts, args.topk
        logits = x.float() @ self.gate[layer].float().t()
        probs = torch.softmax(logits, -1)
        # Selection noise, as train_moe's router adds in training (there drawn from a hash of each token's
        # place in the run, here from the generator: the same cost, other draws).
        noisy = probs.detach() + args.router_noise * torch.randn_like(probs) if args.router_noise > 0 else probs.detach()
        experts = torch.topk(noisy, k, dim=-1).indices
        weights = probs.gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(experts.view(-1), minlength=E)
        aux = args.aux_coeff * E * ((counts.float() / (T * k)) * probs.mean(0)).sum()
        z = args.z_coeff * torch.logsumexp(logits, -1).pow(2).mean()
        order = torch.argsort(experts.view(-1), stable=True)
        rows = x.index_select(0, order // k)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(rows, self.w13[layer].transpose(-2, -1), offs=offsets)
        g, u = gate_up.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(g) * u, self.w2[layer].transpose(-2, -1), offs=offsets)
        slot_weights = weights.view(-1).index_select(0, order).to(out.dtype)
        y = torch.zeros_like(x).index_add(0, order // k, out * slot_weights.unsqueeze(1))
        return y.view(shape), aux + z

    def forward(self, ids, targets):
        x = F.embedding(ids, self.embed) + 0.1 * self.positions[: ids.shape[1]]
        extra = torch.zeros((), device=device)
        for layer in range(args.layers):
            x = x + self.attention(layer, self.norm(self.attn_norm[layer], x))
            y, losses = self.moe(layer, self.norm(self.moe_norm[layer], x))
            x = x + y
            extra = extra + losses
        logits = self.norm(self.final_norm, x) @ self.output.t()
        loss = F.cross_entropy(logits.view(-1, 256).float(), targets.reshape(-1))
        return loss, extra


def run(mode):
    torch.manual_seed(args.seed)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    lr = lambda step: args.lr * min(1.0, (step + 1) / max(1, args.warmup)) if step < args.warmup else \
        args.lr / 10 + 0.45 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    # Compiled: the model's forward (and with it the backward) as torch.compile
    # makes them; the clip and the fused AdamW step, single multi-tensor kernels
    # already, run outside, so the learning rate changing every step recompiles nothing.
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    forward = torch.compile(wrapped) if mode == "compiled" else wrapped

    def train_step(ids, targets):
        loss, extra = forward(ids, targets)
        (loss + extra).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    forward_backward = train_step
    times, losses = [], []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        ids, targets = batch(step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(forward_backward(ids, targets))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    measured = times[len(times) // 2:]  # the second half: compiled and warm
    step_s = statistics.median(measured)
    tokens = args.batch * args.seq * world
    if rank == 0:
        print(f"TORCH_TRAIN {mode} tokens_per_s={tokens / step_s:.0f} step_ms={step_s * 1e3:.2f} "
              f"first_loss={losses[0].item():.4f} last_loss={losses[-1].item():.4f}", flush=True)


for mode in args.modes.split(","):
    run(mode)
if world > 1:
    dist.destroy_process_group()
