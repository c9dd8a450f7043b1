"""``SavedMeter``: the bytes autograd holds for the backward (saved activations), measured with
saved-tensor hooks, the same way for every system the activations benchmark compares.

While ``hooks()`` is entered, every tensor an op saves passes through the meter. A parameter, a
view of one, or a tensor sharing a parameter's storage is model data and is not counted. Any other
saved tensor counts its whole storage, once however many saved tensors (or views) share it, from
the moment it is first saved until autograd drops the last of them (after the backward of the
node that saved it, or when the graph is freed). ``live`` is that sum now; ``peak`` its highest
value since ``reset_peak()``.

What the meter does not see: what a saved-tensor hook nearer the op keeps (a checkpoint's
recomputation in the backward, a ``chunkmem`` offloaded block's copies), activation gradients and
other transient working memory. The activations benchmark adds what those hold on the device where
it matters (see its module docstring).

``hooks(tag)`` entered inside another ``hooks()`` (a block's forward pre-hook) also sums, per tag,
what is saved while it is the innermost: the bytes one block call saves.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SavedMeter", "block_saved_bytes"]


class _Held:
    """What autograd keeps for a counted tensor: the tensor, and the meter's count of its storage
    (dropped when autograd drops this)."""

    __slots__ = ("_key", "_meter", "tensor")

    def __init__(self, meter: SavedMeter, key: int, tensor: torch.Tensor) -> None:
        self._meter = meter
        self._key = key
        self.tensor = tensor

    def __del__(self) -> None:
        self._meter._release(self._key)


class SavedMeter:
    """Live and peak bytes of saved non-parameter storages; see the module docstring."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        # Plain parameters only: a tensor subclass (FSDP2's sharded DTensor, a chunkmem parameter)
        # has no storage of its own to compare, and what its ops save is a Parameter or a view of one.
        self._model_storages = {p.untyped_storage().data_ptr() for p in parameters if type(p) is torch.nn.Parameter}
        self._holders: dict[int, int] = {}  # storage -> saved tensors that hold it
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.by_tag: dict[str, int] = defaultdict(int)
        self._tags: list[str | None] = []

    def reset_peak(self) -> None:
        self.peak = self.live

    def _is_model_data(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return True
        if tensor.layout is not torch.strided or tensor.is_meta:
            return True  # no storage of its own to count
        return tensor.untyped_storage().data_ptr() in self._model_storages

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._is_model_data(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._holders:
            self._holders[key] = 0
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            tag = self._tags[-1] if self._tags else None
            if tag is not None:
                self.by_tag[tag] += storage.nbytes()
        self._holders[key] += 1
        return _Held(self, key, tensor)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Held) else saved

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._sizes.pop(key)

    @contextmanager
    def hooks(self, tag: str | None = None) -> Iterator[None]:
        self._tags.append(tag)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._tags.pop()


def block_saved_bytes(model: torch.nn.Module, blocks: list[torch.nn.Module], run: Any) -> tuple[int, int]:
    """The most bytes one call of one of ``blocks`` saves (outside checkpoints) while ``run()``
    runs a forward of ``model``, and the bytes saved outside every block call (each storage once,
    counted where it was first saved); the graph is dropped."""
    meter = SavedMeter(model.parameters())
    contexts: list[Any] = []
    calls = itertools.count()

    def enter(module: torch.nn.Module, args: Any) -> None:
        contexts.append(meter.hooks(tag=f"call {next(calls)}"))
        contexts[-1].__enter__()

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        contexts.pop().__exit__(None, None, None)

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        with meter.hooks():
            out = run()
        del out
    finally:
        for handle in handles:
            handle.remove()
    # Nothing is released before the graph is dropped: the peak is every saved storage.
    return max(meter.by_tag.values(), default=0), meter.peak - sum(meter.by_tag.values())
