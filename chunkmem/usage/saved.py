"""What chunkmem's saved-tensor hooks keep of a tensor autograd saves and leaves where it is, and
the bytes such tensors hold.

* ``unlinked``: the tensor without the link to its graph. Autograd hands a pack hook the tensor
  itself, with its ``grad_fn``; when an op saves its own output (``exp``, ``tanh``, ``softmax``, ...)
  that ``grad_fn`` is the node which keeps the packed object, so a handle that held the tensor as
  given would close a cycle through autograd's C++ nodes, which Python's collector cannot see: a
  graph dropped without its backward (an evaluation forward without ``torch.no_grad()``) would live
  for good, with everything it saved. Without hooks, autograd saves an output without its
  ``grad_fn`` for the same reason; here the tensor is kept detached (the same storage and version
  counter: unpacking rebuilds the tensor from its data and autograd's own metadata, so the
  backward is the same). A leaf has no ``grad_fn`` to link back and a tensor subclass (the
  runtime's hooked parameters and their value copies) keeps its type: both are kept as they are.
* ``KeptTensor``: the handle of such a tensor. Autograd checks that a tensor it saved was not
  written in place before the backward reads it only where no hooks are in place; the handle does
  the same check (``get``), so that a boosted model raises where plain PyTorch does.
* ``LiveSaved``: the bytes of the storages its handles keep alive now (each storage once, however
  many handles share it) and their peak, with other bytes held as long as an owner lives.
* ``top_hooks``: the innermost saved-tensor hooks in place now (``None`` where there are none, or
  where this PyTorch cannot say: before 2.8).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compat.torch import SEES_SAVED_TENSOR_HOOKS, storage_id, top_saved_tensors_hooks, version

__all__ = ["SEES_HOOKS", "KeptTensor", "LiveSaved", "top_hooks", "unlinked"]

SEES_HOOKS = SEES_SAVED_TENSOR_HOOKS
"""Whether this PyTorch says which saved-tensor hooks are in place (2.8 and later)."""


def top_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks now, ``(pack, unpack)`` (see the module docstring)."""
    return top_saved_tensors_hooks()


def unlinked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without the link to its graph, for a pack hook to keep (see the module docstring)."""
    if tensor.grad_fn is None or type(tensor) is not torch.Tensor:
        return tensor
    return tensor.detach()


class KeptTensor:
    """A saved tensor a pack hook left where it is: the tensor ``unlinked``, and its version then."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = unlinked(tensor)
        self.version = version(tensor)

    def get(self) -> torch.Tensor:
        """The tensor, for the backward; ``RuntimeError`` where it was written in place since it
        was saved (autograd's own check, which it makes only where no hooks are in place)."""
        tensor = self.tensor
        if version(tensor) != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{tensor.type()} {list(tensor.shape)}] is at version {version(tensor)}; expected version "
                f"{self.version} instead (chunkmem keeps autograd's saved tensors through saved-tensor hooks and makes "
                "the check autograd makes without them). Make the in-place operation out of place (x = x * 2 rather "
                "than x *= 2), or clone the tensor before it."
            )
        return tensor


class _Tracked(KeptTensor):
    """A kept tensor whose storage's bytes count in a ``LiveSaved`` while a handle holds it."""

    __slots__ = ("_key", "_live")

    def __init__(self, tensor: torch.Tensor, live: LiveSaved, key: int) -> None:
        super().__init__(tensor)
        self._live = live
        self._key = key

    def __del__(self) -> None:
        self._live.let_go(self._key)


class LiveSaved:
    """See the module docstring."""

    def __init__(self) -> None:
        self._storages: dict[int, list[int]] = {}  # storage -> [bytes, handles]
        self._bytes = 0
        self._peak = 0

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most held at once."""
        return self._peak

    def keep(self, tensor: torch.Tensor) -> KeptTensor:
        """The handle of ``tensor``, its storage counted until no handle holds it (the handle
        holds the storage, so its identity is not reused meanwhile)."""
        storage = tensor.untyped_storage()
        key = storage_id(storage)
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [storage.nbytes(), 1]
            self._grow(storage.nbytes())
        else:
            entry[1] += 1
        return _Tracked(tensor, self, key)

    def hold(self, owner: object, nbytes: int) -> None:
        """Count ``nbytes`` while ``owner`` lives."""
        self._grow(nbytes)
        weakref.finalize(owner, self._shrink, nbytes)

    def let_go(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self._shrink(entry[0])

    def _grow(self, nbytes: int) -> None:
        self._bytes += nbytes
        self._peak = max(self._peak, self._bytes)

    def _shrink(self, nbytes: int) -> None:
        self._bytes -= nbytes
