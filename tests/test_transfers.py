"""Host-device copies: timed where they are counted, so achieved bandwidth can be read; on CUDA a
pinned host buffer is not rewritten while an asynchronous copy still reads it."""

from __future__ import annotations

import pytest
import torch
from models import adamw_two_groups, batches, boost, gpt2, train_chunked

from chunkmem import Stats
from chunkmem.transfers import Direction, HostTransfers
from placement import StaticPlacementConfig

OFFLOAD = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0)


def _stats(placement: StaticPlacementConfig) -> Stats:
    model = gpt2()
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="fp32", chunk_size=6_000, placement=placement
    )
    train_chunked(chunked, optimizer, booster, batches(2))
    return chunked.stats()


def test_offloaded_copies_are_timed_and_resident_chunks_move_nothing() -> None:
    offloaded = _stats(OFFLOAD)
    assert offloaded.h2d_bytes > 0 and offloaded.d2h_bytes > 0
    assert offloaded.h2d_seconds > 0 and offloaded.d2h_seconds > 0
    resident = _stats(StaticPlacementConfig())
    assert (resident.h2d_bytes, resident.d2h_bytes, resident.h2d_seconds, resident.d2h_seconds) == (0, 0, 0.0, 0.0)


def test_timings_are_named_apart_from_the_counts() -> None:
    # Counts must be equal on every rank; timings never are. The tests comparing ranks rely on this.
    assert {f.name for f in Stats.__dataclass_fields__.values() if f.type in ("float", float)} == Stats.TIMINGS


def test_a_copy_counts_its_bytes_in_its_direction() -> None:
    stats = Stats()
    transfers = HostTransfers(stats, torch.device("cpu"))
    target = torch.empty(1000)
    transfers.copy(target, torch.ones(1000), Direction.TO_DEVICE)
    transfers.copy(target, torch.ones(250, dtype=torch.bfloat16).float().repeat(4), Direction.TO_HOST)
    assert (stats.h2d_bytes, stats.d2h_bytes) == (4000, 4000)
    assert torch.equal(target, torch.ones(1000))


@pytest.mark.cuda
def test_a_pinned_buffer_is_not_rewritten_while_a_copy_reads_it() -> None:
    stats = Stats()
    transfers = HostTransfers(stats, torch.device("cuda"))
    host = torch.full((64 * 2**20,), 1.0, pin_memory=True)  # 256 MiB: the copy takes milliseconds
    device = torch.empty_like(host, device="cuda")
    torch.cuda._sleep(50_000_000)  # the stream is busy, so the copy has not started yet
    transfers.copy(device, host, Direction.TO_DEVICE)
    transfers.before_host_write(host)
    host.fill_(2.0)
    torch.cuda.synchronize()
    assert bool((device == 1.0).all()), "the device received values written after the copy was queued"
    transfers.settle()
    assert stats.h2d_bytes == host.numel() * 4 and stats.h2d_seconds > 0
