"""``Chunk`` built directly: layout, sharding, gather/release, master and shard moves, gradient
reduction and the state machines, at world size 1 (in process) and 2 (gloo ranks).

Every expected value is computed here from tensors saved before the chunk took the parameters.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from distributed import run_ranks
from tier import slow_cases

from chunkmem import (
    Chunk,
    ChunkState,
    Communicator,
    GradState,
    IllegalTransition,
    Location,
    MemoryKind,
    MemoryLedger,
    PendingGather,
    Stats,
    TensorInfo,
    TensorState,
)

CPU = torch.device("cpu")
DEV, HOST = Location.DEVICE, Location.HOST
# 6 + 11 + 5 = 22 elements: no capacity below is a multiple of these sizes.
SHAPES = ((2, 3), (11,), (5,))
USED = 22


# --- helpers -------------------------------------------------------------------------------------
def make_params(shapes=SHAPES, seed: int = 0, trainable: bool = True) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g), requires_grad=trainable) for s in shapes]


def build(
    comm: Communicator,
    capacity: int,
    params: list[torch.nn.Parameter],
    dtype: torch.dtype = torch.float32,
    trainable: bool = True,
    ledger: MemoryLedger | None = None,
    stats: Stats | None = None,
    chunk_id: int = 0,
) -> tuple[Chunk, list[TensorInfo], MemoryLedger, Stats]:
    ledger = ledger if ledger is not None else MemoryLedger()
    stats = stats if stats is not None else Stats()
    chunk = Chunk(chunk_id, capacity, dtype, trainable, comm, ledger, stats)
    infos = []
    offset = 0
    for index, p in enumerate(params):
        info = TensorInfo(f"p{index}", p, chunk_id, index, offset, p.numel(), p.shape, trainable)
        chunk.append(info)
        infos.append(info)
        offset += p.numel()
    return chunk, infos, ledger, stats


def flat_padded(tensors: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """The reference chunk content: tensors flattened back to back, zero padding to ``capacity``."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    return torch.cat([flat, torch.zeros(capacity - flat.numel())])


def assert_placeholders(params: list[torch.nn.Parameter], shapes=SHAPES) -> None:
    for p, shape in zip(params, shapes, strict=True):
        assert p.shape == torch.Size(shape)
        assert torch.isnan(p.data.float()).all(), "a released parameter must point at a NaN placeholder"


def assert_values(params: list[torch.nn.Parameter], expected: list[torch.Tensor], dtype=torch.float32) -> None:
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        assert p.dtype == dtype, f"p{i}: dtype {p.dtype}"
        assert p.shape == e.shape, f"p{i}: shape {p.shape}"
        assert torch.equal(p.data, e.to(dtype)), f"p{i}: values differ from the originals"


def backward_grad(chunk: Chunk, info: TensorInfo, grad: torch.Tensor) -> None:
    """What the runtime does for one parameter: the op's backward uses it, then its gradient lands."""
    chunk.enter_compute(info)
    chunk.leave_compute(info, TensorState.HOLD_AFTER_BWD)
    chunk.accumulate_grad(info, grad)


def grads_for(rank: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


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
        chunk.append(TensorInfo("a", a, 4, 0, 1, 6, a.shape, True))  # wrong offset
    with pytest.raises(ValueError, match="another position"):
        chunk.append(TensorInfo("a", a, 3, 0, 0, 6, a.shape, True))  # wrong chunk
    chunk.append(TensorInfo("a", a, 4, 0, 0, 6, a.shape, True))
    with pytest.raises(ValueError, match=r"'b' \(5 elements\) does not fit in the 4 elements left"):
        chunk.append(TensorInfo("b", b, 4, 1, 6, 5, b.shape, True))
    assert chunk.used == 6 and len(chunk.tensors) == 1
    chunk.close(DEV, DEV)
    c = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"chunk 4 \(rank 0, state released\): cannot append parameter 'c'"):
        chunk.append(TensorInfo("c", c, 4, 1, 6, 1, c.shape, True))


