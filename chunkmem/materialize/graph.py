"""``OpGraph``: what was done to tensors on the meta device, kept so that any one of them can be
computed for real later, on its own.

A meta tensor has a shape but no values. While a model's own initialisation runs on the meta
device (see ``recorder``), every aten op that touches a meta tensor is kept as a :class:`Node`: the
op, its arguments with each meta tensor replaced by a :class:`TensorRef` (which storage, at which
version, seen through which view), and, for an op that draws random numbers, the generator's state
just before it (the draws are made for real at recording time, so the next op sees the generator
where the same run on the CPU would have left it).

The unit is the storage, as in torch: views share one. A storage is made by one op (its creator,
or none when it existed before recording) and changed by the in-place ops that write it, in order;
version ``v`` is its value after the first ``v`` writes. Replaying (``replay``) the creator and the
writes of one storage, with the recorded generator states, gives the same values the CPU would
have computed, without computing anything else.

Each storage also knows, per version, whether its values are *defined*: made by an op from defined
inputs, or fully overwritten by one (``fill_``, ``normal_``, ``copy_``...). A storage that existed
before recording, or came from ``torch.empty``, is undefined until then. Replaying an undefined
value would read memory nobody wrote, so callers check ``defined`` first and refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.torch import TRUNC_NORMAL_HELPER, storage_id, tree_leaves

__all__ = ["Const", "Node", "OpGraph", "RngSnapshot", "StorageRecord", "TensorRef"]


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A meta tensor as an op saw it: a view of ``storage`` at ``version``."""

    storage: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @property
    def nbytes_viewed(self) -> int:
        numel = 1
        for s in self.size:
            numel *= s
        return numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Const:
    """A real tensor an op read next to meta ones (``torch.tensor(data)`` moved to meta, a scalar
    tensor): kept as a copy, since the program may change the original afterwards."""

    value: torch.Tensor


@dataclass(frozen=True, slots=True)
class RngSnapshot:
    """A generator's state before a random op: ``generator`` is ``None`` for torch's default CPU
    generator, else the generator object the op was given."""

    state: torch.Tensor
    generator: torch.Generator | None


