"""What a policy sees and what it returns. All frozen: a policy reads a snapshot and returns a plan.

Byte figures are computed by the runtime, which knows buffer sizes and aliasing; the policy only
adds and compares them. Everything a policy sees is the same on every rank (sizes, the trace, the
budget, positions), never timing, so every rank makes the same decisions and issues the same
collectives.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .places import Location, why_not_placed
from .trace import ComputeTrace, Phase

__all__ = [
    "BufferKind",
    "ChunkPlacement",
    "ChunkSpec",
    "FetchPlan",
    "Layout",
    "OpSnapshot",
    "ReleaseSnapshot",
    "Residency",
    "ResidentChunk",
    "ResidentSet",
    "WorkingSet",
]


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """Static description of one chunk, in device bytes per component."""

    chunk_id: int
    label: str
    """A human name for messages (the first parameter it holds)."""
    trainable: bool
    gathered_bytes: int
    """Bytes of the full compute-dtype buffer while the chunk is gathered."""
    grad_bytes: int
    """Bytes of the flat fp32 gradient buffer while gradients accumulate (0 when frozen)."""
    optim_side_bytes: int
    """Bytes of the fp32 master shard, its gradient shard and optimizer states when they live on
    the device; for a frozen chunk whose parameters are in the compute dtype, its values alone (it
    has no master: ``master_is_compute``)."""
    shard_copy_bytes: int
    """Bytes of a compute-dtype copy of the shard kept on the device while the master is on the
    host."""
    gathered_is_shard: bool
    """World size 1: the shard is the whole chunk, so a compute-dtype shard already on the device
    serves as the gathered buffer and gathering allocates nothing."""
    master_is_compute: bool
    """The master dtype is the compute dtype (fp32 training, or a frozen chunk that holds only its
    16-bit values): a device master is compute data, and gathers read it, with no copy."""
    disk_side_bytes: int = 0
    """Bytes of the optimizer side that leave host memory when it goes to disk: the optimizer
    states, the gradient shard and, when the master is not the compute data (16-bit compute), the
    fp32 master."""
    master_pin_slack: int = 0
    """What a pinned host master holds beyond its bytes: on a GPU the pinned allocator's block is
    the next power of two (``chunkmem.device.layer.pinned_block_bytes``); 0 where nothing is pinned."""
    grad_pin_slack: int = 0
    """The same for the pinned host gradient shard."""
    copy_pin_slack: int = 0
    """The same for a pinned host buffer of ``shard_copy_bytes`` (the 16-bit copy gathers read, and
    the staging buffer a parameter shard on disk is read into or written from)."""


@dataclass(frozen=True, slots=True)
class ChunkPlacement:
    """Where one chunk's data lives between uses, decided once, before training: its optimizer
    side and its parameter shard each at a ``Location``, as ``places.PLACES`` allows."""

    optim: Location
    """Where the fp32 master shard, the gradient shard and the optimizer states live between steps:
    the device; the host (stepped there); or disk, their ``disk_side_bytes`` in the disk tier's
    files between steps (stepped on the host)."""
    shard: Location
    """Where the compute-dtype parameter shard gathers read lives: the device (the master itself,
    cast on the fly when gathered, when the master is on the device; else a copy); the host (the
    16-bit copy, or with fp32 compute the master); or disk, ``shard_copy_bytes`` of it read for each
    gather and written when the optimizer step changed it."""
    keep_gathered: bool = False
    """The full compute buffer stays on the device between uses (ZeRO-2 style)."""

    def __post_init__(self) -> None:
        why = why_not_placed(self.optim, self.shard, self.keep_gathered)
        if why is not None:
            raise ValueError(
                f"ChunkPlacement(optim={self.optim.value}, shard={self.shard.value}, "
                f"keep_gathered={self.keep_gathered}): {why}"
            )

    def master_place(self, master_is_compute: bool) -> Location:
        """Where the master lives between steps: with its optimizer side, except that on disk a
        master in the compute dtype stays in host memory while gathers read it there (fp32
        compute, or a frozen chunk's values), since it is the parameter shard."""
        if self.optim is Location.DISK and master_is_compute and self.shard is not Location.DISK:
            return Location.HOST
        return self.optim

    def resident_shard_is_compute(self, spec: ChunkSpec) -> bool:
        """Whether compute-dtype shard data sits on the device between uses."""
        if self.optim is Location.DEVICE:
            return spec.master_is_compute
        return self.shard is Location.DEVICE

    def at_rest_bytes(self, spec: ChunkSpec) -> int:
        """Device bytes this chunk holds between uses."""
        if self.optim is Location.DEVICE:
            total = spec.optim_side_bytes
        else:
            total = spec.shard_copy_bytes if self.shard is Location.DEVICE else 0
        if self.keep_gathered:
            total += self.fetch_bytes(spec, ignore_keep=True)
        return total

    def host_bytes(self, spec: ChunkSpec) -> int:
        """Host bytes this chunk holds between uses: its optimizer side (less what is on disk)
        and, with 16-bit compute, the pinned 16-bit copy gathers read."""
        if self.optim is Location.DEVICE:
            return 0
        total = spec.optim_side_bytes - (spec.disk_side_bytes if self.optim is Location.DISK else 0)
        # What gathers read: the 16-bit copy, or with fp32 compute the master (in the optimizer
        # side), unless it is on disk.
        total += 0 if spec.master_is_compute else spec.shard_copy_bytes
        return total - (spec.shard_copy_bytes if self.shard is Location.DISK else 0) + self._pin_slack(spec)

    def _pin_slack(self, spec: ChunkSpec) -> int:
        """What the pinned ones of its host buffers hold beyond their bytes: the master and the
        gradient shard in host memory, and the 16-bit copy gathers read. A side on disk pins neither
        its master (the shard store pins a master only where its side stays in memory) nor its
        gradient shard (on disk)."""
        copy = 0 if spec.master_is_compute or self.shard is Location.DISK else spec.copy_pin_slack
        if self.optim is not Location.DISK:
            return spec.master_pin_slack + spec.grad_pin_slack + copy
        return copy

    def disk_bytes(self, spec: ChunkSpec) -> int:
        """Bytes this chunk keeps on disk."""
        if self.optim is not Location.DISK:
            return 0
        return spec.disk_side_bytes + (spec.shard_copy_bytes if self.shard is Location.DISK else 0)

    def grad_buffer_bytes(self, spec: ChunkSpec) -> int:
        """Device bytes of the gradient buffer during backward (0 at world size 1 with the
        optimizer side on the device: gradients accumulate straight into the gradient shard)."""
        if spec.gathered_is_shard and self.optim is Location.DEVICE:
            return 0
        return spec.grad_bytes

    def fetch_bytes(self, spec: ChunkSpec, ignore_keep: bool = False) -> int:
        """Device bytes that gathering this chunk adds (0 when the gathered buffer already exists
        or aliases a resident compute-dtype shard)."""
        if self.keep_gathered and not ignore_keep:
            return 0
        if spec.gathered_is_shard and self.resident_shard_is_compute(spec):
            return 0
        return spec.gathered_bytes


@dataclass(frozen=True, slots=True)
class Layout:
    """The placement of every chunk, indexed by chunk id."""

    placements: tuple[ChunkPlacement, ...]

    def __getitem__(self, chunk_id: int) -> ChunkPlacement:
        return self.placements[chunk_id]

    def at_rest_bytes(self, specs: tuple[ChunkSpec, ...]) -> int:
        """Device bytes all chunks hold between uses under this layout."""
        return sum(p.at_rest_bytes(s) for p, s in zip(self.placements, specs, strict=True))

    def host_bytes(self, specs: tuple[ChunkSpec, ...]) -> int:
        """Host bytes all chunks hold between uses under this layout."""
        return sum(p.host_bytes(s) for p, s in zip(self.placements, specs, strict=True))

    def disk_bytes(self, specs: tuple[ChunkSpec, ...]) -> int:
        """Bytes all chunks keep on disk under this layout."""
        return sum(p.disk_bytes(s) for p, s in zip(self.placements, specs, strict=True))

    def disk_window_bytes(self, specs: tuple[ChunkSpec, ...], window: int) -> int:
        """Host bytes the disk tier steps in: ``window`` of the largest chunks on disk at once."""
        # A parameter shard on disk is written from a pinned staging buffer: its whole block.
        sizes = sorted(
            (
                p.disk_bytes(s) + (s.copy_pin_slack if p.shard is Location.DISK else 0)
                for p, s in zip(self.placements, specs, strict=True)
            ),
            reverse=True,
        )
        return sum(sizes[:window])

    def param_read_bytes(self, specs: tuple[ChunkSpec, ...]) -> int:
        """Host bytes a gather of a parameter shard on disk reads it into: the largest one (gathers
        read one at a time)."""
        return max(
            (
                s.shard_copy_bytes + s.copy_pin_slack
                for p, s in zip(self.placements, specs, strict=True)
                if p.shard is Location.DISK
            ),
            default=0,
        )


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """Chunks that one module's own parameters live in: an op of that module needs all of them on
    the device at once."""

    label: str
    chunks: tuple[int, ...]


class BufferKind(enum.Enum):
    """Which buffer of a resident chunk an eviction gives back."""

    GATHERED = "gathered"
    """A gathered parameter buffer; evicting it releases it (gathered again at next use)."""
    GRAD = "grad"
    """A flat gradient buffer; evicting it reduces what it holds into the gradient shard early (one
    more reduction; later gradients go to a fresh buffer)."""
    REDUCING = "reducing"
    """A gradient buffer whose reduction is in flight; evicting it waits for the reduction to end
    (it is never needed again)."""
    SPILL = "spill"
    """A flat gradient buffer inside ``no_sync``, where it cannot be reduced: evicting it moves what
    it accumulated to the host (added back at the reduction), the costliest move, so the last
    resort."""


@dataclass(frozen=True, slots=True)
class ResidentChunk:
    """A device buffer of a chunk that could be given back."""

    chunk_id: int
    kind: BufferKind
    release_bytes: int
    """Device bytes freed by evicting it."""
    held: bool
    """An op is using the chunk right now."""
    fetching: bool
    """An asynchronous gather into it is still in flight."""
    last_use: int
    """Trace position of the chunk's most recent use in this iteration (-1: not used yet)."""


class Residency(Protocol):
    """What is on the device, as a policy may ask it. Queries about one chunk are cheap; the full
    list of buffers is built only when asked for (when room must be made), so an op that fits
    costs the policy nothing proportional to the number of chunks."""

    def is_gathered(self, chunk_id: int) -> bool:
        """The chunk's full buffer is on the device or being gathered into it."""
        ...

    def has_grad_buffer(self, chunk_id: int) -> bool:
        """The chunk's gradient buffer exists (flushable or not)."""
        ...

    def buffers(self) -> Sequence[ResidentChunk]:
        """Every device buffer that could be given back: gathered buffers, and gradient buffers
        when a reduction is allowed now (not inside ``no_sync`` on several ranks)."""
        ...

    def awaited(self) -> Sequence[tuple[int, int]]:
        """``(position, chunk_id)`` of chunks evicted earlier in this pass that an op ahead still
        needs, earliest first (not the first use of a chunk in a pass, so not a trace entry)."""
        ...


@dataclass(frozen=True, slots=True)
class ResidentSet:
    """A :class:`Residency` given as plain data (hand-made snapshots, replays)."""

    resident: tuple[ResidentChunk, ...] = ()
    grad_buffers: frozenset[int] = frozenset()
    evicted_reuses: tuple[tuple[int, int], ...] = ()

    def is_gathered(self, chunk_id: int) -> bool:
        return any(r.chunk_id == chunk_id and r.kind is BufferKind.GATHERED for r in self.resident)

    def has_grad_buffer(self, chunk_id: int) -> bool:
        return chunk_id in self.grad_buffers

    def buffers(self) -> Sequence[ResidentChunk]:
        return self.resident

    def awaited(self) -> Sequence[tuple[int, int]]:
        return self.evicted_reuses


@dataclass(frozen=True, slots=True)
class OpSnapshot:
    """The state before an op runs: what it needs and what is on the device."""

    position: int
    phase: Phase
    needed: tuple[int, ...]
    needed_bytes: int
    """Device bytes that must still be allocated for the op to run (gathers and gradient buffers)."""
    residency: Residency
    """What is on the device now (read-only; see :class:`Residency`)."""
    device_bytes: int
    """Accounted chunk bytes on the device now."""
    trace: ComputeTrace | None
    """The frozen trace while this iteration follows it; ``None`` while recording."""


@dataclass(frozen=True, slots=True)
class ReleaseSnapshot:
    """The state after an op: the chunks it used that no op holds any more."""

    position: int
    phase: Phase
    finished: tuple[int, ...]
    in_backward: bool
    """The autograd engine is running: a forward op now is a recomputation (activation
    checkpointing) whose backward follows shortly."""
    residency: Residency
    """What is on the device now, the finished chunks included (read-only; see :class:`Residency`:
    a policy lists its buffers only where it must, such as while recording)."""
    trace: ComputeTrace | None = None
    """The frozen trace while this iteration follows it; ``None`` while recording."""


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What to do before an op: release the gathered buffers of ``evict`` and reduce the gradient
    buffers of ``flush`` first, then fetch what the op needs, then start asynchronous gathers for
    ``prefetch`` (in that order)."""

    evict: tuple[int, ...] = ()
    flush: tuple[int, ...] = ()
    """Gradient buffers to reduce now, or whose reduction in flight to finish."""
    prefetch: tuple[int, ...] = ()
    examined: int = dataclasses.field(default=0, compare=False)
    """How many trace entries and device buffers the decision looked at: the cost of deciding,
    which the runtime counts (not part of the decision)."""
