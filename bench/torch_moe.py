"""The PyTorch reference of the MoE benchmark, written the way common
dispatchers do it: router (softmax, top-k, renormalised weights, Switch aux
loss), permute by expert (argsort), per-expert counts with all_to_all_single,
tokens with the autograd all_to_all_single (one row per selected slot),
order by local expert, grouped matrix products (torch._grouped_mm) for a
SwiGLU MLP (gate and up projections stacked in one weight and one product, as
Megatron's grouped MLP has them), and the mirror image to combine; forward +
backward timed.
Launched under mpirun beside bulkhead-moe-bench (bench/run_moe_bench.sh).

    mpirun -np 2 python3 bench/torch_moe.py --tokens 4096 --hidden 2048 --experts 64 --topk 8 --ffn 768
    mpirun -np 1 python3 bench/torch_moe.py --compile ...   (one GPU, the layer's forward compiled)
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

parser = argparse.ArgumentParser()
for name, default in [("tokens", 4096), ("hidden", 2048), ("experts", 64), ("topk", 8), ("ffn", 768), ("iters", 20)]:
    parser.add_argument(f"--{name}", type=int, default=default)
parser.add_argument("--compile", action="store_true",
                    help="one GPU: the layer's forward (no exchange) under torch.compile, backward through autograd")
args = parser.parse_args()

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
torch.cuda.set_device(local)
device = torch.device("cuda", local)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)

E, k, H, F, T = args.experts, args.topk, args.hidden, args.ffn, args.tokens
local_experts = E // world
bf16 = dict(device=device, dtype=torch.bfloat16)
torch.manual_seed(7)
gate = (torch.randn(E, H, **bf16) * 0.02).requires_grad_()
w13 = (torch.randn(local_experts, 2 * F, H, **bf16) * 0.02).requires_grad_()
w2 = (torch.randn(local_experts, H, F, **bf16) * 0.02).requires_grad_()
torch.manual_seed(1000 + rank)
x = torch.randn(T, H, **bf16).requires_grad_()
grad_out = torch.randn_like(x)


def grouped(rows, weight, counts):
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def step():
    logits = x.float() @ gate.float().t()
    probs = torch.softmax(logits, -1)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    counts = torch.bincount(experts.view(-1), minlength=E)
    aux = 0.01 * E * ((counts.float() / (T * k)) * probs.mean(0)).sum()

    order = torch.argsort(experts.view(-1), stable=True)
    permuted = x.index_select(0, order // k)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_splits = counts.view(world, local_experts).sum(1).tolist()
    recv_matrix = recv_counts.view(world, local_experts)
    recv_splits = recv_matrix.sum(1).tolist()
    received = dist_fn.all_to_all_single(
        torch.empty(sum(recv_splits), H, **bf16), permuted, recv_splits, send_splits)
    # (source, expert) chunks -> expert-major order.
    chunk_expert = torch.arange(local_experts, device=device).repeat(world)
    by_expert = torch.argsort(torch.repeat_interleave(chunk_expert, recv_matrix.view(-1)), stable=True)
    expert_in = received.index_select(0, by_expert)
    per_expert = recv_matrix.sum(0)
    gate_proj, up_proj = grouped(expert_in, w13, per_expert).chunk(2, dim=-1)
    hidden = torch.nn.functional.silu(gate_proj) * up_proj
    expert_out = grouped(hidden, w2, per_expert)
    back = torch.empty_like(expert_out).index_copy(0, by_expert, expert_out)
    returned = dist_fn.all_to_all_single(torch.empty(sum(send_splits), H, **bf16), back, send_splits, recv_splits)
    slot_weights = weights.view(-1).index_select(0, order).to(returned.dtype)
    out = torch.zeros_like(x).index_add(0, order // k, returned * slot_weights.unsqueeze(1))
    torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])


def local_layer(tokens):
    """The same layer on one GPU, where both exchanges are the identity: static shapes for torch.compile."""
    logits = tokens.float() @ gate.float().t()
    probs = torch.softmax(logits, -1)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    slots = experts.reshape(-1)
    counts = torch.zeros(E, dtype=torch.long, device=device).scatter_add_(0, slots, torch.ones_like(slots))
    aux = 0.01 * E * ((counts.float() / (T * k)) * probs.mean(0)).sum()
    order = torch.argsort(slots, stable=True)
    expert_in = tokens.index_select(0, order // k)
    gate_proj, up_proj = grouped(expert_in, w13, counts).chunk(2, dim=-1)
    expert_out = grouped(torch.nn.functional.silu(gate_proj) * up_proj, w2, counts)
    slot_weights = weights.reshape(-1).index_select(0, order).to(expert_out.dtype)
    return torch.zeros_like(tokens).index_add(0, order // k, expert_out * slot_weights.unsqueeze(1)), aux


if args.compile:
    if world != 1:
        raise SystemExit("torch_moe.py --compile runs on one GPU (the layer without its exchanges)")
    compiled_layer = torch.compile(local_layer)

    def step():
        out, aux = compiled_layer(x)
        torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])

for _ in range(3):
    step()
times = []
for _ in range(args.iters):
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - start) * 1000)
if rank == 0:
    print(f"TORCH_STEP_MS {statistics.median(times):.3f}")
dist.destroy_process_group()
