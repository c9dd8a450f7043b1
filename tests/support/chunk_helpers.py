"""Building ``Chunk`` objects directly, for ``test_chunk.py`` (one rank) and ``test_chunk_ranks.py``
(two gloo ranks): parameters, a chunk holding them, and the expected chunk contents, computed
from tensors saved before the chunk took the parameters."""

from __future__ import annotations

import torch

from chunkmem import Stats
from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.tensor_state import TensorInfo, TensorState
from chunkmem.ranks.comm import Communicator
from chunkmem.usage.accounting import Location, MemoryLedger

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
        chunk.layout.append(info)
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
