"""The local shard of one chunk: the fp32 master (source of truth, where the optimizer updates it),
its fp32 gradient shard (beside it, ``GradShard``), and the compute-dtype copies derived from it.

What a shard stores is its ``ShardKind``: a frozen chunk has no gradient shard, and one whose
parameters are in the compute dtype (``FROZEN_VALUES``) has no fp32 master either: its values, in
the compute dtype, take the master's place below (on the device, the host or disk, as placed) and,
being what gathers read, need no copy (as an fp32 master under fp32 compute).

* Master on the device: no copy at all; a gather casts the master into the gathered buffer on the
  fly (DeepSpeed's fused downcast), so only compute-dtype bytes are ever all-gathered.
* Master on the host, parameter shard on the host: a gather copies host data to the device; for
  16-bit compute it copies a pinned cast of the master (cast once per optimizer step), so half the
  bytes cross the bus.
* Master on the host, parameter shard on the device (Gemini's ``offload_optim`` without
  ``offload_param``): a device copy in compute dtype, refreshed once per optimizer step.
* Master on disk, parameter shard on disk (``offload_param_disk_frac``): a gather reads the 16-bit
  copy (``ParamOnDisk``), or with fp32 compute the master's own region, from disk into a staging
  buffer; nothing gathers read stays in host memory. A frozen chunk of values alone may read them in
  place from the user's weights files instead (``InPlaceShard``): never written, no disk bytes of
  its own.

Copies are caches keyed by the master's version, which the optimizer bumps after each update.
Every copy between host and device goes through :class:`HostTransfers` (counted, timed, and
asynchronous from pinned memory on CUDA); a CPU write into a pinned buffer first waits for the
copies still reading it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from .grad_on_disk import GradOnDisk
from .grad_shard import GradShard
from .master_buffer import MASTER_DTYPE, MasterSideBuffer
from .param_on_disk import ParamOnDisk, read_for_gather
from .shard_kind import ShardKind, SourceKind

if TYPE_CHECKING:
    from ..placement import ChunkPlacement
    from ..ranks.local_failures import LocalFailures
    from ..tiers.disk import SidesFile
    from .chunk_layout import ShardPiece
    from .values_in_place import InPlaceShard

__all__ = ["MASTER_DTYPE", "ShardStore", "SourceKind"]

_CPU = torch.device("cpu")


class ShardStore:
    """This rank's shard of one chunk; see the module docstring."""

    def __init__(
        self,
        label: str,
        numel: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        ledger: MemoryLedger,
        transfers: HostTransfers,
        placement: ChunkPlacement,
        kind: ShardKind,
        host_device: torch.device = _CPU,
        disk: SidesFile | None = None,
        in_place: InPlaceShard | None = None,
        failures: LocalFailures | None = None,
    ) -> None:
        # In memory the master lives with its optimizer side, on the device or the host; one whose
        # side is on disk may go there too (``move_master_to_disk``, by ``placement.master_place``).
        master = Location.DEVICE if placement.optim is Location.DEVICE else Location.HOST
        shard = placement.shard
        if (disk is not None) != (placement.optim is Location.DISK):
            raise ValueError(
                f"{label}: the disk tier's file is for an optimizer side placed on disk, and only for one "
                f"(placed: {placement})"
            )
        if in_place is not None and (not kind.values_only or shard is not Location.DISK):
            raise ValueError(f"{label}: only a frozen chunk of values alone, its shard on disk, reads them in place")
        self._kind = kind
        self._in_place = in_place
        self._label = label
        self._numel = numel
        self._values_dtype = kind.values_dtype(compute_dtype)
        self._compute_dtype = compute_dtype
        self._device = device
        self._ledger = ledger
        self._transfers = transfers
        self._pin = transfers.layer.pins
        self._version = 0
        self._master_location = master
        self._host_device = host_device
        self._failures = failures
        # Where the master lives between steps is the placement's answer (``master_place``); the
        # gradient shard of a side on disk goes there in every case.
        self._disk = disk if placement.master_place(not self._needs_host_cast) is Location.DISK else None
        self._param_disk = (
            ParamOnDisk(label, numel, compute_dtype, disk, ledger, transfers, host_device, failures)
            if disk is not None and shard is Location.DISK and self._needs_host_cast
            else None
        )
        self._disk_offset = -1
        self._master_resident = True
        # A master bound for disk never crosses the bus (gathers read its 16-bit copy): not pinned.
        self._master_buffers = MasterSideBuffer(
            self._values_kind,
            numel,
            device,
            ledger,
            self._pin and disk is None,
            transfers.layer,
            host_device=host_device,
            dtype=self._values_dtype,
        )
        self._master = self._master_buffers.take(master)
        self._grads: GradShard | None = None
        if kind.has_grad:
            self._grads = GradShard(
                label, numel, device, ledger, transfers, master, self._pin, host_device, disk, failures
            )
        self._host_cast: torch.Tensor | None = None
        self._host_cast_version = -1
        if master is Location.HOST and self._needs_host_cast and shard is not Location.DISK:
            self._host_cast = self._host_empty(compute_dtype)
            self._ledger.alloc(Location.HOST, MemoryKind.SHARD_COPY, transfers.layer.host_held_bytes(self._copy_bytes))
        self._shard_location = shard
        self._device_copy: torch.Tensor | None = None
        self._device_copy_version = -1
        if self.source_kind is SourceKind.DEVICE_COPY:
            self._alloc_device_copy()

    # --- sizes and places -------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self._numel

    @property
    def values_dtype(self) -> torch.dtype:
        """The master's dtype: fp32, or the dtype gathers read for a chunk of values alone
        (``ShardKind.FROZEN_VALUES``, ``ShardKind.QUANTIZED``)."""
        return self._values_dtype

    @property
    def _values_kind(self) -> MemoryKind:
        """How the ledger counts the master: fp32 shard data as ``MASTER`` (under fp32 compute a
        frozen chunk's values too, as any fp32 master there is what gathers read), a frozen chunk's
        16-bit values as the compute-dtype shard data they are (``SHARD_COPY``), a quantized
        chunk's stored bytes as ``QUANTIZED``."""
        if self._kind is ShardKind.QUANTIZED:
            return MemoryKind.QUANTIZED
        return MemoryKind.MASTER if self._values_dtype == MASTER_DTYPE else MemoryKind.SHARD_COPY

    @property
    def _master_bytes(self) -> int:
        return self._numel * self._values_dtype.itemsize

    @property
    def _copy_bytes(self) -> int:
        return self._numel * self._compute_dtype.itemsize

    @property
    def _needs_host_cast(self) -> bool:
        return self._compute_dtype != self._values_dtype

    @property
    def master(self) -> torch.Tensor:
        """The master shard (the optimizer's parameters are views of it): fp32, or a frozen chunk's
        values in the compute dtype (``ShardKind.FROZEN_VALUES``)."""
        return self._master

    @property
    def master_location(self) -> Location:
        return self._master_location

    @property
    def shard_location(self) -> Location:
        return self._shard_location

    @property
    def source_kind(self) -> SourceKind:
        if self._master_location is Location.DEVICE:
            return SourceKind.DEVICE_MASTER
        if self._shard_location is Location.DEVICE:
            return SourceKind.DEVICE_COPY
        if self._shard_location is Location.DISK:
            return SourceKind.DISK
        return SourceKind.HOST

    @property
    def keeps_compute_on_device(self) -> bool:
        """Whether compute-dtype shard data sits on the device between uses."""
        kind = self.source_kind
        return kind is SourceKind.DEVICE_COPY or (kind is SourceKind.DEVICE_MASTER and not self._needs_host_cast)

    def resident_compute(self) -> torch.Tensor | None:
        """A compute-dtype tensor on the device holding the current shard values between uses, if
        this placement keeps one (at world size 1 it can serve as the gathered buffer)."""
        kind = self.source_kind
        if kind is SourceKind.DEVICE_MASTER and not self._needs_host_cast:
            return self._master
        if kind is SourceKind.DEVICE_COPY:
            return self._refreshed_device_copy()
        return None

    def _host_empty(self, dtype: torch.dtype) -> torch.Tensor:
        return self._transfers.layer.host_empty(self._numel, dtype, self._host_device)

    # --- the gradient shard (GradShard) ------------------------------------------------------
    def _grad_shard(self) -> GradShard:
        if self._grads is None:
            raise RuntimeError(f"{self._label}: has no gradient shard; its parameters do not require grad")
        return self._grads

    @property
    def grad(self) -> torch.Tensor:
        """The fp32 gradient shard, where the master lives (see ``allocate_grad``), with every copy
        into it landed."""
        return self._grad_shard().values

    @property
    def grad_allocated(self) -> bool:
        return self._grads is not None and self._grads.allocated

    @property
    def grad_on_disk(self) -> GradOnDisk | None:
        """The gradient shard's disk residency, when it lives on disk (else ``None``)."""
        return self._grads.on_disk if self._grads is not None else None

    def allocate_grad(self) -> torch.Tensor:
        """Allocate the (uninitialised) gradient shard where the master lives."""
        return self._grad_shard().allocate()

    def free_grad(self) -> None:
        """Drop the gradient shard (its values no longer count); nothing to do when absent."""
        if self._grads is not None:
            self._grads.free()

    @property
    def receives_asynchronously(self) -> bool:
        """Whether reduced gradients cross to the host asynchronously (a host master on CUDA): they
        are then sent as soon as the reduction is queued, not when it is waited for."""
        return self._master_location is Location.HOST and self._transfers.asynchronous and self.grad_on_disk is None

    def receive_grad(
        self,
        reduced: torch.Tensor,
        accumulate: bool,
        after: Callable[[], None] | None = None,
        divide_by: int | None = None,
    ) -> None:
        """Put this rank's reduced gradient slot (on the device) into the gradient shard: a fresh
        shard, or added to what an earlier reduction left there (accumulation). ``after`` waits
        for a collective still reducing the slot and ``divide_by`` averages it first; to a host
        master both happen on the copy stream and the copy returns at once (``grad`` waits)."""
        self._grad_shard().receive(reduced, accumulate, after, divide_by)

    # --- verbs ------------------------------------------------------------------------------

    def prepare_host_write(self) -> None:
        """The CPU is about to write the master (an optimizer step, a load): wait for copies
        still reading it from pinned memory."""
        if self._master_location is Location.HOST:
            self._transfers.before_host_write(self._master)

    def mark_updated(self) -> None:
        """The master changed (optimizer step, checkpoint load): derived copies are stale. A master
        on disk changes only while in memory and its copies are made when it leaves
        (``evict_master``), so they are current whenever it is out of memory."""
        if self._master_resident:
            self._version += 1

    # --- reading for a gather ---------------------------------------------------------------
    def copy_into(self, slot: torch.Tensor) -> None:
        """Write this rank's shard, in compute dtype, into ``slot`` (a device tensor), counting
        bytes that cross from the host."""
        kind = self.source_kind
        if kind is SourceKind.DEVICE_MASTER:
            if slot.data_ptr() != self._master.data_ptr():  # the master may serve as the chunk
                slot.copy_(self._master)
        elif kind is SourceKind.DEVICE_COPY:
            source = self._refreshed_device_copy()
            if source.data_ptr() != slot.data_ptr():
                slot.copy_(source)
        elif kind is SourceKind.DISK:
            self._copy_from_disk(slot)
        else:
            self._transfers.copy(slot, self._host_compute(), Direction.TO_DEVICE)

    def _copy_from_disk(self, slot: torch.Tensor) -> None:
        """A parameter shard on disk: its 16-bit copy read from disk (or kept in memory after a
        failed write); with fp32 compute the master, from memory while it is there (a failed
        write), else from its region of the disk file."""
        if self._param_disk is not None:
            self._param_disk.copy_into(slot)
        elif self._master_resident:
            self._transfers.copy(slot, self._master, Direction.TO_DEVICE)
        else:
            assert self._disk is not None, f"{self._label}: a parameter shard on disk has a disk file"
            file, offset, in_place = self._disk, self._disk_offset, self._in_place
            read = (
                (lambda staged: in_place.read_for_gather(file, staged))
                if in_place is not None
                else (lambda staged: file.read(staged, offset, param=True))
            )
            read_for_gather(read, slot, self._transfers, self._ledger, self._host_device, self._failures, self._label)

    def _host_compute(self) -> torch.Tensor:
        if self._host_cast is None:
            return self._master
        if self._host_cast_version != self._version:
            if not self._master_resident:
                raise RuntimeError(
                    f"{self._label}: its master is on disk and its 16-bit copy is stale; the copy is made when the "
                    "master changes, while it is in memory (recast)"
                )
            self._transfers.before_host_write(self._host_cast)
            self._host_cast.copy_(self._master)
            self._host_cast_version = self._version
        return self._host_cast

    # --- the master on disk ---------------------------------------------------------------------
    @property
    def master_on_disk(self) -> bool:
        """The master lives on disk between optimizer steps (see ``fetch_master``)."""
        return self._disk is not None

    def master_slice(self, start: int, stop: int) -> torch.Tensor:
        """A view of ``master[start:stop]``, made even while the master is on disk (its storage
        then grows for the moment the view is made, with no values; the view reads the values
        once the master is in memory again)."""
        if self._master_resident:
            return self._master[start:stop]
        storage = self._master.untyped_storage()
        storage.resize_(self._master_bytes)  # address space only: nothing is written
        try:
            return self._master[start:stop]
        finally:
            storage.resize_(0)

    @property
    def reads_in_place(self) -> bool:
        """Its values are read in place from the user's weights files (``InPlaceShard``)."""
        return self._in_place is not None

    def holds_in_place(self, pieces: list[tuple[ShardPiece, torch.Tensor]]) -> bool:
        """Whether the weights files this shard is read in place from hold ``pieces``' values
        (``True`` for a shard not read in place)."""
        if self._in_place is None:
            return True
        current = self._in_place.values(self._disk, self._numel, self._values_dtype)
        return all(torch.equal(current[piece.shard], values.to(current.dtype)) for piece, values in pieces)

    def readable_master(self) -> torch.Tensor:
        """The master's values to read without changing them: the master in memory, or, while it
        is on disk, a view mapped from its region of the disk file (read from the weights files
        into memory when read in place)."""
        if self._master_resident or self._disk is None:
            return self._master
        if self._in_place is not None:
            return self._in_place.values(self._disk, self._numel, self._values_dtype)
        return self._disk.view(self._disk_offset, self._numel, self._values_dtype)

    def staging_for_master(self, numel: int) -> torch.Tensor:
        """Where a load stages ``numel`` master values before installing them: memory, or for a
        master on disk a file of the disk tier's scratch directory."""
        if self._disk is None:
            return torch.empty(numel, dtype=self._values_dtype)
        return self._disk.staging(numel, self._values_dtype)

    def move_master_to_disk(self) -> None:
        """Move the master to its disk region, once, after it got its values (boost): its 16-bit
        copy is made first (gathers read that) and its memory is freed."""
        file = self._disk
        if file is None or self._disk_offset >= 0 or not self._master_resident:
            raise RuntimeError(f"{self._label}: move_master_to_disk is for a master bound for disk, once")
        if self._in_place is not None:  # its values stay in the weights files: nothing to write
            self._drop_master_memory()
            return
        self._host_compute()
        written = self.write_param(changed=True)
        self.settle_param()  # accounted as written, or kept in memory
        if written is not None:
            written.result()  # a write that failed at boost raises
        self._disk_offset = file.region(self._master_bytes)
        file.write(self._master, self._disk_offset, param=self._master_is_param).result()
        self._drop_master_memory()
        self._ledger.alloc(Location.DISK, self._values_kind, self._master_bytes)

    def _drop_master_memory(self) -> None:
        self._master.untyped_storage().resize_(0)
        self._master_resident = False
        self._ledger.free(Location.HOST, self._values_kind, self._master_bytes)

    def fetch_master(self) -> Future[None] | None:
        """Start reading the master from disk into memory (``None``: it is in memory)."""
        if self._master_resident:
            return None
        file = self._disk
        assert file is not None, f"{self._label}: a master off memory lives on disk"
        self._master.untyped_storage().resize_(self._master_bytes)
        self._master_resident = True
        self._ledger.alloc(Location.HOST, MemoryKind.STAGING, self._master_bytes)
        if self._in_place is not None:  # a checkpoint's gather: the ranks agree a failure after it
            return self._in_place.read_for_gather(file, self._master)
        return file.read(self._master, self._disk_offset)

    @property
    def _master_is_param(self) -> bool:
        """fp32 compute with the parameter shard on disk: the master on disk is what gathers read."""
        return self._shard_location is Location.DISK and self._param_disk is None

    def write_param(self, changed: bool) -> Future[None] | None:
        """With its 16-bit parameter shard on disk: when the master (in memory now) ``changed``,
        write its cast to disk (before the master leaves memory; a master on disk has not changed, as
        in ``evict_master``). Returns the write (``None``: none); one that fails keeps the cast in
        memory by itself (``ParamOnDisk``)."""
        if self._param_disk is None or not changed or not self._master_resident:
            return None
        return self._param_disk.write(self._master)

    def settle_param(self) -> None:
        """Wait for the write of the 16-bit parameter shard in flight and account for it
        (``ParamOnDisk.settle``); nothing to do without one on disk."""
        if self._param_disk is not None:
            self._param_disk.settle()

    def evict_master(self, changed: bool) -> Future[None] | None:
        """Free the master's memory, writing it back first when ``changed`` (its 16-bit copy is
        made from it before; one on disk is written by ``write_param``, called first). Returns the
        write to wait for (``None``: none); if it fails, call ``master_write_failed``: the values
        are still in memory."""
        file = self._disk
        if file is None or not self._master_resident:
            return None
        if changed:
            self._version += 1  # what mark_updated does: the copies are stale
            self._host_compute()
        self._master_resident = False
        self._ledger.free(Location.HOST, MemoryKind.STAGING, self._master_bytes)
        storage = self._master.untyped_storage()
        if not changed or self._in_place is not None:  # read in place: a load gave it the files' values
            storage.resize_(0)
            return None
        return file.write(self._master, self._disk_offset, then=lambda: storage.resize_(0), param=self._master_is_param)

    def master_write_failed(self) -> None:
        """The write ``evict_master`` started failed: the master kept its memory and values."""
        self._master_resident = True
        self._ledger.alloc(Location.HOST, MemoryKind.STAGING, self._master_bytes)

    @contextmanager
    def resident_master(self, write_back: bool = False) -> Iterator[torch.Tensor]:
        """The master in memory for the block (a checkpoint reading or loading it); written back
        after it with ``write_back``."""
        fetched = self.fetch_master()
        if fetched is None:
            yield self._master
            return
        fetched.result()
        try:
            yield self._master
        finally:
            param = self.write_param(changed=write_back)
            written = self.evict_master(changed=write_back)
            self.settle_param()
            failure = written.exception() if written is not None else None
            if failure is not None:
                self.master_write_failed()
                raise failure
            failure = param.exception() if param is not None else None
            if failure is not None:
                raise failure

    def _alloc_device_copy(self) -> torch.Tensor:
        self._ledger.alloc(Location.DEVICE, MemoryKind.SHARD_COPY, self._copy_bytes)
        self._device_copy = torch.empty(self._numel, dtype=self._compute_dtype, device=self._device)
        self._device_copy_version = -1
        return self._device_copy

    def _refreshed_device_copy(self) -> torch.Tensor:
        if self._device_copy is None:
            self._alloc_device_copy()
        assert self._device_copy is not None, f"{self._label}: device copy missing after allocation"
        if self._device_copy_version != self._version:
            self._transfers.copy(self._device_copy, self._host_compute(), Direction.TO_DEVICE)
            self._device_copy_version = self._version
        return self._device_copy
