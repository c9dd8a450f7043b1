"""``DiskSides``: the optimizer sides that live on disk between steps, and the step pipeline that
streams them through host memory.

A chunk on disk keeps there its optimizer states (elementwise ones: Adam's moments; scalars such as
the step count stay in memory), its gradient shard (``GradOnDisk``) and, with 16-bit compute, its
fp32 master (``ShardStore`` moves that one); what gathers read (its 16-bit copy, or the fp32 master
with fp32 compute) stays in host memory, unless the parameter shard is on disk too (then the step
writes its 16-bit copy, or its fp32 master, back as well). Each chunk has a slot
of the disk file as large as the state the placement reserved for it.

``step`` runs the host step of such chunks in chunk order, ``DISK_WINDOW`` of them in memory at a
time: while one is stepped, the next is read and the previous written back (the I/O threads do the
reads and writes; a chunk's memory is freed once its write is done). A chunk's states are created
by its first step, in memory, and written out after it. A read or write that fails raises
``DiskTierError`` on every rank (the ranks agree after each such step); a chunk whose write failed
stays in memory with its current values, so nothing is lost, and is written again after its next
step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chunkmem.placement import DISK_WINDOW

from ..device.moves import to_device
from ..errors import DiskTierError
from ..tiers.disk import SidesFile
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from .optimizer_state import OptimizerState
from .piece import is_elementwise
from .runs import StepRuns

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk

__all__ = ["DiskSides"]

_Pending = list[tuple[Future[None], Callable[[], None] | None, Callable[[], None] | None]]
"""Reads or writes in flight, each with what to do on this thread if it fails, and what to do on
this thread once it is finished either way."""


@dataclass
class _Slot:
    """One chunk's states on disk: its slot of the file, and where each state tensor sits in it."""

    offset: int
    size: int
    placed: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """The elementwise state tensors written at the last eviction, with their offsets."""
    resident: bool = True
    """The state tensors hold their values in memory (always before the chunk's first step)."""
    nbytes: int = 0
    """Bytes of them accounted in host memory now."""


