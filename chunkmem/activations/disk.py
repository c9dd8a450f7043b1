"""``ActivationDisk``: the offloaded activations that do not fit ``ActivationPlacement.host_budget``
(``placement.HostRoom`` decides which), written to the disk tier in the forward and read back before
the block's backward.

* **Where**: files in a scratch directory of the disk tier under ``ChunkPlugin(disk_dir=...)``
  (``chunkmem.tiers.disk``: the same owned directory, removed when the run ends, and the same I/O
  threads). The directory and its first file are made at the first storage that goes to disk; a
  file is preallocated, and another one (as large as those before, at least 1 MiB) is added when a
  forward needs more, so the disk can only fill up while a forward writes more than any before.
  Regions are cut one after the other and freed in any order; the space of the last ones is reused
  (forward order in, backward order out: a stack).
* **Through a staging window**: two pinned host pieces (``HostRoom.piece`` bytes each). A storage is
  copied to the window piece by piece (on the copy stream; the host waits for the piece) and each
  piece is written on an I/O thread while the next one is copied; read back the same way, each
  piece then copied to its place in the device copy on the fetch stream. The window is held, and
  accounted in the ledger (host, ``MemoryKind.ACTIVATION``, as the host copies), from the first
  piece until no region is left.
* **Checked**: the CRC-32 of each piece is taken on the I/O thread once its write is done, and
  the piece read back is checked against it before it is copied to the device: a file changed
  under the run (truncated, overwritten) is an error, never other values in the backward.
* **Failures**: a file that cannot be made or reserved (a full disk), or a write that failed, is
  raised at the end of the block call on every rank (``settle``: the ranks agree, one small
  collective per offloaded call), naming the directory and the fixes. A read that fails in the
  backward, or reads other bytes than were written, leaves zeros in the device copy and is noted
  (``ranks.local_failures``): the ranks agree on it in the all-reduce that ends the synchronised
  backward, and every rank raises the same ``DiskTierError`` (at one rank it raises at once).
"""

from __future__ import annotations

import os
import weakref
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chunkmem.placement import HostRoom

from ..errors import DiskTierError
from ..ranks.agreement import agree
from ..ranks.comm import Communicator
from ..ranks.local_failures import Lasts, LocalFailures
from ..tiers.disk import DISK_BLOCK, DiskFile, ScratchDir
from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from ..usage.stats import Stats

__all__ = ["ActivationDisk", "DiskCopy", "check_disk_dir"]

_HOST = torch.device("cpu")
_MIN_FILE = 2**20


def check_disk_dir(disk_dir: str | None, rank: int) -> str:
    """The directory the activations beyond ``host_budget`` go to, refused when it is not given,
    missing, or not writable (at boost: nothing is created there until a storage goes to disk)."""
    if disk_dir is None:
        raise DiskTierError(
            "ActivationPlacement(host_budget=...) writes the offloaded activations beyond it to the disk tier, but "
            "ChunkPlugin has no disk_dir: pass ChunkPlugin(disk_dir=...) (a fast local disk), or drop host_budget"
        )
    path = Path(disk_dir)
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise DiskTierError(
            f"rank {rank}: disk_dir {path} (where activations beyond ActivationPlacement.host_budget go) is not a "
            "writable directory; create it or pass another disk_dir"
        )
    return disk_dir


@dataclass(eq=False)
class _Region:
    file: int  # index of its file
    offset: int
    size: int  # rounded up to a block
    live: bool = True


@dataclass(eq=False)
class DiskCopy:
    """One storage's bytes in the disk tier: its region, and its writes still in flight."""

    nbytes: int
    region: _Region
    writes: list[Future[None]] = field(default_factory=list)
    sums: list[int] = field(default_factory=list)  # each piece's CRC-32, once its write is done
    free: weakref.finalize | None = None  # gives the region back (once; also when collected)


