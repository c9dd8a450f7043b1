"""``SavedCount``: the one rule by which what autograd saves inside one call of a named block is
counted, used by the runtime (the offload's and the keep hooks: ``ActivationOffload``, ``AutoBlocks``)
and by the planner (``forecast``, on meta tensors), so that a plan's figures are a run's.

* **Model memory** is left as it is and never counted: a parameter, a view of one, a tensor
  subclass (the runtime's parameters), or a tensor sharing the storage of the block's parameters or
  buffers (chunk memory the runtime gathered for the op). Storages are told apart by identity,
  which a meta tensor has too (it has no address).
* **Every other storage** counts once per call (``saved_bytes``), however many of its views are
  saved and however often (a tensor saved twice). A storage freed inside the call and another made
  where it was are two.
* Of those, a storage smaller than ``min_offload_bytes`` or not a whole number of elements stays on
  the device (``small_bytes``); the others are what an offload copies, once per storage version
  (``copied_bytes``: a storage written in place between two saves is copied twice).
* A call placed by a plan (``limit``) keeps and copies within the figures the plan accounts for
  it: a storage that would overrun its own side goes to the other where that has room (a shorter
  step than the measured one has storages under ``min_offload_bytes`` that the measured step
  copied; they are copied still).
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..compat.torch import storage_id, version, view_base

__all__ = ["Saved", "SavedCount", "is_model_memory", "storage_key"]


class Saved(enum.Enum):
    """What one saved tensor is, by the rule of the module docstring."""

    MODEL = "model memory"
    """Left as it is; not counted."""
    SMALL = "small"
    """Counted; stays on the device."""
    COPY = "copy"
    """Counted; this version of its storage is copied for the first time in the call."""
    COPIED = "copied"
    """A copy made earlier in the call serves it."""


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of the tensor's storage (shared by every view of it)."""
    return storage_id(tensor.untyped_storage())


def is_model_memory(module: torch.nn.Module, tensor: torch.Tensor) -> bool:
    """Whether a tensor saved in a call of ``module`` is model memory (see the module docstring)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return True
    if isinstance(view_base(tensor), torch.nn.Parameter):
        return True
    key = storage_key(tensor)
    return any(storage_key(t) == key for t in (*module.parameters(), *module.buffers()))


class SavedCount:
    """What one call of ``module`` saved so far; ``add`` classifies and counts each saved tensor."""

    def __init__(self, module: torch.nn.Module, min_offload_bytes: int) -> None:
        self._module = module
        self._min_bytes = min_offload_bytes
        # key -> (weak ref, versions copied, whether it stays on the device)
        self._storages: dict[int, tuple[Any, set[int], bool]] = {}
        self._limits: tuple[int, int] | None = None  # (kept, copied) bytes the call's plan accounts
        self.saved_bytes = 0
        """Bytes saved apart from model memory, each storage once."""
        self.small_bytes = 0
        """Of those, the storages that stay on the device."""
        self.copied_bytes = 0
        """Of those, what an offload copies (once per storage version)."""

    def add(self, tensor: torch.Tensor) -> Saved:
        if is_model_memory(self._module, tensor):
            return Saved.MODEL
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = storage_id(storage)
        seen = self._storages.get(key)
        if seen is None or seen[0].expired():  # new, or made where one saved earlier was freed
            stays = self._stays(nbytes, whole=nbytes % tensor.element_size() == 0)
            seen = self._storages[key] = (StorageWeakRef(storage), set(), stays)
            self.saved_bytes += nbytes
            if stays:
                self.small_bytes += nbytes
        if seen[2]:
            return Saved.SMALL
        if version(tensor) in seen[1]:
            return Saved.COPIED
        seen[1].add(version(tensor))
        self.copied_bytes += nbytes
        return Saved.COPY

    def limit(self, kept: int, copied: int) -> None:
        """Keep at most ``kept`` and copy at most ``copied`` bytes where a storage can go either way
        (the figures the call's plan accounts for it)."""
        self._limits = (kept, copied)

    def _stays(self, nbytes: int, whole: bool) -> bool:
        small = nbytes < self._min_bytes or not whole
        if self._limits is None or not whole:  # a storage of no whole number of elements is not copied
            return small
        kept_room, copy_room = self._limits[0] - self.small_bytes, self._limits[1] - self.copied_bytes
        if small and nbytes > kept_room and nbytes <= copy_room:
            return False
        if not small and nbytes > copy_room and nbytes <= kept_room:
            return True
        return small
