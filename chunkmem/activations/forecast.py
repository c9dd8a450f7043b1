"""``forecast``: what autograd saves inside the blocks an ``ActivationPlacement`` names, per block
call, predicted from one forward of the model on the meta device (``chunkmem.plan``).

Each call is counted by the runtime's own rule (``counting.SavedCount``): ``saved_bytes`` what
autograd saves apart from model memory, each storage once per call; ``offload_bytes`` what an
offload copies to the host in its forward and back in its backward (``copied``: each storage's
bytes, in the order saved); ``disk_bytes`` the part of those an ``ActivationPlacement.host_budget``
sends on to the disk tier (``placement.disk_bytes_per_call``, the runtime's rule, over the copies
of one training forward in the order saved: the ``offload`` blocks' calls and, as in the first
training forward, every ``auto`` call). With ``ActivationPlacement.offload_outside`` the stretches of
the forward outside the blocks are calls too (``BlockPlacement.OUTSIDE``, between the blocks' calls
in forward order, counted with the whole model as the module, as ``OutsideStretches`` offloads them).

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

from chunkmem.placement import ActivationPlacement, BlockPlacement, disk_bytes_per_call

from ..usage.saved import unlinked
from .counting import Saved, SavedCount

__all__ = ["BlockForecast", "forecast"]


@dataclass(frozen=True)
class BlockForecast:
    """One call of a named block in a training forward, as planned."""

    name: str
    """The block's module name."""
    how: BlockPlacement
    """The ``ActivationPlacement`` field naming its class."""
    saved_bytes: int
    """Bytes autograd saves in the call apart from model memory, each storage once (what ``auto``
    measures and reserves)."""
    offload_bytes: int
    """Of those, the bytes an offload copies to the host and back (storages of at least
    ``min_offload_bytes``, once per storage version)."""
    disk_bytes: int = 0
    """Of those, the bytes written to the disk tier and read back (beyond ``host_budget``; an
    ``auto`` call's as in the first training forward, where every ``auto`` call is offloaded)."""
    copied: tuple[int, ...] = ()
    """The bytes of each storage an offload of the call copies, in the order saved (``offload_bytes``
    is their sum)."""
    held: tuple[int, ...] = ()
    """What host memory holds for each of those copies on the device planned for (on a GPU a pinned
    block): what ``ActivationPlacement.host_budget`` counts."""
    small_bytes: int = 0
    """Of ``saved_bytes``, what an offload of the call leaves on the device (storages under
    ``min_offload_bytes``)."""


@dataclass(eq=False)
class _Call:
    name: str
    how: BlockPlacement
    module: torch.nn.Module
    count: SavedCount
    copied: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)


def forecast(
    model: torch.nn.Module,
    config: ActivationPlacement,
    forward: Callable[[], Any],
    host_held_bytes: Callable[[int], int] = int,
) -> tuple[BlockForecast, ...]:
    """Each call of the blocks ``config`` names while ``forward()`` runs ``model`` (with autograd
    recording), in forward order. ``host_held_bytes``: what host memory holds for a copy of so many
    bytes on the device planned for (``DeviceLayer.host_held_bytes``: on a GPU a pinned block)."""
    calls: list[_Call] = []
    open_calls: list[tuple[_Call, Any]] = []
    stretch: list[_Call | None] = [None]  # the stretch outside the blocks now (offload_outside)

    def counted(call: _Call | None, tensor: torch.Tensor) -> torch.Tensor:
        if call is not None and call.count.add(tensor) is Saved.COPY:
            nbytes = tensor.untyped_storage().nbytes()
            call.copied.append(nbytes)
            call.held.append(host_held_bytes(nbytes))
        return unlinked(tensor)  # the forward's graph is dropped without a backward

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return counted(open_calls[-1][0], tensor)

    def begin_stretch() -> None:
        """A stretch outside the blocks begins (the runtime's ``OutsideStretches``, by its rule)."""
        if not config.offload_outside:
            return
        count = SavedCount(model, config.min_offload_bytes)
        stretch[0] = _Call(f"stretch {len(stretches)} outside the blocks", BlockPlacement.OUTSIDE, model, count)
        stretches.append(stretch[0])
        calls.append(stretch[0])

    stretches: list[_Call] = []

    def enter(name: str, how: BlockPlacement) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            call = _Call(name or "(the model)", how, module, SavedCount(module, config.min_offload_bytes))
            if not open_calls:
                stretch[0] = None  # the stretch before it ends
            calls.append(call)
            context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            context.__enter__()
            open_calls.append((call, context))

        return hook

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        if open_calls and open_calls[-1][0].module is module:
            open_calls.pop()[1].__exit__(None, None, None)
            if not open_calls:
                begin_stretch()

    handles = []
    for name, module in model.named_modules():
        how = config.placement_of(module)
        if how is not None:
            handles += [module.register_forward_pre_hook(enter(name, how)), module.register_forward_hook(leave)]
    outside = torch.autograd.graph.saved_tensors_hooks(lambda t: counted(stretch[0], t), lambda t: t)
    try:
        with outside:
            begin_stretch()
            forward()
    finally:
        for handle in handles:
            handle.remove()
        while open_calls:  # a forward that raised inside a block
            open_calls.pop()[1].__exit__(None, None, None)
    offloaded = [c for c in calls if c.how is not BlockPlacement.RECOMPUTE]
    disk = [0] * len(offloaded)
    if config.host_budget is not None:
        disk = disk_bytes_per_call([c.copied for c in offloaded], int(config.host_budget), [c.held for c in offloaded])
    disk_of = {id(c): d for c, d in zip(offloaded, disk, strict=True)}
    return tuple(
        BlockForecast(
            c.name,
            c.how,
            c.count.saved_bytes,
            c.count.copied_bytes,
            disk_of.get(id(c), 0),
            tuple(c.copied),
            small_bytes=c.count.small_bytes,
            held=tuple(c.held),
        )
        for c in calls
    )