class ActivationDisk:
    """The disk side of one model's offloaded activations; see the module docstring."""

    def __init__(
        self,
        room: HostRoom,
        disk_dir: str,
        comm: Communicator,
        ledger: MemoryLedger,
        transfers: HostTransfers,
        failures: LocalFailures,
    ) -> None:
        self.room = room
        self._disk_dir = disk_dir
        self._comm = comm
        self._failures = failures
        self._ledger = ledger
        self._transfers = transfers
        self.stats = Stats()
        """The disk traffic (``disk_write_bytes`` / ``disk_read_bytes``), apart from the chunks'."""
        self._scratch: ScratchDir | None = None
        self._files: list[DiskFile] = []
        self._regions: list[_Region] = []  # in the order cut; the dead ones at the end are popped
        self._window: list[torch.Tensor] = []  # the two staging pieces (fp32 from the pool), while held
        self._busy: list[Future[None] | None] = [None, None]  # a write still reading each piece
        self._next = 0  # the piece used next

    # --- host memory --------------------------------------------------------------------------
    def take_host(self, nbytes: int) -> bool:
        """Whether a storage of ``nbytes`` is copied to host memory (accounted until ``give_host``)."""
        if not self.room.take(nbytes):
            return False
        self._ledger.alloc(Location.HOST, MemoryKind.ACTIVATION, nbytes)
        return True

    def give_host(self, nbytes: int) -> None:
        self.room.give(nbytes)
        self._ledger.free(Location.HOST, MemoryKind.ACTIVATION, nbytes)

    # --- forward ------------------------------------------------------------------------------
    def write(self, source: torch.Tensor, block: str) -> DiskCopy:
        """Write ``source`` (a storage's bytes, flat ``uint8`` on the compute device) to a new
        region, through the window; the writes may still run when this returns."""
        nbytes = source.numel()
        region = self._cut(nbytes, block)
        copy = DiskCopy(nbytes, region)
        copy.free = weakref.finalize(copy, self._free, region, nbytes)
        file = self._files[region.file]
        for index, start in enumerate(range(0, nbytes, self.room.piece)):
            size = min(self.room.piece, nbytes - start)
            # No wait for the copies to the device that read the piece before: they ran on the fetch
            # stream, which the compute stream (and so the copy stream) waited for at their unpack.
            which, stage = self._piece()
            self._transfers.copy(stage[:size], source[start : start + size], Direction.TO_HOST)
            self._transfers.before_host_read(stage)
            copy.sums.append(0)
            piece = stage[:size]
            # On the I/O thread after the write, while the piece is still the window's (``_piece``
            # waits for this write before handing it out again).
            write = file.write(piece, region.offset + start, then=lambda i=index, p=piece: _sum_into(copy, i, p))
            self._busy[which] = write
            copy.writes.append(write)
        return copy

    def settle(self, copies: list[DiskCopy], block: str, failure: BaseException | None) -> None:
        """A call of ``block`` ended: its writes are waited for, and the ranks agree that every
        one worked (and that ``failure``, an error of this rank's earlier in the call, is none)."""

        def written() -> None:
            if failure is not None:
                raise failure
            for copy in copies:
                writes, copy.writes = copy.writes, []
                for write in writes:
                    write.result()

        agree(
            self._comm,
            f"writing the saved activations of block {block} to the disk tier",
            written,
            DiskTierError,
            f"in {self._disk_dir}",
        )

    # --- backward -----------------------------------------------------------------------------
    def read(self, copy: DiskCopy, target: torch.Tensor, block: str) -> None:
        """Read ``copy`` (saved by ``block``) back into ``target`` (flat ``uint8`` on the compute
        device), through the window, each piece checked against its checksum; the copies to the
        device are queued on the current stream; the region is freed. A read that fails leaves
        zeros in ``target`` and is noted for the ranks to agree on (module docstring)."""
        for write in copy.writes:  # settled at the call's end; a call whose forward raised is not
            write.result()
        file = self._files[copy.region.file]
        try:
            for index, start in enumerate(range(0, copy.nbytes, self.room.piece)):
                size = min(self.room.piece, copy.nbytes - start)
                _, stage = self._piece()
                self._transfers.before_host_write(stage)  # the copy to the device that read it is done
                offset = copy.region.offset + start
                file.read(stage[:size], offset).result()
                read = _crc32(stage[:size])
                if read != copy.sums[index]:
                    raise DiskTierError(
                        f"the {size} bytes at offset {offset} of {file.path} differ from those written there (CRC-32 "
                        f"{read:#010x}, written {copy.sums[index]:#010x}): the file was changed while the run used it"
                    )
                self._transfers.copy(target[start : start + size], stage[:size], Direction.TO_DEVICE)
        except DiskTierError as error:
            target.zero_()  # after the copies queued before, on the same stream
            self._failures.note(
                "reading back saved activations from the disk tier",
                DiskTierError(
                    f"rank {self._comm.rank}: cannot read back the saved activations of block {block} "
                    f"({copy.nbytes} bytes) for its backward: {error}. This backward's gradients are lost: leave the "
                    f".chunkmem-scratch-* directories in {self._disk_dir} alone while a job runs (give every job its "
                    "own files there), then call zero_grad() and go on, or resume from the last checkpoint"
                ),
                Lasts.ITERATION,
            )
        finally:
            assert copy.free is not None, "a written copy frees its region"
            copy.free()

    # --- regions and the window ---------------------------------------------------------------
    @property
    def _window_bytes(self) -> int:
        """What the two staging pieces hold: the staging pool's (pinned) blocks."""
        return 2 * self._transfers.layer.host_held_bytes(self.room.piece)

    def _piece(self) -> tuple[int, torch.Tensor]:
        """The next staging piece, once the write to disk reading it is done."""
        if not self._window:
            piece = self.room.piece
            # fp32 buffers, handed out as bytes: the pool poisons what it gets back (on the
            # simulated device), so a copy still reading a piece given back shows.
            self._window = [self._transfers.staging(piece // 4, torch.float32, _HOST) for _ in range(2)]
            self._ledger.alloc(Location.HOST, MemoryKind.ACTIVATION, self._window_bytes)
        which = self._next
        self._next ^= 1
        busy, self._busy[which] = self._busy[which], None
        if busy is not None:
            busy.exception()  # waits; a failure is raised by the call's ``settle``
        return which, self._window[which].view(torch.uint8)

    def _cut(self, nbytes: int, block: str) -> _Region:
        size = -(-max(nbytes, 1) // DISK_BLOCK) * DISK_BLOCK
        last = self._regions[-1] if self._regions else None
        index, offset = (last.file, last.offset + last.size) if last is not None else (0, 0)
        while index < len(self._files) and offset + size > self._files[index].size:
            index, offset = index + 1, 0
        if index == len(self._files):
            self._add_file(max(size, _MIN_FILE, sum(f.size for f in self._files)), block)
        region = _Region(index, offset, size)
        self._regions.append(region)
        self._ledger.alloc(Location.DISK, MemoryKind.ACTIVATION, nbytes)
        return region

    def _add_file(self, size: int, block: str) -> None:
        try:
            if self._scratch is None:
                self._scratch = ScratchDir(self._disk_dir, self._comm.rank)
            self._files.append(DiskFile(self._scratch, f"activations-{len(self._files)}.bin", size, self.stats))
        except DiskTierError as error:
            raise DiskTierError(
                f"rank {self._comm.rank}: cannot write the saved activations of block {block} beyond "
                f"ActivationPlacement.host_budget ({int(self.room.budget)} bytes) to the disk tier in "
                f"{self._disk_dir}: "
                f"{error}. Free space in {self._disk_dir}, pass another ChunkPlugin(disk_dir=...), raise host_budget, "
                "or recompute those blocks (ActivationPlacement(recompute=[...]))"
            ) from error

    def _free(self, region: _Region, nbytes: int) -> None:
        region.live = False
        self._ledger.free(Location.DISK, MemoryKind.ACTIVATION, nbytes)
        while self._regions and not self._regions[-1].live:
            self._regions.pop()
        if not self._regions and self._window:  # nothing on disk: the window goes back
            for which, stage in enumerate(self._window):
                busy, self._busy[which] = self._busy[which], None
                if busy is not None:
                    busy.exception()
                self._transfers.before_host_write(stage)
                self._transfers.give_back(stage)
            self._window = []
            self._ledger.free(Location.HOST, MemoryKind.ACTIVATION, self._window_bytes)


def _crc32(piece: torch.Tensor) -> int:
    """The CRC-32 of a piece of the window (``zlib`` lets go of the GIL for it)."""
    return zlib.crc32(piece.numpy())


def _sum_into(copy: DiskCopy, index: int, piece: torch.Tensor) -> None:
    copy.sums[index] = _crc32(piece)
