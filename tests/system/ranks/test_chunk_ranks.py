"""``Chunk`` built directly at world size 2 (gloo ranks): shard contents, gathers, reductions and
moves on each rank (one rank: ``test_chunk.py``).

Every expected value is computed here from tensors saved before the chunk took the parameters.
"""

from __future__ import annotations

import pytest
import torch
from support.chunk_helpers import (
    CPU,
    DEV,
    HOST,
    assert_placeholders,
    assert_values,
    backward_grad,
    build,
    flat_padded,
    grads_for,
    make_params,
)
from support.distributed import run_ranks

from chunkmem import IllegalTransition, Stats
from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.tensor_state import TensorState
from chunkmem.placement import ChunkPlacement
from chunkmem.ranks.comm import Communicator, PendingGather
from chunkmem.usage.accounting import MemoryKind, MemoryLedger


# --- world size 2 --------------------------------------------------------------------------------
def _two_ranks(rank: int, world_size: int) -> dict[str, object]:
    """Many checks in one process start. Asserts here fail the test with this rank's traceback."""
    comm = Communicator(None, CPU)
    assert comm.world_size == world_size == 2 and comm.rank == rank
    capacity = 26  # 22 elements used: shard 13 each; p1 straddles the shards; rank 1's shard ends in padding
    shard = capacity // 2
    begin, end = rank * shard, (rank + 1) * shard
    out: dict[str, object] = {}

    with pytest.raises(ValueError, match="multiple of the world size 2"):
        Chunk(9, 25, torch.float32, True, comm, MemoryLedger(), Stats())

    # fp32, master on the device: shard content, gather sync and async, release.
    params = make_params()
    originals = [p.detach().clone() for p in params]
    reference = flat_padded(originals, capacity)
    chunk, infos, ledger, stats = build(comm, capacity, params)
    assert chunk.layout.shard_numel == shard and chunk.layout.shard_range == (begin, end)
    chunk.close(ChunkPlacement(DEV, DEV))
    assert_placeholders(params)
    torch.testing.assert_close(chunk.store.master, reference[begin:end], rtol=0, atol=0)
    out["master_shard"] = chunk.store.master.tolist()  # plain lists: tensors do not outlive the rank
    assert ledger.bytes(DEV, MemoryKind.MASTER) == shard * 4
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == shard * 4  # reserved; allocated when reduced into

    chunk.residency.gather(async_op=False)
    assert_values(params, originals)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 4
    assert stats.allgather_bytes == capacity * 4
    chunk.residency.release()
    assert_placeholders(params)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    pending = chunk.residency.gather(async_op=True)
    assert isinstance(pending, PendingGather) and chunk.residency.pending is pending
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 4  # allocated when the gather starts
    chunk.residency.wait()
    assert_values(params, originals)

    # Illegal verbs name the chunk and this rank.
    with pytest.raises(RuntimeError, match=rf"chunk 0 \(rank {rank}\): has no gather in flight"):
        chunk.residency.wait()
    with pytest.raises(RuntimeError, match=rf"chunk 0 \(rank {rank}\): cannot reduce gradients"):
        chunk.reduce_grad()
    with pytest.raises(IllegalTransition, match=rf"'p1' \(chunk 0, rank {rank}\)"):
        infos[1].transition(TensorState.HOLD_AFTER_BWD, rank)

    # Gradients: each rank accumulates its own; the shard holds this rank's slice of the mean.
    g0, g1 = grads_for(0), grads_for(1)
    mine = (g0, g1)[rank]
    chunk.grads.prepare()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == capacity * 4
    for info, g in zip(infos, mine, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    assert stats.reduce_scatter_bytes == capacity * 4
    mean = (flat_padded(g0, capacity) + flat_padded(g1, capacity)) / 2
    torch.testing.assert_close(chunk.grads.shard, mean[begin:end])
    out["grad_shard"] = chunk.grads.shard.tolist()
    # A second backward before zero_grad: its reduced mean adds to the shard (the device residency
    # says it holds reduced gradients).
    h0, h1 = grads_for(10), grads_for(11)
    chunk.grads.prepare(onto_reduced=True)
    for info, g in zip(infos, (h0, h1)[rank], strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad(onto_reduced=True)
    mean2 = (flat_padded(h0, capacity) + flat_padded(h1, capacity)) / 2
    torch.testing.assert_close(chunk.grads.shard, mean[begin:end] + mean2[begin:end])
    chunk.grads.zero()
    chunk.residency.release()

    # A host master (placed there at close): values survive a gather, and the gradient buffer is
    # reduced into the host shard.
    host_params = make_params()
    host, host_infos, host_ledger, _ = build(comm, capacity, host_params, chunk_id=5)
    host.close(ChunkPlacement(HOST, HOST))
    assert host_ledger.bytes(DEV, MemoryKind.MASTER) == 0
    assert host_ledger.bytes(HOST, MemoryKind.MASTER) == shard * 4
    assert host_ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == shard * 4
    host.residency.gather(async_op=False)
    assert_values(host_params, originals)
    host.residency.release()
    host.grads.prepare()
    host.residency.gather(async_op=False)
    for info, g in zip(host_infos, mine, strict=True):
        backward_grad(host, info, g)
    host.reduce_grad()
    assert host_ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == shard * 4
    assert host.grads.shard.device.type == "cpu"
    torch.testing.assert_close(host.grads.shard, mean[begin:end])
    host.grads.zero()
    host.residency.release()

    # bf16 compute: the gather casts the fp32 master.
    bf_params = make_params(seed=1)
    bf_originals = [p.detach().clone() for p in bf_params]
    bf, _, bf_ledger, _ = build(comm, capacity, bf_params, dtype=torch.bfloat16)
    bf.close(ChunkPlacement(DEV, DEV))
    torch.testing.assert_close(bf.store.master, flat_padded(bf_originals, capacity)[begin:end], rtol=0, atol=0)
    bf.residency.gather(async_op=False)
    assert_values(bf_params, bf_originals, torch.bfloat16)
    assert bf_ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 2
    bf.residency.release()
    assert bf_ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    # A host master with its 16-bit copy on the host, and one with that copy kept on the device.
    for shard_at, chunk_id in ((HOST, 6), (DEV, 7)):
        placed_params = make_params(seed=1)
        placed, _, placed_ledger, _ = build(comm, capacity, placed_params, dtype=torch.bfloat16, chunk_id=chunk_id)
        placed.close(ChunkPlacement(HOST, shard_at))
        assert placed_ledger.bytes(DEV, MemoryKind.SHARD_COPY) == (shard * 2 if shard_at is DEV else 0)
        placed.residency.gather(async_op=True)
        placed.residency.wait()
        assert_values(placed_params, bf_originals, torch.bfloat16)
        assert placed_ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 2
        placed.residency.release()
        assert placed_ledger.bytes(DEV) == (shard * 2 if shard_at is DEV else 0)

    # A frozen chunk refuses gradients, naming the chunk, parameter and rank.
    frozen_params = make_params(trainable=False, seed=2)
    frozen, frozen_infos, frozen_ledger, _ = build(comm, capacity, frozen_params, trainable=False, chunk_id=4)
    frozen.close(ChunkPlacement(DEV, DEV))
    assert frozen_ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == 0
    frozen.residency.gather(async_op=False)
    with pytest.raises(RuntimeError, match=rf"chunk 4 \(rank {rank}\): cannot accumulate 'p0'; .*do not require grad"):
        frozen.accumulate_grad(frozen_infos[0], torch.zeros(2, 3))
    frozen.residency.release()
    return out


@pytest.mark.multirank
@pytest.mark.fast_tier
def test_two_ranks() -> None:
    results = run_ranks(_two_ranks, world_size=2)
    capacity = 26
    params = make_params()
    # The two shards partition the chunk: together they are the originals plus padding.
    whole = torch.tensor([x for r in results for x in r["master_shard"]])
    torch.testing.assert_close(whole, flat_padded(params, capacity), rtol=0, atol=0)
    g0, g1 = grads_for(0), grads_for(1)
    grads = torch.tensor([x for r in results for x in r["grad_shard"]])
    torch.testing.assert_close(grads, (flat_padded(g0, capacity) + flat_padded(g1, capacity)) / 2)