class DiskSides:
    """See the module docstring: the pipeline of the ``chunks`` whose sides ``SidePlaces`` puts on
    disk. ``reserved(chunk)`` is the state bytes the placement reserved."""

    def __init__(
        self,
        file: SidesFile,
        chunks: Sequence[Chunk],
        reserved: Callable[[Chunk], int],
        runs: StepRuns,
        state: OptimizerState,
        ledger: MemoryLedger,
    ) -> None:
        self._file = file
        self._runs = runs
        self._state = state
        self._ledger = ledger
        self._slots: dict[int, _Slot] = {}
        self._at: dict[int, tuple[torch.Tensor, int]] = {}  # id(state tensor) -> it, and its offset
        self._chunks = list(chunks)
        for chunk in chunks:
            size = reserved(chunk)
            self._slots[chunk.chunk_id] = _Slot(file.region(size), size)

    def view_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A state tensor whose values are on disk now, as a view mapped from the file (``None``
        when it is not one of those)."""
        offset = self._at.get(id(tensor))
        if offset is None or offset[0] is not tensor:
            return None
        return self._file.view(offset[1], tensor.numel(), tensor.dtype).view(tensor.shape)

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a load stages ``numel`` state values of a chunk on disk: a file of the disk tier's
        scratch directory."""
        return self._file.staging(numel, dtype)

    def install(self, builders: dict[int, Callable[[], dict[torch.Tensor, dict[str, Any]]]]) -> None:
        """A loaded state for the chunks on disk, one chunk at a time: build its runs' states (what
        the optimizer's ``load_state_dict`` would have installed: elementwise state in the run's
        dtype and device, the step count as it is), write them out and free them."""
        failures: list[BaseException] = []
        table = self._state.table
        for slot in self._slots.values():
            slot.placed, slot.resident, slot.nbytes = [], True, 0
        for chunk in self._chunks:
            build = builders.get(chunk.chunk_id)
            for tensor, state in (build() if build is not None else {}).items():
                table[tensor] = {
                    key: to_device(value, tensor.device, tensor.dtype)
                    if isinstance(value, torch.Tensor) and key != "step" and value.is_floating_point()
                    else value
                    for key, value in state.items()
                }
            self._settle(self.evict(chunk, changed=True), failures)
        if failures:
            raise failures[0]

    # --- one chunk in and out -------------------------------------------------------------------
    def _elementwise(self, chunk: Chunk) -> list[torch.Tensor]:
        out = []
        for run in self._runs.runs():
            if run.chunk is chunk:
                out += [v for v in (self._state.table.get(run.tensor) or {}).values() if is_elementwise(v, run.tensor)]
        return out

    def fetch(self, chunk: Chunk) -> _Pending:
        """Start reading ``chunk``'s master (if on disk) and states into memory."""
        pending: _Pending = []
        master = chunk.store.fetch_master()
        if master is not None:
            pending.append((master, None, None))
        grad = chunk.store.grad_on_disk
        read = grad.fetch() if grad is not None else None
        if read is not None:
            pending.append((read, None, None))
        slot = self._slots[chunk.chunk_id]
        if not slot.resident:
            for tensor, offset in slot.placed:
                tensor.untyped_storage().resize_(tensor.nbytes)
                pending.append((self._file.read(tensor, offset), None, None))
            slot.resident = True
            slot.nbytes = sum(t.nbytes for t, _ in slot.placed)
            self._ledger.alloc(Location.HOST, MemoryKind.STAGING, slot.nbytes)
        return pending

    def evict(self, chunk: Chunk, changed: bool) -> _Pending:
        """Write ``chunk``'s master and states back when ``changed``, their memory freed once the
        writes are settled; a write that fails leaves them in memory, as they are (see ``_settle``)."""
        pending: _Pending = []
        param = chunk.store.write_param(changed)  # cast from the master before it leaves memory
        if param is not None:
            # A failed one keeps its values in memory by itself, found when settled.
            pending.append((param, None, chunk.store.settle_param))
        master = chunk.store.evict_master(changed)
        if master is not None:
            pending.append((master, chunk.store.master_write_failed, None))
        grad = chunk.store.grad_on_disk
        if grad is not None:
            grad.evict()  # only ever read by the step
        slot = self._slots[chunk.chunk_id]
        if not slot.resident:
            return pending
        tensors = self._elementwise(chunk)
        if slot.nbytes == 0:  # states created by this step, in memory now
            slot.nbytes = sum(t.nbytes for t in tensors)
            self._ledger.alloc(Location.HOST, MemoryKind.STAGING, slot.nbytes)
        if not changed and [t for t, _ in slot.placed] == tensors:
            for tensor in tensors:
                tensor.untyped_storage().resize_(0)
            self._gone(slot)
            return pending
        for tensor, _ in slot.placed:
            self._at.pop(id(tensor), None)
        slot.placed = self._place(chunk, slot, tensors)
        for tensor, offset in slot.placed:
            self._at[id(tensor)] = (tensor, offset)
        if not slot.placed:
            self._gone(slot)
            return pending
        nbytes = slot.nbytes
        failures = [False]

        def failed() -> None:
            failures[0] = True
            if not slot.resident:
                slot.resident, slot.nbytes = True, nbytes
                self._ledger.alloc(Location.HOST, MemoryKind.STAGING, nbytes)

        def free() -> None:
            # Once every write was waited for (``_settle``, on this thread, in order: this is the
            # last one's), their memory goes, unless one failed: then they all stay in memory. The
            # futures order the free after the writes (the I/O threads finishing in any order).
            if not failures[0]:
                for tensor in tensors:
                    tensor.untyped_storage().resize_(0)

        writes = [self._file.write(tensor, offset) for tensor, offset in slot.placed]
        pending += [(write, failed, None) for write in writes[:-1]]
        pending.append((writes[-1], failed, free))
        self._gone(slot)
        return pending

    def _place(self, chunk: Chunk, slot: _Slot, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        placed, at = [], slot.offset
        for tensor in tensors:
            if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
                raise DiskTierError(
                    f"chunk {chunk.chunk_id}: an optimizer state tensor shares memory with others; the disk tier "
                    "moves whole state tensors"
                )
            if at + tensor.nbytes > slot.offset + slot.size:
                raise DiskTierError(
                    f"chunk {chunk.chunk_id}: the optimizer keeps more state than the {slot.size} bytes reserved for "
                    "it on disk (an optimizer whose state is not elementwise?)"
                )
            placed.append((tensor, at))
            at += tensor.nbytes
        return placed

    def _gone(self, slot: _Slot) -> None:
        slot.resident = False
        self._ledger.free(Location.HOST, MemoryKind.STAGING, slot.nbytes)
        slot.nbytes = 0

    @staticmethod
    def _settle(pending: _Pending, failures: list[BaseException]) -> None:
        """Wait for reads and writes; a failed write's compensation runs here, on this thread."""
        for future, on_failure, then in pending:
            error = future.exception()
            if error is not None:
                failures.append(error)
                if on_failure is not None:
                    on_failure()
            if then is not None:
                then()

    # --- the pipeline -------------------------------------------------------------------------
    def step(self, chunks: Sequence[Chunk], step: Callable[[Chunk], None]) -> None:
        """Step each chunk (``step``, its master and state in memory), read ahead and written behind,
        ``DISK_WINDOW`` chunks in memory at a time (one read, one stepped, one written). Raises the
        first read or write that failed, after every chunk was stepped or left as it was and every
        write finished or failed."""
        reads: dict[int, _Pending] = {}
        writes: list[_Pending] = []
        failures: list[BaseException] = []
        for index, chunk in enumerate(chunks):
            for ahead in range(index, min(len(chunks), index + DISK_WINDOW - 1)):
                if chunks[ahead].chunk_id not in reads:
                    while len(writes) > max(0, DISK_WINDOW - 2):  # the oldest write leaves memory first
                        self._settle(writes.pop(0), failures)
                    reads[chunks[ahead].chunk_id] = self.fetch(chunks[ahead])
            before = len(failures)
            self._settle(reads.pop(chunk.chunk_id), failures)
            if len(failures) > before:  # its values are not all in memory: leave it as it was
                writes.append(self.evict(chunk, changed=False))
                continue
            step(chunk)
            grad = chunk.store.grad_on_disk
            failure = grad.take_failure() if grad is not None else None
            if failure is not None:  # stepped on the gradient kept in memory; say so after the step
                failures.append(failure)
            writes.append(self.evict(chunk, changed=True))
        for pending in writes:
            self._settle(pending, failures)
        if failures:
            raise failures[0]

    @contextmanager
    def resident(self, chunk: Chunk, write_back: bool = False) -> Iterator[None]:
        """``chunk``'s master and states in memory for the block (a checkpoint saving or loading
        them); written back after it with ``write_back``."""
        failures: list[BaseException] = []
        self._settle(self.fetch(chunk), failures)
        if failures:
            self._settle(self.evict(chunk, changed=False), [])
            raise failures[0]
        try:
            yield
        finally:
            self._settle(self.evict(chunk, changed=write_back), failures)
            if failures:
                raise failures[0]