def test_store_before_close_raises() -> None:
    chunk, *_ = build(Communicator(None, CPU), 25, make_params())
    with pytest.raises(RuntimeError, match=r"chunk 0 .*close\(\) it first"):
        _ = chunk.store
    with pytest.raises(RuntimeError, match="cannot gather"):
        chunk.gather(async_op=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", [(DEV, DEV), (HOST, DEV), (HOST, HOST)], ids=["dev", "host-dev", "host-host"])
def test_close_gather_release_w1(dtype: torch.dtype, placement: tuple[Location, Location]) -> None:
    capacity = 25  # 3 elements of padding
    params = make_params()
    originals = [p.detach().clone() for p in params]
    chunk, _, ledger, _ = build(Communicator(None, CPU), capacity, params, dtype=dtype)
    assert chunk.used == USED and chunk.shard_numel == capacity and chunk.shard_range == (0, capacity)
    chunk.close(*placement)
    assert chunk.state is ChunkState.RELEASED
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

    chunk.gather(async_op=False)
    assert chunk.state is ChunkState.GATHERED
    assert_values(params, originals, dtype)
    # At world size 1 a compute-dtype shard resident on the device is the chunk: nothing to allocate.
    resident = placement == (HOST, DEV) or (placement == (DEV, DEV) and dtype == torch.float32)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == (0 if resident else capacity * dtype.itemsize)
    chunk.release()
    assert chunk.state is ChunkState.RELEASED
    assert_placeholders(params)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    pending = chunk.gather(async_op=True)
    assert isinstance(pending, PendingGather)
    assert chunk.state is ChunkState.GATHERING
    chunk.wait()
    assert chunk.state is ChunkState.GATHERED
    assert_values(params, originals, dtype)
    chunk.release()
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0


def test_gathered_views_write_through_and_share_storage_w1() -> None:
    """Parameters are views into one flat buffer, back to back."""
    params = make_params()
    chunk, *_ = build(Communicator(None, CPU), 25, params, dtype=torch.bfloat16)
    chunk.close(DEV, DEV)
    chunk.gather(async_op=False)
    base = params[0].data.data_ptr()
    offsets = [0, 6, 17]
    for p, offset in zip(params, offsets, strict=True):
        assert p.data.data_ptr() == base + offset * 2
    chunk.release()


def test_master_moves_preserve_values_w1() -> None:
    params = make_params()
    originals = [p.detach().clone() for p in params]
    capacity = 25
    chunk, infos, ledger, _ = build(Communicator(None, CPU), capacity, params, dtype=torch.bfloat16)
    chunk.close(DEV, DEV)
    chunk.gather(async_op=False)
    grads = grads_for(0)
    chunk.prepare_grad()
    for info, g in zip(infos, grads, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == capacity * 4
    chunk.release()

    chunk.move_master(HOST)
    torch.testing.assert_close(chunk.grad_shard, flat_padded(grads, capacity))
    assert chunk.store.master_location is HOST
    assert ledger.bytes(DEV, MemoryKind.MASTER) == 0 and ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == 0
    assert ledger.bytes(HOST, MemoryKind.MASTER) == capacity * 4
    assert ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == capacity * 4
    torch.testing.assert_close(chunk.store.master, flat_padded(originals, capacity), rtol=0, atol=0)
    chunk.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    chunk.release()

    chunk.move_master(DEV)
    assert ledger.bytes(HOST) == 0
    assert ledger.bytes(DEV, MemoryKind.MASTER) == capacity * 4
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == capacity * 4
    chunk.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    chunk.release()
    torch.testing.assert_close(chunk.grad_shard, flat_padded(grads, capacity))
    assert ledger.bytes(DEV) == 2 * capacity * 4
    chunk.zero_grad()
    assert not chunk.store.grad_allocated  # freed; its room stays reserved
    assert ledger.bytes(DEV) == 2 * capacity * 4


def test_move_shard_of_host_master_w1() -> None:
    params = make_params()
    originals = [p.detach().clone() for p in params]
    capacity = 25
    chunk, _, ledger, stats = build(Communicator(None, CPU), capacity, params, dtype=torch.bfloat16)
    chunk.close(HOST, HOST)
    assert ledger.bytes(DEV) == 0
    # A pinned-style host cast of the master in compute dtype.
    assert ledger.bytes(HOST, MemoryKind.SHARD_COPY) == capacity * 2
    chunk.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    assert stats.h2d_bytes == capacity * 2  # the bf16 cast crossed, not the fp32 master
    chunk.release()

    chunk.move_shard(DEV)
    assert chunk.store.shard_location is DEV
    assert ledger.bytes(DEV, MemoryKind.SHARD_COPY) == capacity * 2
    chunk.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0  # the device copy is the chunk at world size 1
    chunk.release()
    chunk.move_shard(HOST)
    assert ledger.bytes(DEV) == 0
    chunk.gather(async_op=False)
    assert_values(params, originals, torch.bfloat16)
    chunk.release()

    device_master, *_ = build(Communicator(None, CPU), capacity, make_params(), chunk_id=1)
    device_master.close(DEV, DEV)
    with pytest.raises(ValueError, match="master first"):
        device_master.move_shard(HOST)


def test_placement_master_on_device_shard_on_host_is_rejected() -> None:
    chunk, *_ = build(Communicator(None, CPU), 25, make_params())
    with pytest.raises(ValueError, match="cannot be on the host"):
        chunk.close(DEV, HOST)


@pytest.mark.parametrize("master", [DEV, HOST], ids=["device-master", "host-master"])
def test_gradients_accumulate_and_reduce_w1(master: Location) -> None:
    capacity = 25
    params = make_params()
    chunk, infos, ledger, _ = build(Communicator(None, CPU), capacity, params, dtype=torch.bfloat16)
    chunk.close(master, master)
    chunk.gather(async_op=False)
    g1, g2 = grads_for(0), grads_for(1)
    buffer_bytes = 0 if master is DEV else capacity * 4  # device master: the shard is the buffer

    chunk.prepare_grad()
    assert chunk.grad_state is GradState.ACCUMULATING
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == buffer_bytes
    for info, g in zip(infos, g1, strict=True):
        backward_grad(chunk, info, g)
        assert info.state is TensorState.READY_FOR_REDUCE
    chunk.reduce_grad()
    assert chunk.grad_state is GradState.REDUCED
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    assert all(info.state is TensorState.HOLD for info in infos)
    torch.testing.assert_close(chunk.grad_shard, flat_padded(g1, capacity))

    # A second backward without zero_grad adds to the reduced shard.
    chunk.prepare_grad()
    assert chunk.grad_state is GradState.REDUCED_ACCUMULATING
    for info, g in zip(infos, g2, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    expected = flat_padded(g1, capacity) + flat_padded(g2, capacity)
    torch.testing.assert_close(chunk.grad_shard, expected)
    assert chunk.params_with_grad == (True, True, True)

    chunk.zero_grad()
    assert chunk.grad_state is GradState.NONE
    assert chunk.params_with_grad == (False, False, False)
    # After zero_grad a new accumulation starts from zero.
    chunk.prepare_grad()
    backward_grad(chunk, infos[1], g2[1])
    chunk.zero_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    chunk.reset_states()
    chunk.prepare_grad()
    for info, g in zip(infos, g2, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    torch.testing.assert_close(chunk.grad_shard, flat_padded(g2, capacity))
    chunk.release()


def test_illegal_verbs_name_chunk_and_rank_w1() -> None:
    params = make_params()
    chunk, infos, _, _ = build(Communicator(None, CPU), 25, params, chunk_id=3)
    chunk.close(DEV, DEV)
    with pytest.raises(RuntimeError, match=r"chunk 3 \(rank 0, state released\): cannot release"):
        chunk.release()
    with pytest.raises(RuntimeError, match=r"chunk 3 \(rank 0, state released\): cannot report its pending gather"):
        chunk.wait()
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot refresh"):
        chunk.refresh()
    chunk.gather(async_op=False)
    with pytest.raises(
        RuntimeError, match=r"chunk 3 \(rank 0, state gathered\): cannot gather in state gathered; it needs state rel"
    ):
        chunk.gather(async_op=False)
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot reduce gradients in gradient state none"):
        chunk.reduce_grad()
    with pytest.raises(RuntimeError, match=r"chunk 3 .*no reduced gradient shard"):
        _ = chunk.grad_shard
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot accumulate 'p0' in gradient state none"):
        chunk.accumulate_grad(infos[0], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match=r"'p1' \(chunk 3 .*leaving compute without having entered"):
        chunk.leave_compute(infos[1], TensorState.HOLD)

    chunk.prepare_grad()
    with pytest.raises(RuntimeError, match=r"chunk 3 .*cannot allocate a gradient buffer in gradient state accum"):
        chunk.prepare_grad()
    # A second gradient for a parameter already ready, with no op in between (where ops are not
    # observed: two losses, retain_graph), adds to the first.
    chunk.accumulate_grad(infos[0], torch.ones(2, 3))
    chunk.accumulate_grad(infos[0], torch.ones(2, 3))
    assert infos[0].state is TensorState.READY_FOR_REDUCE
    chunk.reduce_grad()
    first = chunk.grad_shard[infos[0].offset : infos[0].offset + infos[0].numel]
    assert torch.equal(first, torch.full((6,), 2.0))

    chunk.enter_compute(infos[2])
    chunk.enter_compute(infos[2])  # overlapping ops share it
    with pytest.raises(RuntimeError, match=r"'p2' .*still in use"):
        chunk.reset_states()
    chunk.leave_compute(infos[2], TensorState.HOLD_AFTER_FWD)
    assert infos[2].state is TensorState.COMPUTE
    chunk.leave_compute(infos[2], TensorState.HOLD_AFTER_FWD)
    assert infos[2].state is TensorState.HOLD_AFTER_FWD
    chunk.zero_grad()
    chunk.reset_states()
    assert all(info.state is TensorState.HOLD for info in infos)
    chunk.release()


def test_frozen_chunk_has_no_gradients_w1() -> None:
    params = make_params(trainable=False)
    chunk, infos, ledger, _ = build(Communicator(None, CPU), 25, params, trainable=False, chunk_id=5)
    chunk.close(DEV, DEV)
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == 0
    assert chunk.grad_bytes == 0
    chunk.gather(async_op=False)
    with pytest.raises(RuntimeError, match=r"chunk 5 \(rank 0, .*\): cannot accumulate 'p0'; .*do not require grad"):
        chunk.accumulate_grad(infos[0], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match=r"chunk 5 .*cannot allocate a gradient buffer; .*do not require grad"):
        chunk.prepare_grad()
    with pytest.raises(RuntimeError, match="no gradient shard"):
        _ = chunk.store.grad
    chunk.zero_grad()  # a no-op, not an error
    chunk.release()


def test_scalar_parameter_w1() -> None:
    scalar = torch.nn.Parameter(torch.tensor(2.5))
    vector = torch.nn.Parameter(torch.arange(3.0))
    chunk, *_ = build(Communicator(None, CPU), 5, [scalar, vector])
    chunk.close(DEV, DEV)
    assert scalar.shape == torch.Size([]) and torch.isnan(scalar.data)
    chunk.gather(async_op=False)
    assert scalar.item() == 2.5
    assert torch.equal(vector.data, torch.arange(3.0))


@pytest.mark.parametrize("move", slow_cases(["move_shard", "move_master"], "move_shard"))
def test_dropped_resident_shard_is_freed_w1(move: str) -> None:
    params = make_params()
    chunk, _, ledger, _ = build(Communicator(None, CPU), 25, params)
    if move == "move_shard":
        chunk.close(HOST, DEV)  # the fp32 device copy of the host master serves as the chunk
    else:
        chunk.close(DEV, DEV)  # the fp32 device master serves as the chunk
    resident = chunk.store.resident_compute()
    assert resident is not None
    chunk.gather(async_op=False)
    assert params[0].data.data_ptr() == resident.data_ptr()
    dropped = weakref.ref(resident)
    del resident
    chunk.release()
    if move == "move_shard":
        chunk.move_shard(HOST)
        assert ledger.bytes(DEV, MemoryKind.SHARD_COPY) == 0
    else:
        chunk.move_master(HOST)
        assert ledger.bytes(DEV, MemoryKind.MASTER) == 0
    gc.collect()
    assert dropped() is None, "the ledger freed the device buffer but the chunk keeps it alive"


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
    assert chunk.shard_numel == shard and chunk.shard_range == (begin, end)
    chunk.close(DEV, DEV)
    assert_placeholders(params)
    torch.testing.assert_close(chunk.store.master, reference[begin:end], rtol=0, atol=0)
    out["master_shard"] = chunk.store.master.tolist()  # plain lists: tensors do not outlive the rank
    assert ledger.bytes(DEV, MemoryKind.MASTER) == shard * 4
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == shard * 4  # reserved; allocated when reduced into

    chunk.gather(async_op=False)
    assert_values(params, originals)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 4
    assert stats.allgather_bytes == capacity * 4
    chunk.release()
    assert_placeholders(params)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    pending = chunk.gather(async_op=True)
    assert isinstance(pending, PendingGather)
    assert chunk.state is ChunkState.GATHERING
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 4  # allocated when the gather starts
    chunk.wait()
    assert chunk.state is ChunkState.GATHERED
    assert_values(params, originals)

    # Illegal verbs name the chunk and this rank.
    with pytest.raises(RuntimeError, match=rf"chunk 0 \(rank {rank}, state gathered\): cannot gather"):
        chunk.gather(async_op=False)
    with pytest.raises(RuntimeError, match=rf"chunk 0 \(rank {rank}, .*\): cannot reduce gradients"):
        chunk.reduce_grad()
    with pytest.raises(IllegalTransition, match=rf"'p1' \(chunk 0, rank {rank}\)"):
        infos[1].transition(TensorState.HOLD_AFTER_BWD, rank)

    # Gradients: each rank accumulates its own; the shard holds this rank's slice of the mean.
    g0, g1 = grads_for(0), grads_for(1)
    mine = (g0, g1)[rank]
    chunk.prepare_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == capacity * 4
    for info, g in zip(infos, mine, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    assert ledger.bytes(DEV, MemoryKind.GRAD_BUFFER) == 0
    assert stats.reduce_scatter_bytes == capacity * 4
    mean = (flat_padded(g0, capacity) + flat_padded(g1, capacity)) / 2
    torch.testing.assert_close(chunk.grad_shard, mean[begin:end])
    out["grad_shard"] = chunk.grad_shard.tolist()
    # A second backward before zero_grad: its reduced mean adds to the shard.
    h0, h1 = grads_for(10), grads_for(11)
    chunk.prepare_grad()
    for info, g in zip(infos, (h0, h1)[rank], strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    mean2 = (flat_padded(h0, capacity) + flat_padded(h1, capacity)) / 2
    torch.testing.assert_close(chunk.grad_shard, mean[begin:end] + mean2[begin:end])
    chunk.zero_grad()
    chunk.release()

    # Master to the host and back; values survive a re-gather each time.
    chunk.move_master(HOST)
    assert ledger.bytes(DEV, MemoryKind.MASTER) == 0
    assert ledger.bytes(HOST, MemoryKind.MASTER) == shard * 4
    assert ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == shard * 4
    chunk.gather(async_op=False)
    assert_values(params, originals)
    chunk.release()
    # Host master: the gradient buffer is reduced into the host shard.
    chunk.prepare_grad()
    chunk.gather(async_op=False)
    for info, g in zip(infos, mine, strict=True):
        backward_grad(chunk, info, g)
    chunk.reduce_grad()
    assert ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == shard * 4
    assert chunk.grad_shard.device.type == "cpu"
    torch.testing.assert_close(chunk.grad_shard, mean[begin:end])
    chunk.zero_grad()
    chunk.release()
    chunk.move_master(DEV)
    assert ledger.bytes(HOST) == 0
    chunk.gather(async_op=True)
    chunk.wait()
    assert_values(params, originals)
    chunk.release()

    # bf16 compute: the gather casts the fp32 master.
    bf_params = make_params(seed=1)
    bf_originals = [p.detach().clone() for p in bf_params]
    bf, _, bf_ledger, _ = build(comm, capacity, bf_params, dtype=torch.bfloat16)
    bf.close(DEV, DEV)
    torch.testing.assert_close(bf.store.master, flat_padded(bf_originals, capacity)[begin:end], rtol=0, atol=0)
    bf.gather(async_op=False)
    assert_values(bf_params, bf_originals, torch.bfloat16)
    assert bf_ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 2
    bf.release()
    assert bf_ledger.bytes(DEV, MemoryKind.GATHERED) == 0

    # Host master and host shard, then the shard moved to the device and back.
    bf.move_master(HOST)
    assert bf.store.shard_location is DEV
    bf.move_shard(HOST)
    assert bf_ledger.bytes(DEV) == 0
    bf.gather(async_op=True)
    bf.wait()
    assert_values(bf_params, bf_originals, torch.bfloat16)
    bf.release()
    bf.move_shard(DEV)
    assert bf_ledger.bytes(DEV, MemoryKind.SHARD_COPY) == shard * 2
    bf.gather(async_op=False)
    assert_values(bf_params, bf_originals, torch.bfloat16)
    assert bf_ledger.bytes(DEV, MemoryKind.GATHERED) == capacity * 2
    bf.release()
    bf.move_shard(HOST)
    assert bf_ledger.bytes(DEV) == 0

    # A frozen chunk refuses gradients, naming the chunk, parameter and rank.
    frozen_params = make_params(trainable=False, seed=2)
    frozen, frozen_infos, frozen_ledger, _ = build(comm, capacity, frozen_params, trainable=False, chunk_id=4)
    frozen.close(DEV, DEV)
    assert frozen_ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == 0
    frozen.gather(async_op=False)
    with pytest.raises(RuntimeError, match=rf"chunk 4 \(rank {rank}, .*cannot accumulate 'p0'; .*do not require grad"):
        frozen.accumulate_grad(frozen_infos[0], torch.zeros(2, 3))
    frozen.release()
    with pytest.raises(RuntimeError, match=rf"chunk 4 \(rank {rank}, state released\): cannot release"):
        frozen.release()
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
