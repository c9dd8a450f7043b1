"""The moves a :class:`~placement.residency.DeviceResidency` yields: a verb, the chunk it applies
to, and what the residency knew of the chunk's gradients when it decided (so that whoever carries an
action out never asks the residency back). The runtime's plan executor carries each out on a real
chunk; a replay counts them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "Verb"]


class Verb(enum.Enum):
    """What an action does to a chunk."""

    KEEP = "keep"
    """Gather once and for all: the chunk stays gathered (a placement that keeps it gathered, or a
    resident shard that serves as the chunk at world size 1, so gathering allocates nothing)."""
    GATHER = "gather"
    """Gather now: an op needs the chunk (a demand fetch)."""
    PREFETCH = "prefetch"
    """Start an asynchronous gather ahead of use."""
    CLAIM = "claim"
    """An op takes a chunk a prefetch brought (a prefetch hit); a WAIT follows if it is in flight."""
    WAIT = "wait"
    """Land an asynchronous gather."""
    RELEASE = "release"
    """The policy releases a chunk an op has finished with."""
    EVICT = "evict"
    """The policy releases a chunk to make room."""
    DROP = "drop"
    """Release between uses without a policy decision (after a step, before a transient buffer)."""
    REFRESH = "refresh"
    """Fill a gathered buffer again: the master changed (a step, a load)."""
    ALLOCATE_GRAD = "allocate_grad"
    """Give the chunk a gradient buffer."""
    START_REDUCE = "start_reduce"
    """Start reducing a gradient buffer whose gradients are complete (asynchronous)."""
    REDUCE_EARLY = "reduce_early"
    """Start reducing a gradient buffer before all its gradients arrived, to make room."""
    SPILL_GRAD = "spill_grad"
    """Move what a gradient buffer holds to the host and free it, to make room, where it may not
    be reduced yet (inside ``no_sync``, or before the gradients of a chunk that accumulated there
    are complete); the chunk's next buffer starts from it."""
    FINISH_REDUCE = "finish_reduce"
    """Wait for a reduction and free its buffer."""
    ZERO_GRAD = "zero_grad"
    """Forget the chunk's gradients (buffer and reduced shard)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One move of one chunk."""

    verb: Verb
    chunk: int
    from_host: bool = False
    """``ALLOCATE_GRAD``: the new buffer starts from the chunk's gradients moved to the host
    (``SPILL_GRAD``), and goes on adding to their sum."""
    onto_reduced: bool = False
    """``ALLOCATE_GRAD``, ``START_REDUCE``, ``REDUCE_EARLY``: the chunk's gradient shard holds reduced
    gradients already (an earlier reduction since ``ZERO_GRAD``): this buffer's reduction adds to them."""
    in_flight: bool = False
    """``CLAIM``: the prefetch is still being gathered (a ``WAIT`` follows)."""