@dataclass(eq=False, slots=True)
class Node:
    """One recorded op. ``args`` / ``kwargs`` hold ``TensorRef`` / ``Const`` where the op had tensors."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngSnapshot | None
    random: bool
    """Draws random numbers (replayable only when ``rng`` was taken)."""

    @property
    def name(self) -> str:
        if hasattr(self.func, "overloadpacket"):
            return str(self.func)
        return f"{getattr(self.func, '__module__', '')}.{getattr(self.func, '__name__', self.func)}"

    def refs(self) -> list[TensorRef]:
        return [leaf for leaf in tree_leaves((self.args, self.kwargs)) if isinstance(leaf, TensorRef)]


@dataclass(eq=False, slots=True)
class StorageRecord:
    """One meta storage: how it was made and every write to it, in order."""

    index: int
    nbytes: int
    creator: tuple[Node, int] | None
    """The op that made it and which of its tensor outputs (flattened) it is; ``None`` when the
    storage existed before recording (its values are unknown)."""
    writes: list[tuple[Node, TensorRef]] = field(default_factory=list)
    """In-place ops that wrote it, with the view of it they wrote."""
    overwrites: list[bool] = field(default_factory=list)
    """Per write: it replaced every byte without reading what was there (from defined inputs)."""
    defined: list[bool] = field(default_factory=list)
    """``defined[v]``: whether version ``v`` holds only values some recorded op computed."""

    @property
    def version(self) -> int:
        """The current version (number of writes so far)."""
        return len(self.writes)

    def describe(self) -> str:
        made = "existed before recording" if self.creator is None else f"made by {self.creator[0].name}"
        writes = ", ".join(node.name for node, _ in self.writes) or "none"
        return f"storage of {self.nbytes} bytes ({made}; writes: {writes})"


# In-place ops whose result does not depend on what the written tensor held before (the first
# argument is the written tensor), and torch initialisers recorded as whole calls (they write the
# whole tensor). An op on this list that covers a whole storage defines it.
_OVERWRITES = {
    TRUNC_NORMAL_HELPER,
    "orthogonal_",
    "sparse_",
    "dirac_",
    "fill_",
    "zero_",
    "normal_",
    "uniform_",
    "copy_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
}
# Creators whose output holds whatever memory was there.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}


def _op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(packet))


class OpGraph:
    """The storages seen while recording and the ops that made and changed them."""

    def __init__(self) -> None:
        self._storages: list[StorageRecord] = []
        self._index: dict[int, int] = {}
        # Meta storages are kept alive so that a freed one's address is never taken for another.
        self._alive: list[torch.UntypedStorage] = []

    @property
    def storages(self) -> Sequence[StorageRecord]:
        return self._storages

    def storage(self, index: int) -> StorageRecord:
        return self._storages[index]

    def knows(self, tensor: torch.Tensor) -> bool:
        return storage_id(tensor.untyped_storage()) in self._index

    def ref(self, tensor: torch.Tensor) -> TensorRef:
        """``tensor`` (on meta) as a view of its storage at its current version; a storage never
        seen before is added as one that existed before recording (values unknown)."""
        storage = tensor.untyped_storage()
        index = self._index.get(storage_id(storage))
        if index is None:
            index = self._add(storage, None)
        return TensorRef(
            storage=index,
            version=self._storages[index].version,
            size=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            offset=tensor.storage_offset(),
            dtype=tensor.dtype,
        )

    def _add(self, storage: torch.UntypedStorage, creator: tuple[Node, int] | None) -> int:
        index = len(self._storages)
        # A storage that existed before recording starts undefined; a created one is decided by
        # ``add_creation``.
        self._storages.append(StorageRecord(index, storage.nbytes(), creator, defined=[] if creator else [False]))
        self._index[storage_id(storage)] = index
        self._alive.append(storage)
        return index

    def is_defined(self, ref: TensorRef) -> bool:
        """Whether the values ``ref`` saw were all computed by recorded ops."""
        record = self._storages[ref.storage]
        return record.defined[ref.version]

    def replay_start(self, index: int, version: int) -> int | None:
        """The last write before ``version`` that replaced the whole storage, from which replaying
        may start on any memory (what came before it cannot show); ``None`` if there is none."""
        overwrites = self._storages[index].overwrites[:version]
        return max((i for i, full in enumerate(overwrites) if full), default=None)

    def starts_uninitialised(self, index: int) -> bool:
        """Made by ``torch.empty``-like ops (or existed before recording): its first bytes are
        whatever memory held."""
        creator = self._storages[index].creator
        return creator is None or _op_name(creator[0].func) in _UNINITIALISED

    def _inputs_defined(self, node: Node, skip: TensorRef | None = None) -> bool:
        return all(self.is_defined(r) for r in node.refs() if r is not skip)

    def add_creation(self, node: Node, index: int, tensor: torch.Tensor) -> None:
        """``tensor`` (on meta) is the ``index``-th tensor output of ``node`` and owns a new storage."""
        record = self._storages[self._add(tensor.untyped_storage(), (node, index))]
        made = _op_name(node.func) not in _UNINITIALISED and self._inputs_defined(node)
        record.defined.append(made)

    def add_write(self, node: Node, written: TensorRef) -> None:
        """``node`` wrote the view ``written`` (its version is the one before the write)."""
        record = self._storages[written.storage]
        covers = written.offset == 0 and written.nbytes_viewed == record.nbytes and _dense(written)
        overwrite = covers and _op_name(node.func) in _OVERWRITES
        before = record.defined[written.version]
        others = self._inputs_defined(node, skip=written)
        record.writes.append((node, written))
        record.overwrites.append(overwrite and others)
        record.defined.append((overwrite or before) and others)


def _dense(ref: TensorRef) -> bool:
    """Non-overlapping and without gaps (any order of dimensions)."""
    dims = sorted((st, sz) for sz, st in zip(ref.size, ref.stride, strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
