"""The collectives a chunk costs, alone: all-gather, reduce-scatter and all-reduce at several chunk
sizes, on the backend chunkmem would use (gloo on the CPU, NCCL on GPUs). The figures behind the
chunk-size search's floor (``chunkmem.chunks.search.MIN_EFFICIENT_CHUNK_BYTES``) and behind reducing
gradients by all-reduce on gloo (``Communicator.reduce_scatter_sum``).

    python benchmarks/collectives.py                   # W=2
    python benchmarks/collectives.py --world-size 4 --sizes 0.8,3.2,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, print_table, write_json
from benchmarks.workers import free_port


def _timed(fn: Any, calls: int, device: torch.device) -> float:
    """Median seconds of one call over ``calls`` calls, after a barrier (so ranks start together)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(numel: int, world: int, calls: int, device: torch.device) -> dict[str, float]:
    full = torch.randn(numel, device=device)
    shard = torch.empty(numel // world, device=device)
    return {
        "gathered_mb": numel * 4 / 1e6,
        "all_gather_s": _timed(lambda: dist.all_gather_into_tensor(full, shard), calls, device),
        "reduce_scatter_s": _timed(lambda: dist.reduce_scatter_tensor(shard, full), calls, device),
        "all_reduce_s": _timed(lambda: dist.all_reduce(full), calls, device),
    }


def _rank(rank: int, world: int, port: int, sizes_mb: list[float], calls: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    rows = [_measure(int(mb * 1e6 / 4) // world * world, world, calls, device) for mb in sizes_mb]
    if rank == 0:
        queue.put({"backend": dist.get_backend(), "rows": rows})
    dist.destroy_process_group()


def main() -> None:
    begin_run(__file__)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="0.4,0.8,1.6,3.2,8,32", help="gathered chunk sizes in MB (fp32)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per collective and size")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world_size, port, sizes, args.calls, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    rows = [
        [
            f"{r['gathered_mb']:.1f}",
            f"{r['all_gather_s'] * 1e3:.2f}",
            f"{r['gathered_mb'] / 1e3 / r['all_gather_s']:.2f}",
            f"{r['reduce_scatter_s'] * 1e3:.2f}",
            f"{r['all_reduce_s'] * 1e3:.2f}",
        ]
        for r in result["rows"]
    ]
    print(f"{result['backend']}, W={args.world_size}, median of {args.calls} calls each")
    print_table(["chunk MB", "all-gather ms", "all-gather GB/s", "reduce-scatter ms", "all-reduce ms"], rows)
    path = write_json(f"collectives_w{args.world_size}", {"world_size": args.world_size, **result}, args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
