"""``ChunkManager``: packing, the parameter -> chunk map, unmanageable parameters, and byte
accounting against analytic counts. Packing is also checked as a property (hypothesis) and against
``search_chunk_size``'s own packing model.

World sizes above 1 use a ``Communicator`` subclass that only reports a rank and world size:
registering and closing chunks issue no collectives.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.models import gpt2
from support.tier import examples

from chunkmem import Stats, UnmanageableParameter
from chunkmem.chunks.manager import ChunkManager
from chunkmem.chunks.search import search_chunk_size
from chunkmem.placement import ChunkPlacement
from chunkmem.ranks.comm import Communicator
from chunkmem.usage.accounting import Location, MemoryKind

CPU = torch.device("cpu")
DEV, HOST = Location.DEVICE, Location.HOST


class FakeWorld(Communicator):
    """World size ``world_size`` seen from ``rank``, without a process group (no collectives)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        super().__init__(None, CPU, world_size=world_size, rank=rank)


def manager(world_size: int = 1, dtype: torch.dtype = torch.float32) -> ChunkManager:
    comm = Communicator(None, CPU) if world_size == 1 else FakeWorld(world_size)
    return ChunkManager(comm, dtype, Stats())


def param(numel: int, trainable: bool = True, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(numel).to(dtype), requires_grad=trainable)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def reference_pack(
    specs: list[tuple[int, tuple[object, bool]]], chunk_size: int, world: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """Independent model of the packing rules: per parameter (chunk index, offset), and capacities."""
    capacity = round_up(chunk_size, world)
    capacities: list[int] = []
    fill: list[int] = []
    open_chunk: dict[object, int] = {}
    placed = []
    for numel, key in specs:
        if numel > capacity:
            capacities.append(round_up(numel, world))
            fill.append(numel)
            placed.append((len(capacities) - 1, 0))
            continue
        c = open_chunk.get(key)
        if c is None or fill[c] + numel > capacity:
            capacities.append(capacity)
            fill.append(0)
            c = open_chunk[key] = len(capacities) - 1
        placed.append((c, fill[c]))
        fill[c] += numel
    return placed, capacities


def close_all(m: ChunkManager, master: Location = DEV, shard: Location = DEV) -> None:
    m.close_all(lambda chunk: ChunkPlacement(master, shard))


# --- grouping and layout -------------------------------------------------------------------------
def test_groups_by_dtype_and_requires_grad() -> None:
    named = [
        ("a", param(10)),
        ("frozen", param(10, trainable=False)),
        ("half", param(10, dtype=torch.float16)),
        ("b", param(10)),
        ("bf", param(10, dtype=torch.bfloat16)),
        ("frozen2", param(10, trainable=False)),
        ("half2", param(10, dtype=torch.float16)),
    ]
    m = manager()
    m.register(named, chunk_size=100)
    by_name = {info.name: info for info in m.infos}
    assert [info.name for info in m.infos] == [n for n, _ in named]
    # Same group: same chunk, back to back; different groups never share.
    assert by_name["a"].chunk_id == by_name["b"].chunk_id
    assert (by_name["a"].offset, by_name["b"].offset) == (0, 10)
    assert by_name["frozen"].chunk_id == by_name["frozen2"].chunk_id
    assert by_name["half"].chunk_id == by_name["half2"].chunk_id
    distinct = {by_name[n].chunk_id for n in ("a", "frozen", "half", "bf")}
    assert len(distinct) == 4 == len(m.chunks)
    for chunk in m.chunks:
        groups = {(info.param.dtype, info.param.requires_grad) for info in chunk.layout.tensors}
        assert len(groups) == 1
        assert chunk.layout.trainable == next(iter(groups))[1]
    for name, p in named:
        info = m.info(p)
        assert info.param is p and info.name == name and m.manages(p)
        assert info.trainable == p.requires_grad
        assert info.shape == p.shape and info.numel == p.numel()
    with pytest.raises(KeyError, match="not managed"):
        m.info(param(3))


def test_parameter_larger_than_chunk_gets_its_own_chunk() -> None:
    m = manager(world_size=4)
    small1, big, small2 = param(5), param(23), param(6)
    m.register([("s1", small1), ("big", big), ("s2", small2)], chunk_size=10)
    # chunk_size 10 rounds up to 12 at world size 4; the 23-element parameter gets 24.
    info_big = m.info(big)
    assert m.chunk(info_big.chunk_id).layout.capacity == 24
    assert [info.name for info in m.chunk(info_big.chunk_id).layout.tensors] == ["big"]
    # The open chunk of the group stays open across the big parameter.
    assert m.info(small1).chunk_id == m.info(small2).chunk_id
    assert m.info(small2).offset == 5
    assert m.chunk(m.info(small1).chunk_id).layout.capacity == 12
    assert all(chunk.layout.capacity % 4 == 0 for chunk in m.chunks)


def test_layout_is_deterministic() -> None:
    def layout() -> list[tuple[str, int, int]]:
        model = gpt2(n_layer=2, n_embd=32, seed=3)
        m = manager(world_size=2)
        m.register(list(model.named_parameters()), chunk_size=5000)
        return [(info.name, info.chunk_id, info.offset) for info in m.infos]

    first, second = layout(), layout()
    assert first == second
    # And it is the packing the rules describe.
    model = gpt2(n_layer=2, n_embd=32, seed=3)
    named = list(model.named_parameters())
    expected, _ = reference_pack([(p.numel(), (p.dtype, p.requires_grad)) for _, p in named], 5000, 2)
    # Chunk ids are assigned in creation order, which the reference follows too.
    assert [(c, o) for _, c, o in first] == expected
    assert [n for n, _, _ in first] == [n for n, _ in named]


def test_unmanageable_parameters() -> None:
    m = manager()
    ints = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(UnmanageableParameter, match=r"parameter 'ids' \(rank 0\) has dtype torch\.int64"):
        m.register([("ids", ints)], chunk_size=10)
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(UnmanageableParameter, match=r"parameter 'w' \(rank 0\) is on the meta device"):
        m.register([("w", meta)], chunk_size=10)
    p = param(4)
    with pytest.raises(UnmanageableParameter, match=r"parameter 'again' \(rank 0\) is registered twice"):
        manager().register([("once", p), ("again", p)], chunk_size=10)
    m2 = manager()
    m2.register([("once", p)], chunk_size=10)
    with pytest.raises(UnmanageableParameter, match="registered twice"):
        m2.register([("later", p)], chunk_size=10)

    class Tagged(torch.nn.Parameter):
        pass

    with pytest.raises(UnmanageableParameter, match=r"not a plain nn\.Parameter"):
        manager().register([("tagged", Tagged(torch.zeros(2)))], chunk_size=10)
    assert issubclass(UnmanageableParameter, ValueError)
    with pytest.raises(ValueError, match="positive"):
        manager().register([("p", param(2))], chunk_size=0)


# --- byte accounting -----------------------------------------------------------------------------
SIZES = [(700, True), (300, True), (50, False), (1500, True), (80, False), (999, True), (1, True)]


def build_model(world: int, dtype: torch.dtype, chunk_size: int = 1000) -> tuple[ChunkManager, list[int], list[bool]]:
    """A manager over SIZES, and the capacities and trainability of its chunks computed here."""
    m = manager(world, dtype)
    named = [(f"p{i}", param(n, trainable=t)) for i, (n, t) in enumerate(SIZES)]
    m.register(named, chunk_size)
    placed, capacities = reference_pack([(n, (torch.float32, t)) for n, t in SIZES], chunk_size, world)
    trainable = [False] * len(capacities)
    for (chunk_index, _), (_, t) in zip(placed, SIZES, strict=True):
        trainable[chunk_index] = t
    assert [chunk.layout.capacity for chunk in m.chunks] == capacities
    return m, capacities, trainable


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bytes_after_close_all_on_device(world: int, dtype: torch.dtype) -> None:
    m, capacities, trainable = build_model(world, dtype)
    ledger = m.ledger
    assert ledger.device_bytes == 0 and ledger.host_bytes == 0  # registering allocates nothing
    close_all(m)
    master = sum(c // world * 4 for c in capacities)
    grads = sum(c // world * 4 for c, t in zip(capacities, trainable, strict=True) if t)
    assert ledger.bytes(DEV, MemoryKind.MASTER) == master
    assert ledger.bytes(DEV, MemoryKind.GRAD_SHARD) == grads
    assert ledger.bytes(DEV) == master + grads
    assert ledger.bytes(HOST) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bytes_after_close_all_on_host(dtype: torch.dtype) -> None:
    world = 4
    m, capacities, trainable = build_model(world, dtype)
    close_all(m, HOST, HOST)
    ledger = m.ledger
    shard = [c // world for c in capacities]
    assert ledger.bytes(DEV) == 0
    assert ledger.bytes(HOST, MemoryKind.MASTER) == sum(s * 4 for s in shard)
    assert ledger.bytes(HOST, MemoryKind.GRAD_SHARD) == sum(s * 4 for s, t in zip(shard, trainable, strict=True) if t)
    # 16-bit compute keeps a compute-dtype cast of each host master.
    casts = sum(s * 2 for s in shard) if dtype == torch.bfloat16 else 0
    assert ledger.bytes(HOST, MemoryKind.SHARD_COPY) == casts


def test_close_all_places_each_chunk_as_asked() -> None:
    world = 2
    m, capacities, _ = build_model(world, torch.float32)
    m.close_all(lambda chunk: ChunkPlacement(DEV, DEV) if chunk.chunk_id < 2 else ChunkPlacement(HOST, HOST))
    for chunk in m.chunks:
        assert chunk.store.master_location is (DEV if chunk.chunk_id < 2 else HOST)
    host = sum(c // world * 4 for c in capacities[2:])
    assert m.ledger.bytes(HOST, MemoryKind.MASTER) == host
    assert m.ledger.bytes(DEV, MemoryKind.MASTER) == sum(c // world * 4 for c in capacities[:2])


def test_bytes_through_gather_and_release_bf16() -> None:
    m, capacities, trainable = build_model(1, torch.bfloat16)
    close_all(m)
    ledger = m.ledger
    master = sum(c * 4 for c in capacities)
    grads = sum(c * 4 for c, t in zip(capacities, trainable, strict=True) if t)
    base = master + grads
    assert ledger.device_bytes == base

    first, second = m.chunks[0], m.chunks[2]
    first.residency.gather(async_op=False)
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == first.layout.capacity * 2
    pending = second.residency.gather(async_op=True)
    assert pending is not None
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == (first.layout.capacity + second.layout.capacity) * 2
    assert ledger.peak_device_bytes == base + (first.layout.capacity + second.layout.capacity) * 2
    second.residency.wait()
    second.residency.release()
    first.residency.release()
    assert ledger.bytes(DEV, MemoryKind.GATHERED) == 0
    assert ledger.device_bytes == base


def test_fp32_gather_at_world_size_one_aliases_the_master() -> None:
    """fp32 compute with the master on the device: the master is the chunk, no gathered buffer."""
    m, _, _ = build_model(1, torch.float32)
    close_all(m)
    before = m.ledger.device_bytes
    for chunk in m.chunks:
        chunk.residency.gather(async_op=False)
    assert m.ledger.bytes(DEV, MemoryKind.GATHERED) == 0
    assert m.ledger.device_bytes == before
    for chunk in m.chunks:
        chunk.residency.release()


# --- packing properties --------------------------------------------------------------------------
@settings(max_examples=examples(150), deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 300), st.booleans()), min_size=1, max_size=25),
    chunk_size=st.integers(1, 400),
    world=st.integers(1, 8),
)
def test_packing_properties(specs: list[tuple[int, bool]], chunk_size: int, world: int) -> None:
    params = [torch.nn.Parameter(torch.empty(n), requires_grad=t) for n, t in specs]
    m = manager(world)
    m.register([(f"p{i}", p) for i, p in enumerate(params)], chunk_size)

    position = {id(p): i for i, p in enumerate(params)}
    assert [position[id(info.param)] for info in m.infos] == list(range(len(params)))
    for chunk in m.chunks:
        assert chunk.layout.capacity % world == 0
        capacity = chunk.layout.capacity
        assert capacity >= chunk_size or capacity >= max(info.numel for info in chunk.layout.tensors)
        assert chunk.layout.used <= chunk.layout.capacity
        assert chunk.layout.used == sum(info.numel for info in chunk.layout.tensors)
        end = 0
        previous = -1
        for index, info in enumerate(chunk.layout.tensors):
            assert info.chunk_id == chunk.chunk_id and info.index == index
            assert info.offset >= end, "parameters overlap"
            assert info.offset + info.numel <= chunk.layout.capacity, "parameter outside its chunk"
            order = position[id(info.param)]
            assert order > previous, "parameters out of registration order"
            previous = order
            end = info.offset + info.numel
            assert info.trainable == chunk.layout.trainable
    placed, capacities = reference_pack([(n, t) for n, t in specs], chunk_size, world)
    assert [(info.chunk_id, info.offset) for info in m.infos] == placed
    assert [chunk.layout.capacity for chunk in m.chunks] == capacities

    padding = sum(chunk.layout.capacity - chunk.layout.used for chunk in m.chunks)
    assert padding == sum(capacities) - sum(n for n, _ in specs)
    search = search_chunk_size(params, chunk_size, chunk_size, 1, world)
    assert search.waste_elements == padding
    assert search.num_chunks == len(m.chunks)
    assert search.chunk_size == round_up(chunk_size, world)
