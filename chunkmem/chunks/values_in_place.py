"""A frozen chunk's values read in place from the user's safetensors files (issue 32 item 2).

A chunk that holds only its values in the compute dtype (``ShardKind.FROZEN_VALUES``), placed with
its parameter shard on disk, whose every piece in this rank's shard lies in a weights file in that
dtype as it is, is not copied into the disk tier's file at boost: each gather reads every piece
straight from the user's file into the staging buffer, at the piece's place in the shard (one
``os.preadv`` a piece, the padding zeroed), on the disk tier's I/O threads, counted as the disk
tier's parameter reads. :func:`choose_in_place` makes that choice, once per chunk at boost; the
rest (another dtype in the file, a trained chunk, a parameter replayed from its init) is copied.

The files are opened read-only at boost and held open for the run, so a file replaced by a new
one (renamed over it) is still read as it was at boost. One changed where it is (its size or
modification time differ from those at boost, checked before and after every read) is refused:
``DiskTierError`` names it and the fix, rather than training on other weights. So is one
overwritten in place with its size and modification time kept, where the change covers a page
that each read checks against what it held at boost (``sampled_check``: a few pages a piece).

With several ranks, each may read files of its own (a copy on each node's disk), so a read can
fail on one rank only. A gather's read that fails there does not raise at once (the other ranks
would wait in the gather's all-gather until the process-group timeout): the rank takes part with
zeros and notes the error (``ranks.local_failures``), and the ranks agree on it at the next point
where they already exchange something before values are used to change anything: the all-reduce
that ends every synchronised backward (``execution.backward_agreement``), and after a forward
that returned, for models reading in place (``agree_reads``). Every rank then raises the same
``DiskTierError``, before any optimizer step; no collective is added to the gathers.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import DiskTierError
from ..ranks.local_failures import Lasts, LocalFailures
from .chunk_layout import ChunkLayout
from .param_values import ParamValues
from .sampled_check import ContentSample

if TYPE_CHECKING:
    from ..tiers.disk import SidesFile

__all__ = ["Extent", "InPlaceShard", "WeightFiles", "choose_in_place"]


@dataclass(frozen=True, slots=True)
class Extent:
    """One piece of a shard in a weights file: ``nbytes`` at ``file_offset`` there, at
    ``shard_offset`` bytes into the shard."""

    path: Path
    file_offset: int
    shard_offset: int
    nbytes: int
    sample: ContentSample | None = None
    """Its sampled pages and what they held at boost (taken once the file is opened)."""


def _close_all(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)


class WeightFiles:
    """The weights files some chunk reads in place, opened read-only once, with their size and
    modification time then; see the module docstring."""

    def __init__(self, rank: int, failures: LocalFailures) -> None:
        self._rank = rank
        self._failures = failures
        self._fds: dict[Path, int] = {}
        self._seen: dict[Path, tuple[int, int]] = {}
        self._rng = random.Random(os.urandom(8))  # where the sampled pages lie: not known before boost
        weakref.finalize(self, _close_all, self._fds)

    def open(self, path: Path) -> None:
        """Open ``path`` (once) and note its size and modification time."""
        if path in self._fds:
            return
        fd = os.open(path, os.O_RDONLY)
        self._fds[path] = fd
        info = os.fstat(fd)
        self._seen[path] = (info.st_size, info.st_mtime_ns)

    def sampled(self, extent: Extent) -> Extent:
        """``extent`` (of a file opened) with the pages each read checks, as they are now."""
        try:
            sample = ContentSample.take(self._fds[extent.path], extent.file_offset, extent.nbytes, self._rng)
        except OSError as error:
            raise DiskTierError(
                f"rank {self._rank}: cannot read the weights file {extent.path} at offset {extent.file_offset} "
                f"({error}): is it complete? Boost from a complete checkpoint"
            ) from error
        return dataclasses.replace(extent, sample=sample)

    def note(self, error: DiskTierError) -> None:
        """A gather's read failed: raise it now (one rank), or keep it for the agreement (module
        docstring); it holds for the run (the files stay as they are)."""
        self._failures.note("reading the frozen weights in place", error, Lasts.RUN)

    def fd(self, path: Path, label: str) -> int:
        """The descriptor of ``path``, refused when the file changed since boost (``label``: the
        chunk reading it)."""
        fd = self._fds[path]
        info = os.fstat(fd)
        size, mtime = self._seen[path]
        if (info.st_size, info.st_mtime_ns) != (size, mtime):
            raise DiskTierError(
                f"rank {self._rank}: {label} reads its frozen values in place from the weights file {path}, which "
                f"changed after boost (size {size} -> {info.st_size} bytes, modification time {mtime} -> "
                f"{info.st_mtime_ns} ns): training on would use other weights than the model was boosted with. "
                "Put the file back as it was (leave weights= files alone while a run reads them; write new ones "
                "elsewhere) and resume from the last checkpoint, or boost again with the new weights"
            )
        return fd


class InPlaceShard:
    """Where each piece of one chunk's shard lies in the weights files (``label`` names the chunk)."""

    def __init__(self, label: str, extents: list[Extent], files: WeightFiles) -> None:
        self._label = label
        self._extents = extents
        self._files = files

    @property
    def nbytes(self) -> int:
        """Bytes a read takes from the files: the pieces, not the padding."""
        return sum(e.nbytes for e in self._extents)

    def read(self, disk: SidesFile | None, tensor: torch.Tensor) -> Future[None]:
        """Fill ``tensor`` (the shard, contiguous on the CPU) on the I/O threads of ``disk``, the
        disk tier's file (a plan, whose file reads nothing, reads nothing in place)."""
        return self._submit(disk, tensor, self._fill)

    def read_for_gather(self, disk: SidesFile | None, tensor: torch.Tensor) -> Future[None]:
        """``read`` for a gather: with several ranks a failure leaves zeros and is noted for the
        ranks to agree on (module docstring) instead of raising on this rank alone."""

        def fill(view: memoryview) -> int:
            try:
                return self._fill(view)
            except DiskTierError as error:
                self._files.note(error)
                view[:] = bytes(len(view))  # what the others gather from this rank: no stale values
                return 0

        return self._submit(disk, tensor, fill)

    def _submit(self, disk: SidesFile | None, tensor: torch.Tensor, fill: Callable[[memoryview], int]) -> Future[None]:
        from ..tiers.disk import DiskFile

        assert isinstance(disk, DiskFile), f"{self._label}: a shard read in place has the disk tier's file"
        return disk.read_with(tensor, fill)

    def values(self, disk: SidesFile | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The shard's ``numel`` values, read now into a new tensor (a checkpoint reads them)."""
        values = torch.empty(numel, dtype=dtype)
        self.read(disk, values).result()
        return values

    def _fill(self, view: memoryview) -> int:
        end = 0
        for extent in self._extents:  # in shard order
            view[end : extent.shard_offset] = bytes(extent.shard_offset - end)  # padding between pieces
            self._read(extent, view[extent.shard_offset : extent.shard_offset + extent.nbytes])
            end = extent.shard_offset + extent.nbytes
        view[end:] = bytes(len(view) - end)
        for path in {e.path for e in self._extents}:  # a change during the reads
            self._files.fd(path, self._label)
        return self.nbytes

    def _read(self, extent: Extent, target: memoryview) -> None:
        fd = self._files.fd(extent.path, self._label)
        done = 0
        try:
            while done < extent.nbytes:
                moved = os.preadv(fd, [target[done:]], extent.file_offset + done)
                if moved <= 0:
                    raise OSError(errno.EIO, f"the file ends at byte {extent.file_offset + done}")
                done += moved
        except OSError as error:
            raise DiskTierError(
                f"{self._label}: could not read {extent.nbytes} bytes at offset {extent.file_offset} of the weights "
                f"file {extent.path} it reads in place ({error.strerror or error}); leave weights= files as they "
                "were at boost while a run reads them"
            ) from error
        sample = extent.sample
        if sample is not None and sample.of(target) != sample.crc:
            raise DiskTierError(
                f"{self._label}: the weights file {extent.path} it reads in place holds other bytes at offset "
                f"{extent.file_offset} ({extent.nbytes} bytes) than at boost (a CRC-32 of pages sampled at boost), "
                "though its size and modification time are those of boost: it was overwritten in place, and training "
                "on would use other weights than the model was boosted with. Put the file back as it was (leave "
                "weights= files alone while a run reads them; write new ones elsewhere) and resume from the last "
                "checkpoint, or boost again with the new weights"
            )


def choose_in_place(
    label: str, layout: ChunkLayout, param_on_disk: bool, values: ParamValues, files: WeightFiles
) -> InPlaceShard | None:
    """Whether this rank reads the chunk's shard in place (module docstring): only a frozen chunk of
    values alone whose parameter shard the placement puts on disk, every piece of it found as it is
    in a weights file. The files are opened here."""
    if not layout.shard_kind.values_only or not param_on_disk:
        return None
    itemsize = layout.compute_dtype.itemsize
    extents = []
    for info in layout.tensors:
        piece = layout.piece(info)
        if piece is None or piece.numel == 0:
            continue
        found = values.location(info, piece)
        if found is None:
            return None
        path, offset = found
        extents.append(Extent(path, offset, piece.shard.start * itemsize, piece.numel * itemsize))
    if not extents:  # padding only on this rank: nothing is read from a file, so it is copied as any other
        return None
    for extent in extents:
        files.open(extent.path)
    sampled = [files.sampled(extent) for extent in extents]
    return InPlaceShard(label, sorted(sampled, key=lambda e: e.shard_offset), files)
