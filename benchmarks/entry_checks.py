"""What the rank-agreement checks at each forward, backward and optimizer step cost.

W ranks (gloo on the CPU) train GPT-2 (4x256, vocab 2048, batch 4x128 per rank) with the default
placement. Steps alternate between the checks on and off (the same schedule on every rank, so no
rank departs from another), and the medians of the two are compared; the wall time spent inside
the checks is reported too. Most of that is waiting for the slowest rank, which without the check
the step's first collective would wait for instead, so the medians are the cost.

    python benchmarks/entry_checks.py [--world-size 2] [--steps 40]

Measurement only: it switches the checks off by replacing ``RankChecks.entry`` in its own
processes; chunkmem has no switch for them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import gpt2_model, median, token_batches

WARMUP = 4


def _rank(rank: int, world_size: int, steps: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import chunkmem.ranks.rank_checks as rank_checks
    from chunkmem import Booster, ChunkPlugin

    original = rank_checks.RankChecks.entry
    enabled = [True]
    inside = [0.0, 0]

    def entry(self: rank_checks.RankChecks, *args: object, **kwargs: object) -> None:
        if not enabled[0]:
            return
        start = time.perf_counter()
        try:
            original(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start
            inside[1] += 1

    rank_checks.RankChecks.entry = entry  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = gpt2_model(4, 256, 2048, 128)
    booster = Booster(ChunkPlugin(precision="fp32"))
    chunked, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    on: list[float] = []
    off: list[float] = []
    for index, ids in enumerate(token_batches(WARMUP + steps, 4, 128, 2048)):
        enabled[0] = index < WARMUP or index % 2 == 0
        if index == WARMUP:
            inside[:] = [0.0, 0]
        start = time.perf_counter()
        loss = chunked(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if index >= WARMUP:
            (on if enabled[0] else off).append(time.perf_counter() - start)
    with_checks, without = median(on), median(off)
    print(
        f"rank {rank}: median step {with_checks * 1e3:.1f} ms with the checks, {without * 1e3:.1f} ms without "
        f"({with_checks / without:.3f}x); {inside[1] / len(on):.0f} checks per step, "
        f"{inside[0] / len(on) * 1e3:.2f} ms per step inside them ({inside[0] / sum(on) * 100:.1f}% of the step)"
    )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="measured steps, half with the checks")
    parser.add_argument("--port", type=int, default=29541)
    args = parser.parse_args(argv)
    mp.spawn(_rank, args=(args.world_size, args.steps, args.port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
