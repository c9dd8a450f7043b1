"""A process that boosts model after model keeps none of the cross-rank checks' gloo groups.

At world size > 1 each boosted model's communicator makes two small gloo groups for its checks
(``chunkmem.ranks.rank_checks``) and a listener thread for alarms; each group is a few native
threads and sockets. Once the model and its optimizer are collected, they all go (the listener
stops after a closing handshake, then the groups are destroyed). Before, each boost left 7 threads
and 10 file descriptors behind at two ranks, until a sweep or a long test session ran out of them.
Counted by the operating system (``/proc/self``), not by chunkmem, in fresh rank processes: a pooled
one may still hold an earlier test's model (its listener ends once every rank has let go of it).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch
from support.distributed import run_ranks
from support.models import boost

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads and descriptors in /proc"),
]

_BOOSTS = 3
_SETTLE = 10.0  # seconds the ends of the last model's groups may take (a handshake, on other threads)


def _counts() -> tuple[int, int, int]:
    """This process's native threads, open file descriptors, and chunkmem listener threads."""
    listeners = sum(thread.name == "chunkmem-alarms" for thread in threading.enumerate())
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), listeners


def _train_once(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    chunked, optimizer, booster = boost(
        model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), precision="fp32", chunk_size=200
    )
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        booster.backward(chunked(x).pow(2).mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()


def _settled(at_most: tuple[int, int, int]) -> tuple[int, int, int]:
    """The counts once they are at most ``at_most`` (or after ``_SETTLE`` seconds, whatever they are)."""
    deadline = time.monotonic() + _SETTLE
    while True:
        gc.collect()
        counts = _counts()
        if all(now <= limit for now, limit in zip(counts, at_most, strict=True)) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _boost_again_and_again(rank: int, world_size: int) -> dict[str, list[tuple[int, int, int]]]:
    before = _settled(_counts())
    _train_once(rank, world_size)
    first = _settled(before)  # what the first boost made for good (torch's own pools), if anything
    after = []
    for _ in range(_BOOSTS):
        _train_once(rank, world_size)
        after.append(_settled(first))
    return {"before": [before], "first": [first], "after": after}


@pytest.mark.parametrize("world_size", [2, 3])
def test_boosting_again_and_again_leaves_no_threads_descriptors_or_listeners(world_size: int) -> None:
    for rank, counts in enumerate(run_ranks(_boost_again_and_again, world_size=world_size, fresh=True)):
        first = counts["first"][0]
        assert first[2] == 0, f"rank {rank}: the first model's listener still runs after it was collected: {counts}"
        for threads, fds, listeners in counts["after"]:
            assert threads <= first[0], f"rank {rank}: threads grew with each boost (threads, fds, listeners): {counts}"
            assert fds <= first[1], f"rank {rank}: file descriptors grew with each boost: {counts}"
            assert listeners == 0, f"rank {rank}: a collected model's listener still runs: {counts}"
