"""``Chunk`` built directly at world size 1 (in process): layout, sharding, gather/release, master and
shard moves, gradient reduction and the state machines (two ranks: ``test_chunk_ranks.py``).

Every expected value is computed here from tensors saved before the chunk took the parameters.
"""

from __future__ import annotations

import pytest
import torch
from support.chunk_helpers import (
    CPU,
    DEV,
    HOST,
    USED,
    assert_placeholders,
    assert_values,
    backward_grad,
    build,
    flat_padded,
    grads_for,
    make_params,
)

from chunkmem import IllegalTransition, Stats
from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.tensor_state import TensorInfo, TensorState
from chunkmem.placement import ChunkPlacement
from chunkmem.ranks.comm import Communicator, PendingGather
from chunkmem.usage.accounting import Location, MemoryKind, MemoryLedger


# --- ledger and tensor states --------------------------------------------------------------------
def test_ledger_counts_and_peak() -> None:
    ledger = MemoryLedger()
    ledger.alloc(DEV, MemoryKind.GATHERED, 100)
    ledger.alloc(DEV, MemoryKind.MASTER, 40)
    ledger.alloc(HOST, MemoryKind.MASTER, 7)
    assert ledger.bytes(DEV) == 140 == ledger.device_bytes
    assert ledger.bytes(HOST) == 7 == ledger.host_bytes
    assert ledger.bytes(DEV, MemoryKind.MASTER) == 40
    ledger.free(DEV, MemoryKind.GATHERED, 100)
    assert ledger.device_bytes == 40
    assert ledger.peak_device_bytes == 140
    ledger.reset_peak()
    assert ledger.peak_device_bytes == 40
    with pytest.raises(ValueError, match="negative"):
        ledger.alloc(DEV, MemoryKind.GATHERED, -1)
    with pytest.raises(RuntimeError, match="only 40 are accounted"):
        ledger.free(DEV, MemoryKind.MASTER, 41)


def test_tensor_info_illegal_transition_names_parameter_chunk_and_rank() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    info = TensorInfo("layer.weight", p, 7, 0, 0, 3, p.shape, True)
    with pytest.raises(IllegalTransition, match=r"'layer\.weight' \(chunk 7, rank 3\).*hold -> hold_after_bwd"):
        info.transition(TensorState.HOLD_AFTER_BWD, rank=3)
    assert info.state is TensorState.HOLD
    # A legal cycle through every state.
    for target in (
        TensorState.COMPUTE,
        TensorState.HOLD_AFTER_FWD,
        TensorState.COMPUTE,
        TensorState.HOLD_AFTER_BWD,
        TensorState.READY_FOR_REDUCE,
        TensorState.HOLD,
    ):
        info.transition(target, rank=0)
        assert info.state is target
    with pytest.raises(IllegalTransition):
        info.transition(TensorState.HOLD_AFTER_BWD, rank=0)


# --- world size 1 --------------------------------------------------------------------------------
def test_append_rejects_bad_layouts() -> None:
    comm = Communicator(None, CPU)
    with pytest.raises(ValueError, match="positive multiple"):
        Chunk(0, 0, torch.float32, True, comm, MemoryLedger(), Stats())
    chunk = Chunk(4, 10, torch.float32, True, comm, MemoryLedger(), Stats())
    a, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match="another position"):
        chunk.layout.append(TensorInfo("a", a, 4, 0, 1, 6, a.shape, True))  # wrong offset
    with pytest.raises(ValueError, match="another position"):
        chunk.layout.append(TensorInfo("a", a, 3, 0, 0, 6, a.shape, True))  # wrong chunk
    chunk.layout.append(TensorInfo("a", a, 4, 0, 0, 6, a.shape, True))
    with pytest.raises(ValueError, match=r"'b' \(5 elements\) does not fit in the 4 elements left"):
        chunk.layout.append(TensorInfo("b", b, 4, 1, 6, 5, b.shape, True))
    assert chunk.layout.used == 6 and len(chunk.layout.tensors) == 1
    chunk.close(ChunkPlacement(DEV, DEV))
    c = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"chunk 4 \(rank 0\): cannot append parameter 'c'; the chunk is closed"):
        chunk.layout.append(TensorInfo("c", c, 4, 1, 6, 1, c.shape, True))


