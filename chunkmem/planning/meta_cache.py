"""What a plan computes is shapes, and it computes the same ones again and again: the minimum
budget's search and the planned steps run the model's forward and backward several times on the
same example inputs, and PyTorch works out the output of most ops on the meta device in Python
(``torch._refs``, ``_prim_elementwise_meta``: about a millisecond an op, most of a plan's time).

``MetaResults`` remembers, for each functional op it has seen on meta tensors, the output that op
gave for those arguments (every tensor's shape, strides, storage offset and dtype; every other
argument's value and type; the default dtype, which some ops read) and makes the next call with
the same arguments an empty tensor of that layout. An op's meta output is a function of exactly
those (a meta tensor holds no values), so what a plan counts is unchanged; the first pass pays for
the kernels, the others do not.

Only ops that make fresh tensors are remembered: one that writes into an argument or returns a
view of one (an alias in its schema, or an output found to share an argument's storage, as
``_unsafe_view`` does without saying so: saved bytes are counted by storage) always runs, as does
any op on a tensor that is not on the meta device or whose class dispatches ops itself (a
subclass that refuses them must still refuse).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch import OpOverload, TorchDispatchMode, op_schema, storage_id

__all__ = ["MetaResults"]

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
# A key's leaf for a tensor: its layout (what a meta kernel reads of it).
_Layout = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]
# What a remembered op gives: one layout (container None), or a tuple or list of them (None where
# the op returns None).
_Result = tuple[type | None, tuple[_Layout | None, ...]]
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _fresh_results(func: OpOverload) -> bool:
    """Whether ``func`` neither writes into an argument nor returns an alias of one."""
    schema = op_schema(func)
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    return all(r.alias_info is None for r in schema.returns) and not schema.is_mutable


def _layout(tensor: torch.Tensor) -> _Layout:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype


def _key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The op and everything its meta kernel reads, or None where it cannot be remembered."""
    key: list[Any] = [func, torch.get_default_dtype(), len(args), *kwargs]
    if _add(key, args) and _add(key, kwargs.values()):
        return tuple(key)
    return None


def _add(key: list[Any], leaves: Any) -> bool:
    """Append what ``leaves`` say to a meta kernel to ``key``; False where one cannot be said."""
    for leaf in leaves:  # a loop, not pytree: this runs for every op
        if isinstance(leaf, torch.Tensor):
            if (
                leaf.device.type != "meta"
                or leaf.layout is not torch.strided
                or type(leaf).__torch_dispatch__ is not _PLAIN_DISPATCH
            ):
                return False
            key.append(_layout(leaf))
        elif isinstance(leaf, _SCALARS):
            key.append((type(leaf), leaf))  # True and 1, 1 and 1.0 promote differently
        elif isinstance(leaf, list | tuple):
            key.append((type(leaf), len(leaf)))
            if not _add(key, leaf):
                return False
        else:
            return False
    return True


def _storages(tensors: Any) -> list[int]:
    return [storage_id(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)]


def _own_storage(tensor: torch.Tensor, others: list[int]) -> bool:
    """Whether ``tensor`` is what an empty tensor of its layout would be: a meta tensor alone at
    the start of a storage of its own (not one of ``others``, the arguments' and earlier outputs')."""
    if tensor.device.type != "meta" or tensor.layout is not torch.strided or tensor.storage_offset() != 0:
        return False
    storage = storage_id(tensor.untyped_storage())
    if storage in others:
        return False
    others.append(storage)
    return True


def _made(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Result | None:
    """What to remember of ``result``, or None where an empty tensor would not stand for it."""
    taken = _storages(_leaves(args)) + _storages(_leaves(kwargs.values()))
    if isinstance(result, torch.Tensor):
        return (None, (_layout(result),)) if _own_storage(result, taken) else None
    if isinstance(result, tuple | list) and all(r is None or isinstance(r, torch.Tensor) for r in result):
        if not all(r is None or _own_storage(r, taken) for r in result):
            return None
        return type(result), tuple(None if r is None else _layout(r) for r in result)
    return None


def _leaves(values: Any) -> list[Any]:
    found = []
    for value in values:
        found.extend(_leaves(value) if isinstance(value, list | tuple) else [value])
    return found


def _empty(layout: _Layout | None) -> torch.Tensor | None:
    if layout is None:
        return None
    shape, stride, _, dtype = layout  # a fresh tensor starts its storage
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


# Shared by every plan in the process (a search over budgets or models plans the same layers again),
# dropped whole when it holds this many results: a few hundred bytes each.
_LIMIT = 100_000
_SEEN: dict[tuple[Any, ...], _Result | None] = {}
_FRESH: dict[Any, bool] = {}


class MetaResults(TorchDispatchMode):
    """While entered: functional ops on meta tensors answered from what the same op gave for the
    same arguments before, in this plan or an earlier one (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen = _SEEN
        self._fresh = _FRESH
        self.hits = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = isinstance(func, OpOverload) and _fresh_results(func)
        key = _key(func, args, kwargs) if fresh else None
        if key is None:
            return func(*args, **kwargs)
        try:
            made = self._seen[key]
        except KeyError:
            result = func(*args, **kwargs)
            if len(self._seen) >= _LIMIT:
                self._seen.clear()
            self._seen[key] = _made(result, args, kwargs)
            return result
        except TypeError:  # an argument that cannot be hashed
            return func(*args, **kwargs)
        if made is None:
            return func(*args, **kwargs)
        self.hits += 1
        container, layouts = made
        if container is None:
            return _empty(layouts[0])
        return container([_empty(layout) for layout in layouts])
