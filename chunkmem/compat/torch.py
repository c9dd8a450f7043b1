"""torch's private names that chunkmem reads. Checked on torch 2.13 (CPU and CUDA builds).

Tensors and storages (identity, version counter, view base), op schemas, dispatch modes, pytree,
the autograd engine's state, ``nn.Module`` internals, Dynamo's tracing state and two names torch
saves or calls that start with an underscore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten

__all__ = [
    "CHAINED_SCHEDULERS_KEY",
    "SEES_SAVED_TENSOR_HOOKS",
    "TENSOR_IS_VIEW",
    "TRACING_CONTEXT",
    "TRUNC_NORMAL_HELPER",
    "IncompatibleKeys",
    "ModuleConversionHook",
    "OpOverload",
    "TorchDispatchMode",
    "autograd_running",
    "disable_current_modes",
    "disable_torch_function_subclass",
    "dynamo_supported",
    "is_checkpoint_hook",
    "make_wrapper_subclass",
    "op_schema",
    "own_reset_method",
    "parse_to",
    "set_parameter_entry",
    "storage_id",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
    "version",
    "view_base",
]

# --- re-exported from private modules ------------------------------------------------------------
# ``torch.utils._pytree`` (tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten): the
# structure walk torch's own dispatch code uses, which knows torch's containers (torch has no public
# pytree module in 2.13). ``torch.utils._python_dispatch.TorchDispatchMode``: the documented base of
# a dispatch mode (the recorder, the meta cache, the simulated device's checker), in a private module.

disable_current_modes = _disable_current_modes
"""``torch.utils._python_dispatch._disable_current_modes``: a context in which no dispatch mode is
active, for the simulated device's own bookkeeping ops (which its checker must not see)."""

IncompatibleKeys = _IncompatibleKeys
"""``torch.nn.modules.module._IncompatibleKeys``: the named tuple ``nn.Module.load_state_dict``
returns; ``ChunkedModel.load_state_dict`` returns the same type as plain PyTorch."""

OpOverload = torch._ops.OpOverload
"""``torch._ops.OpOverload``: the type of an aten op as a dispatch mode receives it (``aten.add.Tensor``)."""

disable_torch_function_subclass = torch._C.DisableTorchFunctionSubclass
"""``torch._C.DisableTorchFunctionSubclass``: a context in which a tensor subclass's
``__torch_function__`` is not called (what ``torch.Tensor.__torch_function__`` itself enters), so a
hook runs an op on a hooked parameter as a plain tensor without calling hooks again."""

TENSOR_IS_VIEW = torch.Tensor._is_view
"""``torch.Tensor._is_view``: a metadata method that reaches ``__torch_function__``; the hooked
parameter answers it without gathering."""

CHAINED_SCHEDULERS_KEY = "_schedulers"
"""The key under which ``ChainedScheduler`` and ``SequentialLR`` save their inner schedulers'
states in ``state_dict()`` (their private attribute's name); a load checks the counts agree."""

TRUNC_NORMAL_HELPER = "_no_grad_trunc_normal_"
"""The private helper ``nn.init.trunc_normal_`` calls (the one that skips meta tensors and writes
the whole tensor): the materializer records it as one call."""


# --- tensors, storages, ops ----------------------------------------------------------------------
def storage_id(storage: torch.UntypedStorage) -> int:
    """``storage._cdata``: the address of the storage's C++ object, the same for every view and every
    Python wrapper of one storage, meta storages included (which have no data address). chunkmem
    tells storages apart by it (saved activations counted once per storage, the materializer's
    graph, the simulated device's checker); it is reused only after the storage is freed."""
    return storage._cdata


