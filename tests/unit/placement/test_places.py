"""Where a chunk's data lives (``chunkmem.placement.places``): one table of the (optimizer side,
parameter shard) pairs, which every placement is built by, and the master's place derived from it."""

from __future__ import annotations

import itertools

import pytest

from chunkmem.placement import PLACES, ChunkPlacement, Location

DEVICE, HOST, DISK = Location.DEVICE, Location.HOST, Location.DISK
# What the docs promise (docs/guide/placement.md, ZeRO-Offload / Gemini / ZeRO-Infinity): a master
# on the device is the parameter shard, and a shard on disk is written by a step run from disk.
REFUSED = {(DEVICE, HOST), (DEVICE, DISK), (HOST, DISK)}


def test_the_table_names_every_pair_and_refuses_exactly_those_that_cannot_be() -> None:
    assert set(PLACES) == set(itertools.product(Location, Location))
    assert {pair for pair, why in PLACES.items() if why is not None} == REFUSED


@pytest.mark.parametrize(("optim", "shard"), list(itertools.product(Location, Location)), ids=str)
@pytest.mark.parametrize("keep_gathered", [False, True])
def test_a_placement_is_built_only_as_the_table_allows(optim: Location, shard: Location, keep_gathered: bool) -> None:
    refused = (optim, shard) in REFUSED or (keep_gathered and optim is not DEVICE)
    if not refused:
        placement = ChunkPlacement(optim, shard, keep_gathered=keep_gathered)
        assert (placement.optim, placement.shard, placement.keep_gathered) == (optim, shard, keep_gathered)
        return
    with pytest.raises(ValueError, match=rf"optim={optim.value}, shard={shard.value}") as error:
        ChunkPlacement(optim, shard, keep_gathered=keep_gathered)
    assert "put" in str(error.value) or "place it" in str(error.value)  # it says what to do


@pytest.mark.parametrize("master_is_compute", [False, True], ids=["16-bit-compute", "master-is-compute"])
def test_the_master_lives_with_its_side_but_stays_in_memory_while_gathers_read_it_there(
    master_is_compute: bool,
) -> None:
    assert ChunkPlacement(DEVICE, DEVICE).master_place(master_is_compute) is DEVICE
    assert ChunkPlacement(HOST, HOST).master_place(master_is_compute) is HOST
    assert ChunkPlacement(DISK, DISK).master_place(master_is_compute) is DISK
    # A side on disk with its parameter shard in memory: a master gathers read stays in host memory.
    expected = HOST if master_is_compute else DISK
    assert ChunkPlacement(DISK, HOST).master_place(master_is_compute) is expected
