"""torch.distributed.checkpoint on the same MoE-like state as bulkhead-ckpt-bench (bench/ckpt_bench.cc):
per rank, 12 layers x (64/world experts of bf16 [1536 x 1024] and [1024 x 768]) + a bf16 [3072 x 1024]
dense matrix per layer, each a DTensor sharded on dim 0 over all ranks (so every rank writes its own
part, as with Bulkhead). Launched by bench/run_ckpt_bench.sh:

  python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/dcp_bench.py --dir DIR --phase save
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/dcp_bench.py --dir DIR --phase load

save: `dcp.save` (blocking) and `dcp.async_save` with its default stager, --iters times each (and, when this
PyTorch has StagingOptions, async_save with pinned, asynchronous staging). For async_save, "blocking" is the
time until the state dict may change again: the call, plus waiting for staging_completion when the call
returns an AsyncSaveResponse. load: `dcp.load` of the last blocking save into fresh DTensors, checked equal.
Rank 0 prints "DCP_RESULT ..." lines with the slowest rank's times.
"""
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:  # PyTorch >= 2.5
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # older
    from torch.distributed._tensor import DTensor, Shard
from torch.distributed.device_mesh import init_device_mesh


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    return parser.parse_args()


def build(args, rank, world, device, mesh, values):
    torch.manual_seed(1234 + rank)
    local = args.experts // world
    state = {}

    def make(*shape):
        return (torch.randn(*shape, dtype=torch.bfloat16, device=device) if values
                else torch.zeros(*shape, dtype=torch.bfloat16, device=device))

    for layer in range(args.layers):
        prefix = f"layers.{layer}."
        for name, shape in (("experts.w1", (local, 1536, 1024)), ("experts.w2", (local, 1024, 768)),
                            ("dense", (3072, 1024))):
            state[prefix + name] = DTensor.from_local(make(*shape), mesh, [Shard(0)], run_check=False)
    return state


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def settle():
    torch.cuda.synchronize()
    dist.barrier()


def fresh(path, rank):
    if rank == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()


def pinned_stager():
    """async_save's stager with pinned memory and asynchronous staging, when this PyTorch has one."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=True))
    except Exception:
        return None


def timed_async_save(state, path, stager):
    """(blocking seconds, total seconds) of one async_save."""
    started = time.perf_counter()
    if stager is None:
        response = dcp.async_save(state, checkpoint_id=path)
    else:
        response = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
    if hasattr(response, "staging_completion"):
        response.staging_completion.result()
        blocking = time.perf_counter() - started
        response.upload_completion.result()
    else:
        blocking = time.perf_counter() - started
        response.result()
    return blocking, time.perf_counter() - started


def main():
    args = parse()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # async_save needs a CPU backend for its coordination.
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    mesh = init_device_mesh("cuda", (world,))
    state = build(args, rank, world, device, mesh, args.phase == "save")
    nbytes = sum(t.to_local().numel() * t.to_local().element_size() for t in state.values()) * world
    last = os.path.join(args.dir, "dcp_sync")

    if args.phase == "save":
        for i in range(args.iters):
            fresh(last, rank)
            settle()
            started = time.perf_counter()
            dcp.save(state, checkpoint_id=last)
            seconds = slowest(time.perf_counter() - started)
            if rank == 0:
                print(f"DCP_RESULT phase=save kind=sync iter={i} blocking={seconds:.4f} total={seconds:.4f} bytes={nbytes}",
                      flush=True)
        variants = [("async", None)]
        stager = pinned_stager()
        if stager is not None:
            variants.append(("async_pinned", stager))
        for kind, stager in variants:
            path = os.path.join(args.dir, f"dcp_{kind}")
            for i in range(args.iters):
                fresh(path, rank)
                settle()
                blocking, total = timed_async_save(state, path, stager)
                blocking, total = slowest(blocking), slowest(total)
                if rank == 0:
                    print(f"DCP_RESULT phase=save kind={kind} iter={i} blocking={blocking:.4f} total={total:.4f} "
                          f"bytes={nbytes}", flush=True)
            fresh(path, rank)
            if stager is not None and hasattr(stager, "close"):
                stager.close()
    else:
        settle()
        started = time.perf_counter()
        dcp.load(state, checkpoint_id=last)
        settle()
        seconds = slowest(time.perf_counter() - started)
        expected = build(args, rank, world, device, mesh, True)
        equal = all(torch.equal(state[k].to_local(), expected[k].to_local()) for k in state)
        ok = torch.tensor([1 if equal else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"DCP_RESULT phase=load seconds={seconds:.4f} bytes={nbytes} equal={ok.item()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
