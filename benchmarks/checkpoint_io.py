"""What a full checkpoint costs: wall time of saving and loading the model and the optimizer, the
collectives a save issues, and how much host memory each rank gains while saving.

GPT-2 (6 layers, width 512 by default) is boosted with AdamW, trained one step, then saved and
loaded with the booster. Ranks run as local gloo processes (``--world-size 2``). Saves gather to rank
0 chunk by chunk, so rank 1's memory should not grow by the size of the model.

    python benchmarks/checkpoint_io.py [--world-size 2] [--layers 6] [--width 512]

Only the booster's public API is used, so the script also measures older versions of chunkmem.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt_bytes, gpt2_model, print_table, token_batches


class _PeakRss:
    """Highest resident set size of this process while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.start = self.peak = 0
        self._running = False

    def __enter__(self) -> _PeakRss:
        # Give freed heap back to the OS first, so that reused pages do not hide new allocations.
        gc.collect()
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start = self.peak = self._process.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _run(rank: int, world_size: int, port: int, args: argparse.Namespace, directory: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world_size > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(minutes=10),
        )  # fmt: skip
    from chunkmem import Booster, ChunkPlugin

    model = gpt2_model(args.layers, args.width, args.vocab, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    booster = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=args.chunk_size))
    chunked, optimizer, *_ = booster.boost(model, optimizer)
    ids = token_batches(1, args.batch * world_size, args.seq, args.vocab)[0].chunk(world_size)[rank]
    booster.backward(chunked(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()

    comm = chunked.manager.comm
    calls: Counter[str] = Counter()
    for name in ("all_gather", "all_reduce", "reduce_to_first", "all_gather_object", "barrier"):
        original = getattr(comm, name)

        def counting(*a: Any, _name: str = name, _original: Any = original, **k: Any) -> Any:
            calls[_name] += 1
            return _original(*a, **k)

        setattr(comm, name, counting)
    root = Path(directory)
    rows: dict[str, Any] = {}
    for what, action in (
        ("save_model", lambda: booster.save_model(chunked, root / "model.pt")),
        ("save_optimizer", lambda: booster.save_optimizer(optimizer, root / "optim.pt")),
        ("load_model", lambda: booster.load_model(chunked, root / "model.pt")),
        ("load_optimizer", lambda: booster.load_optimizer(optimizer, root / "optim.pt")),
    ):
        calls.clear()
        with _PeakRss() as rss:
            start = time.perf_counter()
            action()
            seconds = time.perf_counter() - start
        rows[what] = {"seconds": seconds, "rss_gain": rss.peak - rss.start, "collectives": dict(calls)}
    out.put((rank, rows, len(chunked.manager.chunks), sum(p.numel() for p in model.parameters())))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=2_000_000)
    args = parser.parse_args()
    # Large allocations straight from mmap, returned on free: peak RSS then follows live memory
    # instead of what glibc keeps cached in its heap (set before the rank processes start).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        port = 29500 + os.getpid() % 1000
        procs = [
            ctx.Process(target=_run, args=(rank, args.world_size, port, args, directory, queue))
            for rank in range(args.world_size)
        ]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=1200) for _ in procs)
        for p in procs:
            p.join()
        sizes = {name: (Path(directory) / name).stat().st_size for name in ("model.pt", "optim.pt")}
    _, _, chunks, numel = results[0]
    print(
        f"GPT-2 {args.layers}x{args.width}: {numel / 1e6:.1f}M parameters in {chunks} chunks, world size "
        f"{args.world_size}; model.pt {fmt_bytes(sizes['model.pt'])}, optim.pt {fmt_bytes(sizes['optim.pt'])}"
    )
    table = []
    for rank, rows, _, _ in results:
        for what, row in rows.items():
            collectives = ", ".join(f"{k} {v}" for k, v in sorted(row["collectives"].items())) or "-"
            table.append([str(rank), what, f"{row['seconds']:.2f}", fmt_bytes(row["rss_gain"]), collectives])
    print_table(["rank", "operation", "seconds", "peak RSS gain", "collectives"], table)


if __name__ == "__main__":
    main()
