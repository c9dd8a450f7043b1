"""``GradOnDisk``: a chunk's reduced gradient shard, kept on disk from its reduction to the optimizer
step (the disk tier keeps no fp32 gradient in host memory).

When the reduction is done the shard is copied to a host staging buffer (pinned on CUDA) and written
from there to the chunk's region of the disk file, and the few numbers the
step's global checks need are taken from it while it is in memory: its 2-norm and largest
magnitude (``clip_grad_norm``) and whether it is finite (fp16 inf/nan). What those checks then do
to the gradient, multiply it (clipping, unscaling), is recorded as a factor applied when the step
reads the shard back (``fetch``), so no gradient is read or rewritten on disk outside the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..errors import DiskTierError
from ..ranks.local_failures import Lasts, LocalFailures
from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from .grad_norm import flat_norm

if TYPE_CHECKING:
    from ..tiers.disk import SidesFile

__all__ = ["GradOnDisk"]

_FP32 = torch.float32


class GradOnDisk:
    """See the module docstring. ``label`` names the chunk in messages."""

    def __init__(
        self,
        label: str,
        numel: int,
        file: SidesFile,
        ledger: MemoryLedger,
        transfers: HostTransfers,
        host_device: torch.device,
        failures: LocalFailures | None = None,
    ) -> None:
        self._label = label
        self._failures = failures  # where a read back in the backward that failed waits (None: raised)
        self._numel = numel
        self._file = file
        self._ledger = ledger
        self._transfers = transfers
        self._host_device = host_device
        self._offset = file.region(self.nbytes)
        self._tensor = torch.empty(numel, dtype=_FP32, device=host_device)
        self._tensor.untyped_storage().resize_(0)
        self._resident = False
        self._scaled = False
        self._present = False
        self._factor = 1.0
        self._norm2 = 0.0
        self._largest = 0.0
        self._finite = True
        self._writes: list[tuple[Future[None], torch.Tensor]] = []  # in flight, with their sources
        self._off_disk = False  # its last write failed: it is in memory only
        self.failure: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self._numel * _FP32.itemsize

    @property
    def present(self) -> bool:
        """A reduced gradient is on disk (since the last ``drop``)."""
        return self._present

    # --- from the reduction -------------------------------------------------------------------
    def receive(
        self,
        reduced: torch.Tensor,
        accumulate: bool,
        after: Callable[[], None] | None,
        divide_by: int | None,
    ) -> None:
        """This rank's reduced slot (on the compute device): averaged, added to what is there with
        ``accumulate``, measured, and written out."""
        # Through a host staging buffer, as every device-to-host copy (counted; pinned on CUDA),
        # one of at most DISK_WINDOW on their way to disk.
        self._file.gradient_slots.acquire()
        host = self._transfers.staging(self._numel, _FP32, self._host_device)
        self._transfers.copy(host, reduced, Direction.TO_HOST, after, divide_by)
        self._transfers.before_host_read(host)
        if accumulate and self._present:
            if self._factor != 1.0:
                raise RuntimeError(
                    f"{self._label}: a gradient arrived after the step's checks scaled the one on disk (clip or fp16 "
                    "unscale before the last backward); reduce all gradients before clipping"
                )
            earlier = self._read_in_backward()
            if earlier is not None:
                host.add_(earlier)  # what an earlier reduction left (a + b is b + a, bit for bit)
        self._measure(host)
        if self._off_disk:  # what memory held is superseded by this write
            self._off_disk = False
            self.evict()
        transfers, slots = self._transfers, self._file.gradient_slots

        def written(future: Future[None]) -> None:  # on the I/O thread, or here if already done
            if future.exception() is None:
                transfers.give_back(host)  # a failed write keeps it: its values are the gradient
            slots.release()

        write = self._file.write(host, self._offset)
        write.add_done_callback(written)
        self._writes.append((write, host))
        self._present = True

    def _measure(self, values: torch.Tensor) -> None:
        self._factor = 1.0
        if values.is_meta:  # a plan (chunkmem.plan): nothing to measure
            self._norm2, self._largest, self._finite = 0.0, 0.0, True
            return
        # Computed as clip_grad_norm computes them for a shard in memory, so that both agree.
        self._norm2 = flat_norm(values, 2.0)
        self._largest = float(values.abs().max()) if values.numel() else 0.0
        self._finite = bool(torch.isfinite(values).all())
        self._factor = 1.0

    def _read_in_backward(self) -> torch.Tensor | None:
        """What an earlier reduction left, read back; ``None`` where the read failed and is noted
        for the ranks to agree on at the end of the backward (``ranks.local_failures``: raising here,
        on one rank, would leave the others waiting in their next collective)."""
        try:
            return self._read_now()
        except DiskTierError as error:
            if self._failures is None:
                raise
            self._failures.note(
                "reading back a gradient from the disk tier",
                DiskTierError(
                    f"{self._label}: {error}. The disk tier's files are this run's scratch: leave the "
                    ".chunkmem-scratch-* directories of a running job alone; resume from the last checkpoint"
                ),
                Lasts.ITERATION,
            )
            return None

    def _read_now(self) -> torch.Tensor:
        self._settle_writes()
        if self._off_disk:
            return self._tensor.clone()
        values = torch.empty(self._numel, dtype=_FP32, device=self._host_device)
        self._file.read(values, self._offset).result()
        return values

    def _settle_writes(self) -> None:
        """Wait for the writes in flight. One that failed (a full disk) leaves the gradient in
        memory, as written, and its error in ``failure``: the step then reads it there."""
        writes, self._writes = self._writes, []
        for future, source in writes:
            error = future.exception()
            if error is not None:
                if not self._resident:
                    self._tensor.untyped_storage().resize_(self.nbytes)
                    self._ledger.alloc(Location.HOST, MemoryKind.STAGING, self.nbytes)
                self._tensor.copy_(source)
                self._resident, self._scaled, self._off_disk = True, False, True
                self.failure = error
                self._transfers.give_back(source)

    def take_failure(self) -> BaseException | None:
        """The error of a write that failed since the last call (its gradient stayed in memory)."""
        failure, self.failure = self.failure, None
        return failure

    # --- what the step's checks need -----------------------------------------------------------
    def scale(self, factor: float) -> None:
        """Multiply the gradient by ``factor`` (applied when the step reads it)."""
        self._factor *= factor

    def norm(self, norm_type: float) -> float:
        """Its ``norm_type`` norm, as computed on it in memory. The 2-norm and the largest
        magnitude are kept from when it was reduced, exact while the factor applied since is a
        power of two (fp16 unscaling); otherwise it is read back and measured."""
        mantissa, _ = math.frexp(self._factor)
        if abs(mantissa) == 0.5 and norm_type in (2.0, math.inf):
            kept = self._norm2 if norm_type == 2.0 else self._largest
            return kept * abs(self._factor)
        return flat_norm(self._read_now().mul_(self._factor), norm_type)

    @property
    def finite(self) -> bool:
        return self._finite

    # --- to the step ---------------------------------------------------------------------------
    def fetch(self) -> Future[None] | None:
        """Start reading it into memory (``None``: nothing on disk). Once read, ``settle_read``."""
        self._settle_writes()
        if not self._present or self._resident:
            return None
        self._tensor.untyped_storage().resize_(self.nbytes)
        self._resident = True
        self._scaled = False
        self._ledger.alloc(Location.HOST, MemoryKind.STAGING, self.nbytes)
        return self._file.read(self._tensor, self._offset)

    def resident(self) -> torch.Tensor:
        """The gradient in memory, with the checks' factor applied (after ``fetch`` landed)."""
        if not self._resident:
            raise RuntimeError(
                f"{self._label}: its gradient shard is on disk; the optimizer step reads it in (DiskSides.fetch)"
            )
        if not self._scaled and self._factor != 1.0:
            self._tensor.mul_(self._factor)
        self._scaled = True
        return self._tensor

    def evict(self) -> None:
        """Free its memory (it is never written back: the step only reads it), unless it is not on
        disk (its write failed)."""
        if self._resident and not self._off_disk:
            self._tensor.untyped_storage().resize_(0)
            self._resident = False
            self._ledger.free(Location.HOST, MemoryKind.STAGING, self.nbytes)

    def drop(self) -> None:
        """``zero_grad``: no gradient any more."""
        self._settle_writes()
        self._off_disk = False
        self.evict()
        self._present = False
        self._factor = 1.0
        self._norm2 = self._largest = 0.0
        self._finite = True