def version(tensor: torch.Tensor) -> int:
    """``tensor._version``: the version counter an in-place write bumps (shared by the views of one
    storage), which autograd checks before using a saved tensor; chunkmem makes the same check on
    the tensors it keeps, and copies a storage once per version."""
    return tensor._version


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor._base``: the tensor a view was made from (``None`` for a tensor that is no view), to
    tell a view of a parameter (model memory) from an activation."""
    return tensor._base


def op_schema(func: Any) -> Any:
    """``func._schema`` of an ``OpOverload``: its ``torch._C.FunctionSchema``, whose arguments'
    ``alias_info`` says which ones the op writes or returns aliases of."""
    return func._schema


def make_wrapper_subclass(cls: type[torch.Tensor], shape: torch.Size, **kwargs: Any) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor of ``cls`` with the metadata of ``shape`` and
    ``kwargs`` and no storage, the way torch's own wrapper subclasses are made."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)  # type: ignore[attr-defined]


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``torch._C._nn._parse_to``: ``nn.Module.to``'s own reading of its arguments,
    ``(device, dtype, non_blocking, memory_format)``."""
    return torch._C._nn._parse_to(*args, **kwargs)


# --- autograd -----------------------------------------------------------------------------------
def autograd_running() -> bool:
    """``torch._C._current_graph_task_id() != -1``: the autograd engine is running a backward on this
    thread (a forward op now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

SEES_SAVED_TENSOR_HOOKS = _TOP_HOOKS is not None
"""Whether this torch says which saved-tensor hooks are in place
(``torch._C._autograd._top_saved_tensors_default_hooks``: 2.8 and later)."""


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks now, ``(pack, unpack)``; ``None`` when none is in place or
    this torch cannot say (``_top_saved_tensors_default_hooks(False)``: without ignoring disabled ones)."""
    return _TOP_HOOKS(False) if _TOP_HOOKS is not None else None


# The qualified names of the pack hooks a non-reentrant ``torch.utils.checkpoint`` installs (private
# classes of ``torch.utils.checkpoint``: ``_checkpoint_hook`` in forward, ``_recomputation_hook``
# while it recomputes).
_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def is_checkpoint_hook(pack_hook: Any) -> bool:
    """Whether ``pack_hook`` (from ``top_saved_tensors_hooks``) is a non-reentrant checkpoint's."""
    return any(getattr(pack_hook, "__qualname__", "").startswith(prefix) for prefix in _CHECKPOINT_HOOKS)


# --- nn.Module ----------------------------------------------------------------------------------
def set_parameter_entry(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """``module._parameters[name] = value``: the module's own parameter slot, written without
    ``register_parameter``'s checks (``value`` may be a plain tensor alias), as
    ``torch.func.functional_call`` swaps the same entries for one call."""
    module._parameters[name] = value  # type: ignore[assignment]


def own_reset_method(module: torch.nn.Module) -> Callable[[], None] | None:
    """What ``nn.MultiheadAttention`` and ``nn.Transformer`` call in their ``__init__`` to initialise
    their own parameters (a private ``_reset_parameters``); ``None`` for other modules."""
    if isinstance(module, torch.nn.MultiheadAttention | torch.nn.Transformer):
        return module._reset_parameters
    return None


# --- Dynamo -------------------------------------------------------------------------------------
TRACING_CONTEXT: Any = getattr(getattr(torch, "_guards", None), "TracingContext", None)
"""``torch._guards.TracingContext`` (``None`` in a torch without it, where only
``torch.compiler.is_compiling`` can be asked): Dynamo's context while it builds a graph, whose
``try_get()`` is not ``None`` while it wraps a parameter and reads its metadata for real. A class,
not a function around it: the hooked parameter asks it on every op."""


def dynamo_supported() -> bool:
    """``torch._dynamo.is_dynamo_supported()``: ``torch.compile`` works on this Python and platform.
    Imports Dynamo (about two seconds), so only when a compile is asked for."""
    import torch._dynamo

    return torch._dynamo.is_dynamo_supported()


class ModuleConversionHook:
    """Put in front of ``torch.nn.Module``: its private ``_apply(fn, recurse)``, through which every
    conversion of a module's tensors goes (``.half()``, ``.float()``, ``.cuda()``, ``.to_empty()``,
    ``.share_memory()``...), is forwarded to the subclass's ``_chunkmem_apply(fn, recurse)``."""

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        return self._chunkmem_apply(fn, recurse)  # type: ignore[attr-defined]
