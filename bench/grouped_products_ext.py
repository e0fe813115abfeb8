"""The Hopper grouped-product kernels alone, built as a PyTorch extension in
about 30 s (no build of the tree): each product checked against float32 math on
ragged groups (an empty group, rows past the last end, widths that are not whole
tiles), then timed beside torch._grouped_mm and a dense matmul of the same FLOPs
at the MoE layer's shapes (hidden 2048, expert hidden 768, top-8, E = 64 and 128,
T = 4,096 and 16,384 tokens; uniformly drawn routing). For iterating on
moe/cuda/grouped_gemm_kernels.cu; bench/run_products_bench.sh measures the
library's path and the whole layer.

    python3 bench/grouped_products_ext.py [--no-bench]     (from the repository's root, one Hopper GPU)
"""
import argparse
import os
import time

import torch
from torch.utils.cpp_extension import load

parser = argparse.ArgumentParser()
parser.add_argument("--no-bench", action="store_true", help="check the products, time nothing")
args = parser.parse_args()

start = time.time()
root = os.getcwd()
ext = load(name="bulkhead_grouped_products",
           sources=[f"{root}/bench/grouped_products_ext.cpp", f"{root}/moe/cuda/grouped_gemm_kernels.cu",
                    f"{root}/runtime/errors.cc"],
           extra_include_paths=[root], extra_cflags=["-O2", "-std=c++20", "-DFMT_HEADER_ONLY"],
           extra_cuda_cflags=["-O3", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a"])
print(f"built in {time.time() - start:.0f} s", flush=True)
device = "cuda"
torch.manual_seed(1)


def groups_of(ends):
    start = 0
    for g, end in enumerate(ends.tolist()):
        yield g, start, max(start, end)
        start = max(start, end)


def exact(kind, a, b, ends, rows):
    """Each product in float32, group by group."""
    if kind == "wgrad":
        out = torch.zeros(ends.numel(), a.shape[1], b.shape[1], device=device)
        for g, s, e in groups_of(ends):
            out[g] = a[s:e].float().t() @ b[s:e].float()
        return out
    columns = b.shape[1] if kind == "forward" else b.shape[2]
    out = torch.zeros(rows, columns, device=device)
    for g, s, e in groups_of(ends):
        out[s:e] = a[s:e].float() @ (b[g].float().t() if kind == "forward" else b[g].float())
    return out


def check():
    ok = True
    # groups, rows, K, N, rows past the last end
    # and one set of sizes ending in each 16-row part of a 64-deep step and each half of a 128-row tile
    edges = torch.tensor([16, 0, 17, 33, 48, 49, 63, 64, 65, 127, 128, 129, 200, 1, 31, 96])
    for groups, rows, k, n, tail in ((5, 1000, 192, 320, 0), (8, 3001, 256, 512, 77), (3, 700, 2048, 1536, 0),
                                     (16, 4096, 768, 2048, 0), (-len(edges), int(edges.sum()) + 3, 256, 320, 3)):
        if groups < 0:  # the edge sizes
            groups = len(edges)
            sizes = edges.clone()
        else:
            sizes = torch.randint(0, 2 * rows // groups, (groups,))
            sizes[1] = 0
            sizes = (sizes.float() * (rows - tail) / sizes.sum()).long()
            sizes[-1] += rows - tail - sizes.sum()
        ends = torch.cumsum(sizes, 0).to(torch.int32).to(device)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16) * 0.05
        dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
        print(f"{groups} groups, {rows} rows, K {k}, N {n}, {tail} past the last end", flush=True)
        for kind, a, b in (("forward", x, w), ("dgrad", dy, w), ("wgrad", dy, x)):
            got = getattr(ext, kind)(a, b, ends).float()
            want = exact(kind, a, b, ends, rows)
            scale = want.abs().max().item()
            error = (got - want).abs().max().item()
            good = error <= scale / 128 and bool(torch.isfinite(got).all())
            ok &= good
            print(f"  {kind}: largest error {error:.3e} of {scale:.2e} {'ok' if good else 'WRONG'}", flush=True)
    print("every product within a bf16 rounding" if ok else "SOME PRODUCTS WRONG", flush=True)
    return ok


def time_ms(call, iterations=20):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iterations):
        call()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iterations


def bench():
    print("\n| E | T | product | dense mm | _grouped_mm | Bulkhead | (TFLOP/s)\n|---:|---:|---|---:|---:|---:|")
    for experts in (64, 128):
        for tokens in (4096, 16384):
            rows = tokens * 8
            ids = torch.randint(0, experts, (rows,), device=device)
            ends = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
            total = {"aten": 0.0, "ours": 0.0}
            flop_all = 0.0
            for name, k, n in (("gate+up", 2048, 1536), ("down", 768, 2048)):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                w = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) * 0.02
                dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
                a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
                tflop = 2.0 * rows * k * n / 1e12
                dense = time_ms(lambda: a @ b)
                for kind, aten, ours in (
                        ("forward", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends),
                         lambda: ext.forward(x, w, ends)),
                        ("dgrad", lambda: torch._grouped_mm(dy, w, offs=ends), lambda: ext.dgrad(dy, w, ends)),
                        ("wgrad", lambda: torch._grouped_mm(dy.t(), x, offs=ends), lambda: ext.wgrad(dy, x, ends))):
                    theirs, mine = time_ms(aten), time_ms(ours)
                    total["aten"] += theirs
                    total["ours"] += mine
                    flop_all += tflop
                    print(f"| {experts} | {tokens} | {name} {kind} | {tflop / dense * 1e3:.0f} | "
                          f"{tflop / theirs * 1e3:.0f} | {tflop / mine * 1e3:.0f} |", flush=True)
            print(f"| {experts} | {tokens} | all six | | {flop_all / total['aten'] * 1e3:.0f} "
                  f"({total['aten']:.3f} ms) | {flop_all / total['ours'] * 1e3:.0f} ({total['ours']:.3f} ms) |",
                  flush=True)


if not check():
    raise SystemExit(1)
if not args.no_bench:
    bench()
