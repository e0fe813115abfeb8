"""PyTorch's all-reduces within a node, the reference for bulkhead-peer-bench:
symmetric-memory one-shot and two-shot sums (torch.ops.symm_mem, without
NVLink multicast) and NCCL through torch.distributed, bf16 from 8 B to
--max-bytes, back-to-back calls on one stream timed with CUDA events (median
of 7 alternating rounds). Every size is checked against the exact sum first.

    torchrun --nproc-per-node N bench/torch_symm_all_reduce.py [--max-bytes 64M] [--out FILE]
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def time_loop(call, iterations):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        call()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1000.0 / iterations


def alternate(calls, iterations):
    for call in calls:
        time_loop(call, max(2, iterations // 10))
    times = [[] for _ in calls]
    for _ in range(7):
        for i, call in enumerate(calls):
            times[i].append(time_loop(call, iterations))
    return [statistics.median(t) for t in times]


def exact_inputs(elements, rank, size, device):
    values = [(torch.arange(elements, device=device) % (7 + r) - 3).to(torch.bfloat16) for r in range(size)]
    return values[rank], torch.stack(values).sum(0, dtype=torch.float32).to(torch.bfloat16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    max_bytes = parse_bytes(args.max_bytes)
    buffer = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buffer, group)
    plain = torch.randn(max_bytes // 2, dtype=torch.bfloat16, device=device)

    rows = []
    nbytes = 8
    while nbytes <= max_bytes:
        elements = nbytes // 2
        view = buffer[:elements]
        mine, want = exact_inputs(elements, rank, size, device)
        view.copy_(mine)
        got_one = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group)
        view.copy_(mine)
        torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group)
        if not (torch.equal(got_one, want) and torch.equal(view, want)):
            raise RuntimeError(f"a symmetric-memory sum of {elements} elements is wrong")
        x = plain[:elements]
        iterations = max(20, min(2000, (4 << 30) // nbytes))
        us = alternate(
            [
                lambda: dist.all_reduce(x),
                lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group),
                lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group),
            ],
            iterations,
        )
        rows.append((nbytes, *us))
        nbytes *= 2

    if rank == 0:
        name = torch.cuda.get_device_name(device)
        factor = 2.0 * (size - 1) / size
        text = (
            f"# PyTorch {torch.__version__} within a node: symmetric memory and NCCL\n\n{size} ranks, one {name} "
            "each, bf16 sums, back-to-back calls on one stream timed with CUDA events (median of 7 alternating "
            "rounds), no NVLink multicast.\n\n"
            "| bytes | torch NCCL us | symm one-shot us | symm two-shot us | best symm / NCCL | NCCL busbw GB/s |\n"
            "|---:|---:|---:|---:|---:|---:|\n"
        )
        for nbytes, nccl, one, two in rows:
            text += (
                f"| {nbytes} | {nccl:.2f} | {one:.2f} | {two:.2f} | {min(one, two) / nccl:.3f} | "
                f"{factor * nbytes / nccl / 1e3:.2f} |\n"
            )
        print(text, end="")
        if args.out:
            with open(args.out, "w") as file:
                file.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
