"""What ``p.grad`` shows on a boosted parameter.

chunkmem adds each gradient into its chunk's flat buffer and reduce-scatters it, so a parameter
never holds a full gradient of its own. Left at ``None``, ``p.grad`` would make code written for
plain PyTorch silently wrong: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` would
find no gradient, return 0 and clip nothing. So after autograd accumulates a gradient for a
trainable parameter, its ``.grad`` becomes a :class:`ShardedGradient`: a tensor with the
parameter's shape, dtype and device but no storage, which raises :class:`ShardedGradientError`
(naming ``optimizer.clip_grad_norm``) on any use of its values. Code that only asks whether a
parameter got a gradient (``p.grad is not None``) keeps working, as in plain PyTorch.

A marker is removed before autograd accumulates the next gradient into the parameter (so the
next backward, gradient accumulation and recomputation under activation checkpointing see no
existing gradient), and by ``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from chunkmem.hooks import unhooked

from ..compat.torch import disable_torch_function_subclass, make_wrapper_subclass
from ..errors import ShardedGradientError

__all__ = ["GradientMarkers", "ShardedGradient", "clear_markers"]

_ALLOWED = frozenset({"__get__", "__repr__", "__format__", "size", "dim", "numel", "__len__"})


class ShardedGradient(torch.Tensor):
    """A storage-less stand-in for a gradient that lives sharded in chunks (module docstring)."""

    _name: str
    _message: ClassVar[str] = (
        "chunkmem keeps gradients sharded across ranks in flat chunk buffers: the .grad of a boosted "
        "parameter holds no values. Clip with optimizer.clip_grad_norm(max_norm, norm_type) (it returns the "
        "total norm over all ranks, like torch.nn.utils.clip_grad_norm_); for evaluation on full weights use "
        "model.plain_copy()."
    )

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str) -> ShardedGradient:
        marker = make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False)
        marker._name = name
        return marker

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"ShardedGradient('{self._name}', shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _ALLOWED:
            with disable_torch_function_subclass():
                return func(*args, **(kwargs or {}))
        markers = [a for a in args if isinstance(a, ShardedGradient)]
        if not markers:
            markers = [a for a in args if isinstance(a, list | tuple) for a in a if isinstance(a, ShardedGradient)]
        which = f" of '{markers[0]._name}'" if markers else ""
        raise ShardedGradientError(f"{name or func} on the gradient{which} refused: {cls._message}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        raise ShardedGradientError(f"{func} on a chunkmem gradient refused: {cls._message}")


def clear_markers(params: Iterable[torch.Tensor]) -> None:
    """``p.grad = None`` for each parameter whose ``.grad`` is a marker (``zero_grad``)."""
    with unhooked():  # .grad read and set without a round trip through each parameter's hooks
        for p in params:
            if isinstance(p.grad, ShardedGradient):
                p.grad = None


class GradientMarkers:
    """Puts a :class:`ShardedGradient` on each trainable parameter once autograd accumulated a
    gradient for it, and takes it off before the next accumulation. Registered after the runtime's
    own gradient hook, so the runtime has already taken the gradient into its chunk."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._handles: list[RemovableHandle] = []
        for name, param in named:
            if not param.requires_grad:
                continue
            marker = ShardedGradient(param, name)
            self._handles.append(param.register_hook(_clearer(param)))
            self._handles.append(param.register_post_accumulate_grad_hook(_setter(marker)))

    def remove(self) -> None:
        """Stop marking (the hooks are removed; markers in place stay until ``zero_grad``)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# Both run for every gradient of every parameter: ``unhooked`` reads and sets ``.grad`` without a
# round trip through the parameter's ``__torch_function__``.


def _clearer(param: torch.Tensor) -> Any:
    def clear(grad: torch.Tensor) -> None:
        with unhooked():
            if isinstance(param.grad, ShardedGradient):
                param.grad = None

    return clear


def _setter(marker: ShardedGradient) -> Any:
    def mark(param: torch.Tensor) -> None:
        # Only where the runtime took the gradient away: never hide a real gradient.
        with unhooked():
            if param.grad is None:
                param.grad = marker

    return mark