def test_store_before_close_raises() -> None:
    chunk, *_ = build(Communicator(None, CPU), 25, make_params())
    with pytest.raises(RuntimeError, match=r"chunk 0 .*close\(\) it first"):
        _ = chunk.store
    with pytest.raises(RuntimeError, match=r"chunk 0 \(rank 0\): has no shard yet; close\(\) it first"):
        chunk.residency.gather(async_op=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", [(DEV, DEV), (HOST, DEV), (HOST, HOST)], ids=["dev", "host-dev", "host-host"])
def test_close_gather_release_w1(dtype: torch.dtype, placement: tuple[Location, Location]) -> None:
    capacity = 25  # 3 elements of padding
    params = make_params()
    originals = [p.detach().clone() for p in params]
    chunk, _, ledger, _ = build(Communicator(None, CPU), capacity, params, dtype=dtype)
    layout = chunk.layout
    assert layout.used == USED and layout.shard_numel == capacity and layout.shard_range == (0, capacity)
    chunk.close(ChunkPlacement(*placement))
    assert chunk.layout.closed
    assert_placeholders(params)
    # The fp32 master holds the originals exactly (the compute dtype does not touch the master).
    torch.testing.assert_close(chunk.store.master, flat_padded(originals, capacity), rtol=0, atol=0)
    master, _ = placement
    assert ledger.bytes(master, MemoryKind.MASTER) == capacity * 4
    # The gradient shard is reserved where the master lives; like .grad in plain PyTorch its memory
    # exists only from the first reduction to zero_grad.
    assert ledger.bytes(master, MemoryKind.GRAD_SHARD) == capacity * 4
    assert not chunk.store.grad_allocated
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    chunk.residency.gather(async_op=False)
    assert_values(params, originals, dtype)
    # At world size 1 a compute-dtype shard resident on the device is the chunk: nothing to allocate.
    resident = placement == (HOST, DEV) or (placement == (DEV, DEV) and dtype == torch.float32)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == (0 if resident else capacity * dtype.itemsize)
    chunk.residency.release()
    assert_placeholders(params)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    pending = chunk.residency.gather(async_op=True)
    assert isinstance(pending, PendingGather) and chunk.residency.pending is pending
    chunk.residency.wait()
    assert_values(params, originals, dtype)
    chunk.residency.release()
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0


def test_gathered_views_write_through_and_share_storage_w1() -> None:
    """Parameters are views into one flat buffer, back to back."""
    params = make_params()
    chunk, *_ = build(Communicator(None, CPU), 25, params, dtype=torch.bfloat16)
    chunk.close(ChunkPlacement(DEV, DEV))
    chunk.residency.gather(async_op=False)
    base = params[0].data.data_ptr()
    offsets = [0, 6, 17]
    for p, offset in zip(params, offsets, strict=True):
        assert p.data.data_ptr() == base + offset * 2
    chunk.residency.release()


def test_a_host_master_gathers_its_16_bit_copy_w1() -> None:
    params = make_params()
    originals = [p.detach().clone() for p in params]
    capacity = 25
    chunk, _, ledger, stats = build(Communicator(None, CPU), capacity, params, dtype=torch.bfloat16)
    chunk.close(ChunkPlacement(HOST, HOST))
    assert ledger.bytes(DEV) == 0
    # A pinned-style host cast of the master in compute dtype.
    assert ledger.bytes(HOST, MemoryKind.SHARD_COPY) == capacity * 2
    chunk.residency.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    assert stats.h2d_bytes == capacity * 2  # the bf16 cast crossed, not the fp32 master
    chunk.residency.release()


def test_placement_master_on_device_shard_on_host_is_rejected() -> None:
    chunk, *_ = build(Communicator(None, CPU), 25, make_params())
    with pytest.raises(ValueError, match="cannot be on the host"):
        chunk.close(ChunkPlacement(DEV, HOST))


@pytest.mark.parametrize("master", [DEV, HOST], ids=["device-master", "host-master"])
def test_gradients_accumulate_and_reduce_w1(master: Location) -> None:
    capacity = 25
    params = make_params()
    chunk, infos, ledger, _ = build(Communicator(None, CPU), capacity, params, dtype=torch.bfloat16)
    chunk.close(ChunkPlacement(master, master))
    chunk.residency.gather(async_op=False)
    g1, g2 = grads_for(0), grads_for(1)
    buffer_bytes = 0 if master is DEV else capacity * 4  # device master: the shard is the buffer

    chunk.grads.prepare()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == buffer_bytes
    for info, g in zip(infos, g1, strict=True):
        backward_grad(chunk, info, g)
        assert info.state is TensorState.READY_FOR_REDUCE
    chunk.reduce_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    assert all(info.state is TensorState.HOLD for info in infos)
    torch.testing.assert_close(chunk.grads.shard, flat_padded(g1, capacity))

    # A second backward without zero_grad adds to the reduced shard (the device residency says it
    # holds reduced gradients).
    chunk.grads.prepare(onto_reduced=True)
    for info, g in zip(infos, g2, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad(onto_reduced=True)
    expected = flat_padded(g1, capacity) + flat_padded(g2, capacity)
    torch.testing.assert_close(chunk.grads.shard, expected)
    assert chunk.grads.params_with_grad == (True, True, True)

    chunk.grads.zero()
    assert chunk.grads.params_with_grad == (False, False, False)
    assert not chunk.store.grad_allocated
    # After zero_grad a new accumulation starts from zero.
    chunk.grads.prepare()
    backward_grad(chunk, infos[1], g2[1])
    chunk.grads.zero()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    chunk.reset_states()
    chunk.grads.prepare()
    for info, g in zip(infos, g2, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    torch.testing.assert_close(chunk.grads.shard, flat_padded(g2, capacity))
    chunk.residency.release()


def test_illegal_verbs_name_chunk_and_rank_w1() -> None:
    params = make_params()
    chunk, infos, _, _ = build(Communicator(None, CPU), 25, params, chunk_id=3)
    chunk.close(ChunkPlacement(DEV, DEV))
    # Whether it is gathered is the device residency's to check (test_residency.py); the chunk
    # refuses what its tensors cannot do.
    with pytest.raises(RuntimeError, match=r"chunk 3 \(rank 0\): has no gather in flight"):
        chunk.residency.wait()
    chunk.residency.gather(async_op=False)
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot reduce gradients without a gradient buffer"):
        chunk.reduce_grad()
    with pytest.raises(RuntimeError, match=r"chunk 3 \(rank 0\): its gradient shard is not allocated"):
        _ = chunk.grads.shard
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot accumulate 'p0' without a gradient buffer"):
        chunk.accumulate_grad(infos[0], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match=r"'p1' \(chunk 3 .*leaving compute without having entered"):
        chunk.leave_compute(infos[1], TensorState.HOLD)

    chunk.grads.prepare()
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot allocate a gradient buffer, it has one"):
        chunk.grads.prepare()
    # A second gradient for a parameter already ready, with no op in between (where ops are not
    # observed: two losses, retain_graph), adds to the first.
    chunk.accumulate_grad(infos[0], torch.ones(2, 3))
    chunk.accumulate_grad(infos[0], torch.ones(2, 3))
    assert infos[0].state is TensorState.READY_FOR_REDUCE
    chunk.reduce_grad()
    first = chunk.grads.shard[infos[0].offset : infos[0].offset + infos[0].numel]
    assert torch.equal(first, torch.full((6,), 2.0))

    chunk.enter_compute(infos[2])
    chunk.enter_compute(infos[2])  # overlapping ops share it
    with pytest.raises(RuntimeError, match=r"'p2' .*still in use"):
        chunk.reset_states()
    chunk.leave_compute(infos[2], TensorState.HOLD_AFTER_FWD)
    assert infos[2].state is TensorState.COMPUTE
    chunk.leave_compute(infos[2], TensorState.HOLD_AFTER_FWD)
    assert infos[2].state is TensorState.HOLD_AFTER_FWD
    chunk.grads.zero()
    chunk.reset_states()
    assert all(info.state is TensorState.HOLD for info in infos)
    chunk.residency.release()


def test_frozen_chunk_has_no_gradients_w1() -> None:
    params = make_params(trainable=False)
    chunk, infos, ledger, _ = build(Communicator(None, CPU), 25, params, trainable=False, chunk_id=5)
    chunk.close(ChunkPlacement(DEV, DEV))
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == 0
    assert chunk.layout.grad_bytes == 0
    chunk.residency.gather(async_op=False)
    with pytest.raises(RuntimeError, match=r"chunk 5 \(rank 0\): cannot accumulate 'p0'; .*do not require grad"):
        chunk.accumulate_grad(infos[0], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match=r"chunk 5 .*cannot allocate a gradient buffer; .*do not require grad"):
        chunk.grads.prepare()
    with pytest.raises(RuntimeError, match="no gradient shard"):
        _ = chunk.store.grad
    chunk.grads.zero()  # a no-op, not an error
    chunk.residency.release()


def test_scalar_parameter_w1() -> None:
    scalar = torch.nn.Parameter(torch.tensor(2.5))
    vector = torch.nn.Parameter(torch.arange(3.0))
    chunk, *_ = build(Communicator(None, CPU), 5, [scalar, vector])
    chunk.close(ChunkPlacement(DEV, DEV))
    assert scalar.shape == torch.Size([]) and torch.isnan(scalar.data)
    chunk.residency.gather(async_op=False)
    assert scalar.item() == 2.5
    assert torch.equal(vector.data, torch.arange(3.0))
