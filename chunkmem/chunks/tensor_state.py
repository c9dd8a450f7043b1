"""Per-parameter state within a chunk, changed only through a transition table that raises on an
illegal move.

States, for one training iteration:

* ``HOLD``: values valid in the chunk, no op using them, no gradient expected.
* ``COMPUTE``: at least one op (forward or the backward of an op) is using the parameter.
* ``HOLD_AFTER_FWD``: used by a forward op that recorded autograd history; a backward will come.
* ``HOLD_AFTER_BWD``: the backward of an op using it ran; its gradient may still be accumulating.
* ``READY_FOR_REDUCE``: its gradient for this backward is in the chunk's flat gradient buffer.

These states only check that the hooks fire in a legal order (an illegal move raises naming the
parameter, chunk and rank); nothing is decided from them. When a chunk is released (no op holds
it) and when its gradient buffer is reduced (a parameter no op used never gets ready) is the
placement's to decide, from the ops of the trace (``placement.DeviceResidency``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..errors import IllegalTransition

__all__ = ["TensorInfo", "TensorState"]


class TensorState(enum.Enum):
    """See the module docstring for what each state means."""

    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


_S = TensorState
_LEGAL: dict[TensorState, frozenset[TensorState]] = {
    # A gradient can arrive for a parameter none of whose ops were bridged: its ops ran inside a
    # custom autograd.Function, where only the Function itself records history.
    _S.HOLD: frozenset({_S.COMPUTE, _S.READY_FOR_REDUCE}),
    # Leaving COMPUTE: to HOLD when no backward will follow (no_grad, frozen), to HOLD_AFTER_FWD after
    # a forward that recorded history, to HOLD_AFTER_BWD after the op's backward.
    _S.COMPUTE: frozenset({_S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD}),
    # Used again before its backward (shared weights, a second forward) or by its backward; its
    # gradient can arrive while a later use is pending (reentrant checkpointing); an iteration may
    # end without a backward.
    _S.HOLD_AFTER_FWD: frozenset({_S.COMPUTE, _S.READY_FOR_REDUCE, _S.HOLD}),
    _S.HOLD_AFTER_BWD: frozenset({_S.COMPUTE, _S.READY_FOR_REDUCE, _S.HOLD}),
    # Used again after its gradient arrived (recomputation, gradient accumulation), or reduced; or
    # another gradient arrives while its chunk waits for others (where ops are not observed, nothing
    # moves it in between: a second backward, shared weights under reentrant checkpointing).
    _S.READY_FOR_REDUCE: frozenset({_S.COMPUTE, _S.HOLD, _S.READY_FOR_REDUCE}),
}


@dataclass(eq=False, slots=True)
class TensorInfo:
    """Where a parameter lives in its chunk, and its state."""

    name: str
    param: torch.nn.Parameter
    chunk_id: int
    index: int
    """Position among the chunk's parameters."""
    offset: int
    """First element in the chunk."""
    numel: int
    shape: torch.Size
    trainable: bool
    state: TensorState = TensorState.HOLD
    compute_depth: int = field(default=0)
    """How many ops are using the parameter right now (overlapping backward ops may share it)."""
    strides: tuple[int, ...] = field(init=False)
    """The strides of ``shape`` laid out contiguously, as in the chunk."""

    def __post_init__(self) -> None:
        self.strides = _contiguous_strides(self.shape)

    def transition(self, target: TensorState, rank: int) -> None:
        """Move to ``target`` if the table allows it, else raise naming the parameter, chunk and
        rank. Called by ``Chunk``, which also keeps its per-chunk counts.
        """
        if target not in _LEGAL[self.state]:
            raise IllegalTransition(
                f"parameter '{self.name}' (chunk {self.chunk_id}, rank {rank}): illegal state transition "
                f"{self.state.value} -> {target.value}; legal from {self.state.value}: "
                f"{sorted(s.value for s in _LEGAL[self.state])}. This usually means a hook fired out of order "
                "(an op on a managed parameter ran outside the hooks, or a backward ran twice without a forward)."
            )
        self.state = target


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has (a size-0 dimension counts as 1, as in torch)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
