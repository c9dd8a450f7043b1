"""``DeviceActivations``: the saved activations of ``ActivationPlacement(auto=...)`` blocks that are
on the device, in the ledger (``MemoryKind.ACTIVATION``), under the device budget.

What is accounted, and when:

* **kept** (a call kept, or a tensor an offloaded call keeps because it is small): each storage
  autograd saves, once however often and through whichever view it is saved, from the save (the
  pack hook) until autograd lets go of the last handle to it (its backward ran, or the graph was
  dropped): the handle's finalizer frees it.
* **offloaded**: a storage from its save until its copy to the host is done (the block call's
  end), and its device copy from the fetch before the call's backward until the call's last
  handle is gone.
* **recomputed**: nothing (between forward and backward the block holds nothing; its
  recomputation in the backward is the working set of one block that the plan reserves).

Not accounted: what autograd saves outside those blocks (the embeddings, the head, a loss), a
block's temporaries, and the block's output (an input of what follows). Parameters, views of them,
and storages shared with the block's parameters or buffers are model memory, never counted here.

Every allocation first asks for room (idle gathered chunks are released when the budget needs
it); where there is none it raises ``BudgetExceededError`` rather than go over the budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from placement.policy import format_bytes

from ..errors import BudgetExceededError
from ..usage.accounting import Location, MemoryKind, MemoryLedger

__all__ = ["DeviceActivations", "is_model_memory"]


def is_model_memory(module: torch.nn.Module, tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is model memory rather than an activation: a parameter, a view of
    one, no plain strided tensor (a subclass, a copy the hooks made), or a tensor sharing the
    storage of the block's parameters or buffers (chunk memory the runtime gathered for the op)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_meta:
        return True
    if isinstance(tensor._base, torch.nn.Parameter):
        return True
    pointer = tensor.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == pointer for t in (*module.parameters(), *module.buffers()))


class _Kept:
    """What autograd keeps for a kept tensor: the tensor, and the release of its storage's count
    when autograd lets go of it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class DeviceActivations:
    """See the module docstring. ``room(nbytes)`` makes room for ``nbytes`` and returns the bytes
    of the budget free then (``None``: no budget)."""

    def __init__(self, ledger: MemoryLedger, room: Callable[[int], int | None], rank: int) -> None:
        self._ledger = ledger
        self._room = room
        self._rank = rank
        self._kept: dict[int, list[int]] = {}  # storage (_cdata) -> [bytes, handles]
        self.kept_total = 0
        """Bytes kept since boosting (each storage once per save into a storage not kept yet)."""

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
                f"{format_bytes(self.device_bytes)} saved activations) after releasing every idle chunk. The plan "
                "made from the first step reserved one block's saved bytes: a step that saves more (a longer "
                "sequence, a larger micro-batch) than the first does not fit. Run the largest shape first, or "
                "raise device_budget.",
                ledger.device_bytes + nbytes,
            )
        self._ledger.alloc(Location.DEVICE, MemoryKind.ACTIVATION, nbytes)

    def remove(self, nbytes: int) -> None:
        if nbytes:
            self._ledger.free(Location.DEVICE, MemoryKind.ACTIVATION, nbytes)

    def keep(self, tensor: torch.Tensor, what: str) -> _Kept:
        """The handle autograd keeps for a saved tensor that stays on the device, accounted."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._kept.get(key)
        if entry is None:
            self.add(storage.nbytes(), what)
            entry = self._kept[key] = [storage.nbytes(), 0]
            self.kept_total += storage.nbytes()
        entry[1] += 1
        kept = _Kept(tensor)
        weakref.finalize(kept, self._drop, key)
        return kept

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Kept) else saved

    def _drop(self, key: int) -> None:
        entry = self._kept[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._kept[key]
            self.remove(entry[0])

    def keep_hooks(self, module: torch.nn.Module, what: str) -> Any:
        """Saved-tensor hooks that keep what a call of ``module`` saves, accounted."""

        def pack(tensor: torch.Tensor) -> Any:
            return tensor if is_model_memory(module, tensor) else self.keep(tensor, what)

        return torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)
