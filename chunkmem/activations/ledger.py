"""``DeviceActivations``: the saved activations of ``ActivationPlacement(auto=...)`` blocks that are
on the device, in the ledger (``MemoryKind.ACTIVATION``), under the device budget.

Every rank places chunks by what the ledger holds (the residency's evictions, prefetches and room
read it, and their collectives must stay in step), so the ledger holds **rank-agreed figures per
call**, never a rank's own bytes: ranks may save different bytes (dynamic padding: one rank's
sequence is shorter). The figures are those the first step measured, the largest over ranks, for
each call of a forward (``CallBytes``): the bytes the call saves, those of them an offload leaves
on the device (small storages), and those it copies. A rank's own bytes are only compared with
them at the end of each training forward, by every rank together (``auto``): a call that saved
more than its figure (a longer sequence than the first step's) makes every rank re-plan.

What a call holds (``CallHold``), and when:

* **kept** (the plan keeps the call): its saved bytes from the call's start until autograd lets go
  of the last tensor the call saved (its backward ran, or the graph was dropped).
* **offloaded** (as planned): its saved bytes from the call's start until its copies to the host are
  done (the call's end), then its small storages until the call is gone, and its copied bytes from
  its fetch (when its backward begins, or up to the plan's ``prefetch`` offloaded calls earlier)
  until the call is gone.
* **measured** (the first step, every call offloaded): nothing during its forward (what it saves
  then is the working set of one block), then, once its figures are agreed at its end, its small
  storages and, from the fetch, its copied bytes, until the call is gone. Where they find no room
  the budget is refused (``BudgetTooSmallError`` naming a minimum, on every rank alike: the figures
  and the ledger are agreed), as it is at the call's end where the calls so far need more than it.
* **recomputed**: nothing (its recomputation in the backward is the working set of one block that
  the plan reserves).

With ``ActivationPlacement(offload_outside=True)`` each stretch of the forward outside the blocks
(``outside``) is a call of the plan that is always offloaded, held as an offloaded (or, in the first
step, a measured) call: its figures are agreed and re-planned as a block call's, and the plan's
reserve covers the largest stretch as the largest block call.

Not accounted: what autograd saves outside those blocks without ``offload_outside`` (the
embeddings, the head, a loss), a block's temporaries, and the block's output (an input of what
follows). Model memory (``counting.is_model_memory``) is never counted here.

Every allocation first asks for room (idle gathered chunks are released when the budget needs
it); where there is none it raises ``BudgetExceededError`` rather than go over the budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from chunkmem.placement.policy import format_bytes

from ..errors import BudgetExceededError
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from ..usage.saved import KeptTensor

__all__ = ["CallBytes", "CallHold", "DeviceActivations"]


class CallBytes(NamedTuple):
    """One call's figures (the largest over ranks, or one rank's own)."""

    saved: int
    """Bytes the call saves apart from model memory, each storage once."""
    small: int
    """Of those, what an offload leaves on the device."""
    copied: int
    """What an offload copies to the host and back."""

    def most(self, other: CallBytes) -> CallBytes:
        return CallBytes(*(max(a, b) for a, b in zip(self, other, strict=True)))


class _Kept(KeptTensor):
    """What autograd keeps for a saved tensor that stays on the device: the tensor (a
    ``KeptTensor``: it keeps no graph alive), and the call that saved it (whose hold is given back
    once no such handle and no copy of it is left)."""

    __slots__ = ("owner",)

    def __init__(self, tensor: torch.Tensor, owner: object) -> None:
        super().__init__(tensor)
        self.owner = owner


def _give_back(account: DeviceActivations, held: list[int]) -> None:
    account.remove(held[0])
    held[0] = 0


class CallHold:
    """The bytes one call holds in the ledger: taken with room made, given back in part by the call
    (``give``) and what is left once the hold is gone (it lives as long as its call). Where no room
    is left, ``take`` raises ``BudgetExceededError``, or what ``refusal()`` returns (a measured call:
    the budget's refusal naming the minimum)."""

    def __init__(self, account: DeviceActivations, refusal: Callable[[], Exception] | None = None) -> None:
        self._account = account
        self._refusal = refusal
        self._held = [0]
        weakref.finalize(self, _give_back, account, self._held)

    @property
    def bytes(self) -> int:
        return self._held[0]

    def take(self, nbytes: int, what: str) -> None:
        try:
            self._account.add(nbytes, what)
        except BudgetExceededError as error:
            if self._refusal is None:
                raise
            raise self._refusal() from error
        self._held[0] += nbytes

    def give(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._held[0])
        self._account.remove(nbytes)
        self._held[0] -= nbytes


class DeviceActivations:
    """See the module docstring. ``room(nbytes)`` makes room for ``nbytes`` and returns the bytes
    of the budget free then (``None``: no budget)."""

    def __init__(self, ledger: MemoryLedger, room: Callable[[int], int | None], rank: int) -> None:
        self._ledger = ledger
        self._room = room
        self._rank = rank
        self.kept_total = 0
        """Saved bytes kept on the device since boosting (each storage once per call)."""

    @property
    def device_bytes(self) -> int:
        """Accounted saved-activation bytes on the device now."""
        return self._ledger.bytes(Location.DEVICE, MemoryKind.ACTIVATION)

    def add(self, nbytes: int, what: str) -> None:
        """Account ``nbytes`` of ``what`` on the device, making room first; refused over the budget."""
        if nbytes == 0:
            return
        free = self._room(nbytes)
        if free is not None and nbytes > free:
            ledger = self._ledger
            raise BudgetExceededError(
                f"rank {self._rank}: {what} needs {format_bytes(nbytes)} on the device but only {format_bytes(free)} "
                f"of the device budget are free ({format_bytes(ledger.device_bytes)} accounted, of which "
                f"{format_bytes(self.device_bytes)} saved activations) after releasing every idle chunk. "
                "Raise device_budget, or shorten the sequence or the micro-batch.",
                ledger.device_bytes + nbytes,
            )
        self._ledger.alloc(Location.DEVICE, MemoryKind.ACTIVATION, nbytes)

    def remove(self, nbytes: int) -> None:
        if nbytes:
            self._ledger.free(Location.DEVICE, MemoryKind.ACTIVATION, nbytes)

    def hold(self, refusal: Callable[[], Exception] | None = None) -> CallHold:
        return CallHold(self, refusal)

    def keep(self, tensor: torch.Tensor, owner: object) -> _Kept:
        """The handle autograd keeps for a saved tensor that stays on the device; ``owner`` (the
        call) lives as long as it."""
        return _Kept(tensor, owner)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.get() if isinstance(saved, KeptTensor) else saved
