"""``HookedParameter``: an ``nn.Parameter`` whose torch ops call the active parameter-op hooks.

Metadata queries (shape, dtype, device, ``.grad``...) run unhooked: they never need the
parameter's values. Every other op (reading ``.data`` included) calls ``pre_op`` / ``post_op``
with the hooked parameters among its arguments and, when it records autograd history, is bridged
(``hooks.bridges``) so that ``pre_backward`` / ``post_backward`` fire around its backward. Its
outputs are never views of a hooked parameter: a hook may move or free the parameter's storage
after the op, so a view (``p.data``, ``p.detach()``, ``w.T``, ``w[:n]``) comes back as a
:class:`ValueCopy`, which refuses in-place writes: in plain PyTorch a write through it would change
the parameter, here it would be lost. Hooks that do not observe ops
(``ParamOpHook.observes_ops``) are only asked about in-place writes, and the op runs as on a plain
parameter (views are views).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..compat.torch import (
    TENSOR_IS_VIEW,
    TRACING_CONTEXT,
    disable_torch_function_subclass,
    tree_flatten,
    tree_map_only,
    tree_unflatten,
)
from .bridges import OpBackward, PreForwardPostBackward
from .hook import ParamOpHook, hooks_for

__all__ = ["HookedParameter", "ValueCopy", "to_hooked", "to_plain", "unhooked"]


def unhooked() -> Any:
    """A context in which hooked parameters behave like plain ones: what a hook uses to read or
    swap a parameter's ``.data`` without calling hooks again."""
    return disable_torch_function_subclass()


_METADATA_METHODS = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.stride,
    torch.Tensor.element_size,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.storage_offset,
    torch.Tensor.get_device,
    torch.Tensor.requires_grad_,
    torch.Tensor.retain_grad,
    torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.__len__,
    torch.Tensor.__reduce_ex__,
    torch.Tensor.__setstate__,
    torch.Tensor.__deepcopy__,
    TENSOR_IS_VIEW,
}
# Properties that read or write the values, unlike shape/dtype/device/grad. Reading ``.data`` is an
# op like any other (a hook may hold the values elsewhere between ops: the reader gets a copy);
# assigning it writes the parameter.
_DATA_PROPERTIES = {"data", "T", "mT", "H", "mH", "real", "imag"}


def _is_metadata(func: Any) -> bool:
    if func in _METADATA_METHODS:
        return True
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        descriptor = getattr(func, "__self__", None)
        return getattr(descriptor, "__name__", None) not in _DATA_PROPERTIES
    return False


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors that ``func`` writes into in place: the first argument of an in-place function
    (``p.mul_``, ``torch.nn.init.normal_(tensor=p)``, which passes it by keyword, each tensor of a
    ``torch._foreach_*_`` list, an ``inplace=True`` functional), ``out=``, an assigned property such
    as ``.data``."""
    name = getattr(func, "__name__", "").split(".")[0]  # torch.ops overloads: "add_.Tensor"
    targets: list[Any] = []
    if (
        (name.endswith("_") and not name.startswith("__"))
        or name in _INPLACE_DUNDERS
        or name == "__set__"
        or kwargs.get("inplace") is True
    ):
        first = args[0] if args else next(iter(kwargs.values()), None)
        targets.extend(first if isinstance(first, tuple | list) else [first])
    out = kwargs.get("out")
    if out is not None:
        targets.extend(out if isinstance(out, tuple | list) else [out])
    return [t for t in targets if isinstance(t, torch.Tensor)]


_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
}  # fmt: skip


_CONTAINERS = (list, tuple, dict)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """Leaves of an op's arguments; flat arguments (the common case) skip pytree."""
    leaves = [*args, *kwargs.values()]
    for leaf in leaves:  # a loop: this runs for every op, and a generator costs more
        if isinstance(leaf, _CONTAINERS):
            return tree_flatten((args, kwargs))
    return leaves, None


