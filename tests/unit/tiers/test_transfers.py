"""Host-device copies: timed where they are counted, so achieved bandwidth can be read; on CUDA a
pinned host buffer is not rewritten while an asynchronous copy still reads it."""

from __future__ import annotations

import pytest
import torch
from support.models import adamw_two_groups, batches, boost, gpt2, train_chunked

from chunkmem import Stats
from chunkmem.placement import StaticPlacementConfig
from chunkmem.tiers.transfers import Direction, HostTransfers

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
    # And the counts of what was still running when looked at are named, so a comparison can leave them out.
    assert Stats.RANK_LOCAL == {"prefetch_waits", "early_steps_in_backward"} <= set(Stats.__dataclass_fields__)


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


def test_no_copy_is_pageable_on_the_cpu_where_nothing_is_pinned() -> None:
    assert _stats(OFFLOAD).pageable_copies == 0


@pytest.mark.cuda
def test_a_gradient_copy_waits_for_the_compute_before_it_and_its_source_is_not_reused_early() -> None:
    """Device to host runs on the copy stream: it must see what the compute stream wrote before
    it was queued, and the allocator must not hand its source to later compute before it has read
    it; the CPU waits only when it reads the target."""
    stats = Stats()
    transfers = HostTransfers(stats, torch.device("cuda"))
    n = 16 * 2**20
    source = torch.full((n,), 1.0, device="cuda")
    torch.cuda._sleep(50_000_000)  # the compute stream is busy: the copy stream must wait for it
    source.fill_(2.0)
    host = torch.empty(n, pin_memory=True)
    transfers.copy(host, source, Direction.TO_HOST, divide_by=2)
    del source
    later = torch.full((n,), 3.0, device="cuda")  # may take the source's memory only after the copy
    transfers.before_host_read(host)
    assert bool((host == 1.0).all()), "the copy read values from before the compute or after the reuse"
    assert bool((later == 3.0).all())
    assert stats.pageable_copies == 0 and stats.d2h_bytes == n * 4


@pytest.mark.cuda
def test_offloaded_training_copies_only_pinned_memory_and_matches_no_prefetch_bit_for_bit() -> None:
    def run(prefetch: int) -> tuple[Stats, dict[str, torch.Tensor]]:
        placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=prefetch)
        model = gpt2()
        chunked, optimizer, booster = boost(
            model, adamw_two_groups, precision="bf16", chunk_size=6_000, placement=placement
        )
        train_chunked(chunked, optimizer, booster, batches(4))
        return chunked.stats(), chunked.state_dict()

    stats, state = run(3)
    assert stats.pageable_copies == 0 and stats.d2h_bytes > 0 and stats.h2d_bytes > 0
    _, reference = run(0)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
