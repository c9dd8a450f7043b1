"""``forecast``: what autograd saves inside the blocks an ``ActivationPlacement`` names, per block
call, predicted from one forward of the model on the meta device (``chunkmem.plan``).

The count is the one the runtime makes (``ActivationOffload._pack``, ``DeviceActivations``):
parameters, views of them, tensor subclasses and storages shared with the block's parameters or
buffers are model memory and left out; every other storage counts once per call
(``saved_bytes``); of those, the ones an offload copies (at least ``min_offload_bytes``, a whole
number of elements) count once per call and storage version (``offload_bytes``: what an offloaded
call copies to the host in its forward and back in its backward). A meta tensor has no address, so
storages are told apart by identity rather than by pointer.

Only the forward runs: saved tensors are packed there, and a recomputed call is recomputed once in
the backward (``recompute_calls``). The forward runs the model's own code on meta tensors, so an op
that picks its kernel by device is planned with the kernel the meta device dispatches to:
``scaled_dot_product_attention`` runs its math fallback there (which saves the attention weights),
where a GPU's fused kernels or the CPU's save less; plan such a model with eager attention or read
the figure as an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from placement import ActivationPlacement, matches_block

__all__ = ["BlockForecast", "forecast"]


@dataclass(frozen=True)
class BlockForecast:
    """One call of a named block in a training forward, as planned."""

    name: str
    """The block's module name."""
    how: str
    """``"recompute"``, ``"offload"`` or ``"auto"``: the ``ActivationPlacement`` field naming its class."""
    saved_bytes: int
    """Bytes autograd saves in the call apart from model memory, each storage once (what ``auto``
    measures and reserves)."""
    offload_bytes: int
    """Of those, the bytes an offload copies to the host and back (storages of at least
    ``min_offload_bytes``, once per storage version)."""


@dataclass(eq=False)
class _Call:
    name: str
    how: str
    module: torch.nn.Module
    model_storages: set[int]
    seen: set[int] = field(default_factory=set)
    copied: set[tuple[int, int]] = field(default_factory=set)
    saved_bytes: int = 0
    offload_bytes: int = 0


def _how(config: ActivationPlacement, module: torch.nn.Module) -> str | None:
    for how, blocks in (("recompute", config.recompute), ("offload", config.offload), ("auto", config.auto)):
        if any(matches_block(b, module) for b in blocks):
            return how
    return None


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _model_memory(call: _Call, tensor: torch.Tensor) -> bool:
    """``is_model_memory`` on meta tensors: storages told apart by identity."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return True
    if isinstance(tensor._base, torch.nn.Parameter):
        return True
    return _storage_key(tensor) in call.model_storages


def forecast(
    model: torch.nn.Module, config: ActivationPlacement, forward: Callable[[], Any]
) -> tuple[BlockForecast, ...]:
    """Each call of the blocks ``config`` names while ``forward()`` runs ``model`` (with autograd
    recording), in forward order."""
    calls: list[_Call] = []
    open_calls: list[tuple[_Call, Any]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        call = open_calls[-1][0]
        if _model_memory(call, tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = _storage_key(tensor)
        if key not in call.seen:
            call.seen.add(key)
            call.saved_bytes += storage.nbytes()
        nbytes = storage.nbytes()
        copied = nbytes >= config.min_offload_bytes and nbytes % tensor.element_size() == 0
        if copied and (key, tensor._version) not in call.copied:
            call.copied.add((key, tensor._version))
            call.offload_bytes += nbytes
        return tensor

    def enter(name: str, how: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            owned = {_storage_key(t) for t in (*module.parameters(), *module.buffers())}
            call = _Call(name or "(the model)", how, module, owned)
            calls.append(call)
            context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            context.__enter__()
            open_calls.append((call, context))

        return hook

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        if open_calls and open_calls[-1][0].module is module:
            open_calls.pop()[1].__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        how = _how(config, module)
        if how is not None:
            handles += [module.register_forward_pre_hook(enter(name, how)), module.register_forward_hook(leave)]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
        while open_calls:  # a forward that raised inside a block
            open_calls.pop()[1].__exit__(None, None, None)
    return tuple(BlockForecast(c.name, c.how, c.saved_bytes, c.offload_bytes) for c in calls)
