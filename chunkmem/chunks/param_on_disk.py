"""``ParamOnDisk``: a chunk's 16-bit parameter shard (what gathers read) kept on disk, not in host
memory (``offload_param_disk_frac``, or the auto policy under a host budget).

A gather reads the shard from its region of the disk file into a staging buffer (pinned where the
device pins), copies it to the device and gives the buffer back: nothing stays in host memory
between uses. The shard is written when its master changed (the boost, an optimizer step, a
load), cast from the master into a staging buffer that goes back to the pool once written (the
ledger counts it as host staging from the cast until ``settle`` has seen the write finish); a
frozen chunk's is written once, at boost. A write that fails (a full disk) keeps the cast in
memory (``KEPT``, found by ``settle``): gathers read it there, and the next change writes it
again.

With fp32 compute the master is what gathers read, so the master itself lives on disk
(``ShardStore`` moves it) and gathers read its region with :func:`read_for_gather`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..errors import DiskTierError
from ..ranks.local_failures import Lasts, LocalFailures
from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from .state_machine import StateMachine, Transition

if TYPE_CHECKING:
    from ..tiers.disk import SidesFile

__all__ = ["ParamOnDisk", "ParamOnDiskState", "read_for_gather"]


class ParamOnDiskState(enum.Enum):
    """Where the current values of a parameter shard bound for disk are."""

    UNWRITTEN = "unwritten"
    """No values yet (before the boost writes them)."""
    ON_DISK = "on_disk"
    """On disk (a write may still be in flight: reads wait for it); nothing in host memory."""
    KEPT = "kept"
    """The last write failed: the values are in a host buffer, written again at the next change."""


_S = ParamOnDiskState
_TABLE: dict[str, Transition[ParamOnDiskState]] = {
    "write": Transition(
        {_S.UNWRITTEN: _S.ON_DISK, _S.ON_DISK: _S.ON_DISK, _S.KEPT: _S.ON_DISK}, "Any values may be written."
    ),
    "keep after a failed write": Transition({_S.ON_DISK: _S.KEPT}, "Only a write that was started can fail."),
    "copy for a gather": Transition(
        {_S.ON_DISK: _S.ON_DISK, _S.KEPT: _S.KEPT}, "The boost writes the values before the first gather."
    ),
}


def read_for_gather(
    read: Callable[[torch.Tensor], Future[None]],
    slot: torch.Tensor,
    transfers: HostTransfers,
    ledger: MemoryLedger,
    host_device: torch.device,
    failures: LocalFailures | None = None,
    label: str = "",
) -> None:
    """Read ``slot.numel()`` values of ``slot``'s dtype into a staging buffer (``read`` fills it:
    from a region of the disk tier's file, or in place from weights files) and copy them into
    ``slot`` (on the device). The buffer goes back to the pool once the
    copy has read it (so the pool hands out no buffer a copy still reads); it is accounted as host
    staging meanwhile. Where the device computes on the host, ``slot`` is host memory: ``read``
    fills it directly (a copy of every shard read less: as much memory traffic as the op's own
    matmul with a few tokens). A failed read raises ``DiskTierError`` (naming the file), or with
    ``failures`` (several ranks) leaves zeros and is noted there for the ranks to agree on
    (``ranks.local_failures``: the other ranks would wait in the gather's collective); ``label``
    names the chunk."""
    if transfers.layer.computes_on_host:
        _read_or_note(read, slot, failures, label)
        return
    staged = transfers.staging(slot.numel(), slot.dtype, host_device)
    nbytes = transfers.layer.host_held_bytes(staged.numel() * staged.element_size())
    ledger.alloc(Location.HOST, MemoryKind.STAGING, nbytes)
    try:
        _read_or_note(read, staged, failures, label)
        transfers.copy(slot, staged, Direction.TO_DEVICE)
        transfers.before_host_write(staged)  # the pool's next user writes it
    finally:
        transfers.give_back(staged)
        ledger.free(Location.HOST, MemoryKind.STAGING, nbytes)


def _read_or_note(
    read: Callable[[torch.Tensor], Future[None]], into: torch.Tensor, failures: LocalFailures | None, label: str
) -> None:
    try:
        read(into).result()
    except DiskTierError as error:
        if failures is None:
            raise
        into.zero_()  # what the others gather from this rank: no stale values
        failures.note(
            "reading a parameter shard from the disk tier",
            DiskTierError(
                f"{label}: {error}. The disk tier's files are this run's scratch: leave the .chunkmem-scratch-* "
                "directories of a running job alone; resume from the last checkpoint"
            ),
            Lasts.ITERATION,
        )


class ParamOnDisk:
    """See the module docstring. ``label`` names the chunk in messages."""

    def __init__(
        self,
        label: str,
        numel: int,
        dtype: torch.dtype,
        file: SidesFile,
        ledger: MemoryLedger,
        transfers: HostTransfers,
        host_device: torch.device,
        failures: LocalFailures | None = None,
    ) -> None:
        self._label = label
        self._failures = failures
        self._numel = numel
        self._dtype = dtype
        self._file = file
        self._ledger = ledger
        self._transfers = transfers
        self._host_device = host_device
        self._offset = file.region(self.nbytes)
        self._machine = StateMachine(ParamOnDiskState.UNWRITTEN, _TABLE, lambda: label)
        self._writes: list[tuple[Future[None], torch.Tensor]] = []  # in flight, with their sources
        self._kept: torch.Tensor | None = None  # the values of a write that failed
        ledger.alloc(Location.DISK, MemoryKind.SHARD_COPY, self.nbytes)

    @property
    def nbytes(self) -> int:
        return self._numel * self._dtype.itemsize

    @property
    def _host_bytes(self) -> int:
        """What its (pinned) host buffer holds: the staging pool's block."""
        return self._transfers.layer.host_held_bytes(self.nbytes)

    @property
    def state(self) -> ParamOnDiskState:
        """As of the last ``settle`` (a write in flight that will fail still reads ``ON_DISK``)."""
        return self._machine.state

    def write(self, master: torch.Tensor) -> Future[None]:
        """Cast ``master`` (its values in memory now) and write the cast to disk; returns the write
        (a failure keeps the cast in memory, see the module docstring)."""
        self.settle()
        self._machine.require("write")
        transfers, ledger = self._transfers, self._ledger
        cast = transfers.staging(self._numel, self._dtype, self._host_device)  # no copy reads it
        ledger.alloc(Location.HOST, MemoryKind.STAGING, self._host_bytes)
        try:
            cast.copy_(master)
            write = self._file.write(cast, self._offset, param=True)
        except BaseException:
            transfers.give_back(cast)
            ledger.free(Location.HOST, MemoryKind.STAGING, self._host_bytes)
            raise  # the kept values (or those on disk) are still the shard's: gathers read them
        if self._kept is not None:  # superseded by the write now queued
            transfers.before_host_write(self._kept)  # a gather's copy may still read it
            transfers.give_back(self._kept)
            self._ledger.free(Location.HOST, MemoryKind.SHARD_COPY, self._host_bytes)
            self._kept = None

        def written(future: Future[None]) -> None:  # on the I/O thread, or here if already done
            if future.exception() is None:
                transfers.give_back(cast)  # a failed write keeps it: its values are the parameters

        write.add_done_callback(written)
        self._writes.append((write, cast))
        self._machine.move("write")
        return write

    def settle(self) -> None:
        """Wait for the write in flight, if any (``write`` settles the one before, so there is at
        most one), and account for it: written, its staging buffer is back in the pool; failed,
        it keeps the values in memory (``KEPT``). On the owner's thread, as the ledger is."""
        writes, self._writes = self._writes, []
        for future, source in writes:
            failed = future.exception() is not None
            self._ledger.free(Location.HOST, MemoryKind.STAGING, self._host_bytes)
            if failed:
                assert self._kept is None, "a write settles the one before it, whose kept values it supersedes"
                self._kept = source
                self._ledger.alloc(Location.HOST, MemoryKind.SHARD_COPY, self._host_bytes)
                self._machine.move("keep after a failed write")

    def copy_into(self, slot: torch.Tensor) -> None:
        """This shard's values into ``slot`` (on the device): read from disk through a staging
        buffer, or copied from memory after a failed write."""
        self.settle()
        self._machine.require("copy for a gather")
        if self._kept is not None:
            self._transfers.copy(slot, self._kept, Direction.TO_DEVICE)
            return
        file, offset = self._file, self._offset
        read_for_gather(
            lambda staged: file.read(staged, offset, param=True),
            slot,
            self._transfers,
            self._ledger,
            self._host_device,
            self._failures,
            self._label,
        )
