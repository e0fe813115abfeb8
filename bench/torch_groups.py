"""PyTorch building the same groups eagerly: init_process_group(device_id=...),
new_group for every group in the file, one warm-up collective (1 MiB) on each
group of this rank (all-to-all on ep, all-reduce elsewhere), then a sync.
Launched under mpirun beside bulkhead-groups-bench (bench/run_groups_bench.sh)."""
import json
import os
import sys
import time

start = time.perf_counter()
import torch  # noqa: E402  (import time is not counted: start is reset below)
import torch.distributed as dist  # noqa: E402

start = time.perf_counter()
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
torch.cuda.set_device(local)
device = torch.device("cuda", local)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
with open(sys.argv[1]) as f:
    groups = json.load(f)
mine = []
for group in groups:  # every rank creates every group, in one order
    handle = dist.new_group(group["ranks"])
    if rank in group["ranks"] and len(group["ranks"]) > 1:
        mine.append((group["kind"], group["ranks"], handle))
for kind, ranks, handle in mine:
    x = torch.randn((1 << 20) // 4, device=device)
    if kind == "ep":
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=handle)
    else:
        dist.all_reduce(x, group=handle)
torch.cuda.synchronize()
total = (time.perf_counter() - start) * 1000
if rank == 0:
    print(f"pytorch: {len(groups)} groups built, {len(mine)} warmed on rank 0, {total:.1f} ms after start")
    print(f"TORCH_TOTAL_MS {total:.1f}")
dist.destroy_process_group()