def _unflatten(leaves: list[Any], spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if spec is not None:
        return tree_unflatten(leaves, spec)
    n = len(args)
    return tuple(leaves[:n]), dict(zip(kwargs, leaves[n:], strict=True))


class HookedParameter(torch.nn.Parameter):
    """A parameter whose ops call the hooks of ``hooks.hooks_for``. Create one by converting an
    existing parameter in place with :func:`to_hooked` (identity, ``requires_grad`` and every
    reference to it are kept)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _compiler_tracing():
            _report_tracing(args, kwargs)
        if _is_metadata(func):
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        leaves, spec = _flatten(args, kwargs)
        params = _hooked_params(leaves)
        calls = hooks_for(params)
        with disable_torch_function_subclass():
            if not calls:
                return func(*args, **kwargs)
            written = _guard_writes(func, args, kwargs, calls)
            observing = [call for call in calls if call[0].observes_ops]
            if not observing:
                return func(*args, **kwargs)
            return _run_hooked(func, args, kwargs, leaves, spec, params, tuple(observing), written)


def _compiler_tracing() -> bool:
    """A compiler is building a graph. ``is_compiling`` is True only in code Dynamo traces
    symbolically, where a hook's exception becomes a graph break and the op then runs eagerly with
    it False (torch <= 2.12). The metadata Dynamo reads for real while it wraps a parameter (size,
    stride, ``.data``) runs inside its ``TracingContext``: an exception there ends the compile
    wherever it is raised."""
    if torch.compiler.is_compiling():
        return True
    return TRACING_CONTEXT is not None and TRACING_CONTEXT.try_get() is not None


def _hooked_params(leaves: list[Any]) -> list[torch.Tensor]:
    """The hooked parameters among ``leaves``, each once."""
    params: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, HookedParameter) and not any(leaf is p for p in params):
            params.append(leaf)
    return params


def _report_tracing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    params = _hooked_params(_flatten(args, kwargs)[0])
    with disable_torch_function_subclass():
        for hook, seen in hooks_for(params):
            hook.traced_op(seen)


def _guard_writes(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    calls: tuple[tuple[ParamOpHook, tuple[torch.Tensor, ...]], ...],
) -> list[torch.Tensor]:
    """Ask each hook about the parameters it sees that ``func`` writes in place; returns what
    ``func`` writes."""
    written = _written(func, args, kwargs)
    if written:
        name = _op_name(func)
        _refuse_writes_into_copies(written, name)
        for hook, seen in calls:
            mutated = [t for t in written if any(t is p for p in seen)]
            if mutated:
                hook.mutating_op(mutated, name)
    return written


def _op_name(func: Any) -> str:
    return getattr(func, "__name__", repr(func))


def _refuse_writes_into_copies(written: list[torch.Tensor], op_name: str) -> None:
    for target in written:
        if isinstance(target, ValueCopy):
            target.refuse_write(op_name)


def _run_hooked(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any],
    spec: Any,
    params: list[torch.Tensor],
    calls: tuple[tuple[ParamOpHook, tuple[torch.Tensor, ...]], ...],
    written: list[torch.Tensor],
) -> Any:
    grad_inputs = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not any(leaf is w for w in written)
    ]
    recording = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
    op = OpBackward(calls) if recording else None
    for hook, seen in calls:
        hook.pre_op(seen)
    try:
        if op is not None and grad_inputs:
            aliases = PreForwardPostBackward.apply(op, *(leaves[i] for i in grad_inputs))
            for i, alias in zip(grad_inputs, aliases, strict=True):
                leaves[i] = alias
            args, kwargs = _unflatten(leaves, spec, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            out_leaves: list[Any] = [out]
            if _unalias(out_leaves, params):
                out = out_leaves[0]
        else:
            out_leaves, out_spec = tree_flatten(out)
            if _unalias(out_leaves, params):
                out = tree_unflatten(out_leaves, out_spec)
    finally:
        for hook, seen in calls:
            hook.post_op(seen)
    if op is not None:
        op.hook_outputs(out_leaves, end_on_node=not grad_inputs)
    return out


def _unalias(leaves: list[Any], params: list[torch.Tensor]) -> bool:
    """Replace, in ``leaves``, outputs that are views of a hooked parameter (``w.T``, ``w[:n]``,
    ``w.view(...)``, ``w.data``) with :class:`ValueCopy` copies: a hook may free or move the
    parameter's storage after the op, and the view must outlive that. An in-place op that returns
    the parameter itself is left alone. Returns whether anything was replaced."""
    storages = {p.untyped_storage().data_ptr() for p in params}
    storages.discard(0)
    changed = False
    for i, leaf in enumerate(leaves):
        if (
            isinstance(leaf, torch.Tensor)
            and not any(leaf is p for p in params)
            and leaf.untyped_storage().data_ptr() in storages
        ):
            leaves[i] = ValueCopy.of(leaf, params)
            changed = True
    return changed


class ValueCopy(torch.Tensor):
    """A copy of (part of) a hooked parameter's values, standing where plain PyTorch returns a
    view of the parameter (module docstring). Reading it, and any op on it, works as on a plain
    tensor: results are plain tensors, and so are its ``clone()``, deep copies and pickles, except
    its own views (``p.data[0]``, ``p.detach().view(-1)``), which are copies of the parameter too.
    An in-place write into it or its views is refused: it would change the copy and not the
    parameter. The parameters' hooks are asked first (``ParamOpHook.mutating_op``), so that their
    message can name them."""

    _sources: tuple[weakref.ref[torch.Tensor], ...]

    @staticmethod
    def of(values: torch.Tensor, sources: Iterable[torch.Tensor]) -> ValueCopy:
        copy = values.clone().as_subclass(ValueCopy)
        copy._sources = tuple(weakref.ref(p) for p in sources)
        return copy

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _is_metadata(func):
            _refuse_writes_into_copies(_written(func, args, kwargs), _op_name(func))
        if any(t is not ValueCopy for t in types):
            return NotImplemented  # another subclass takes part (a hooked parameter: its hooks must run)
        with disable_torch_function_subclass():
            out = func(*args, **kwargs)
            copies = {
                leaf.untyped_storage().data_ptr(): leaf
                for leaf in _flatten(args, kwargs)[0]
                if isinstance(leaf, ValueCopy) and leaf.untyped_storage().data_ptr() != 0
            }
            return tree_map_only(torch.Tensor, lambda t: ValueCopy._as_view(t, copies), out) if copies else out

    @staticmethod
    def _as_view(tensor: torch.Tensor, copies: dict[int, ValueCopy]) -> torch.Tensor:
        """``tensor`` as a copy of the same parameters when it aliases one of ``copies``."""
        if type(tensor) is not torch.Tensor:
            return tensor
        source = copies.get(tensor.untyped_storage().data_ptr())
        if source is None:
            return tensor
        view = tensor.as_subclass(ValueCopy)
        view._sources = source._sources
        return view

    def refuse_write(self, op_name: str) -> None:
        """Raise: ``op_name`` writes into this copy."""
        what = f"{op_name} through a copy of its values (p.data, p.detach() or a view of p)"
        sources = [p for p in (ref() for ref in self._sources) if p is not None]
        if sources:
            with disable_torch_function_subclass():
                for hook, seen in hooks_for(sources):
                    hook.mutating_op(seen, what)
        shapes = [tuple(p.shape) for p in sources]
        raise RuntimeError(
            f"in-place op {what} refused: the parameter(s) of shape {shapes} are hooked, and between ops their "
            "storage may be moved or freed, so p.data, p.detach() and views of p are copies; the write would "
            "change the copy and not the parameter"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        # Like Tensor.__deepcopy__: a new leaf with the same requires_grad.
        with disable_torch_function_subclass(), torch.no_grad():
            copy = self.as_subclass(torch.Tensor).detach().clone()
        copy.requires_grad_(self.requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol: Any) -> Any:
        with disable_torch_function_subclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def to_hooked(params: Iterable[torch.nn.Parameter]) -> None:
    """Turn parameters into ``HookedParameter`` in place (same objects)."""
    for p in params:
        if not isinstance(p, torch.nn.Parameter):
            raise TypeError(f"to_hooked: expected nn.Parameter, got {type(p).__name__}")
        if type(p) is not torch.nn.Parameter and not isinstance(p, HookedParameter):
            raise TypeError(
                f"to_hooked: cannot hook a {type(p).__name__} (a parameter subclass with its own "
                "behaviour); only plain nn.Parameter objects can be hooked"
            )
        p.__class__ = HookedParameter


def to_plain(params: Iterable[torch.nn.Parameter]) -> None:
    """Undo :func:`to_hooked`."""
    for p in params:
        if isinstance(p, HookedParameter):
            p.__class__ = torch.nn.Parameter
