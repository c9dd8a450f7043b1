"""Which parameters belong to a live boosted model, and what refuses to treat them as plain ones.

After ``booster.boost`` a model's parameters hold placeholders: their values live in chunks, with
each rank's fp32 master shard the source of truth. A torch optimizer built from those parameters
(``AdamW(model.parameters())`` on the boosted model) would update placeholders, and its update
would be lost. A global optimizer step pre-hook (``torch.optim``'s, installed at the first boost)
refuses such a step before it changes anything, saying what happened and the fix; chunkmem's own
optimizers (the one ``boost`` returns and the one it wraps) are skipped at the cost of one set
lookup.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from chunkmem.hooks import HookedParameter

from ..chunks.manager import ChunkManager
from ..errors import AlreadyBoostedError, OptimizerAfterBoostError

__all__ = ["already_boosted", "boosted_names", "note_boosted", "the_fix"]

_managers: weakref.WeakSet[ChunkManager] = weakref.WeakSet()
_own: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed = False
_lock = threading.Lock()


def note_boosted(manager: ChunkManager, optimizers: Iterable[torch.optim.Optimizer | None]) -> None:
    """``manager``'s parameters now belong to a boosted model; ``optimizers`` are chunkmem's to step."""
    global _installed
    with _lock:
        _managers.add(manager)
        _own.update(o for o in optimizers if o is not None)
        if not _installed:
            register_optimizer_step_pre_hook(_refuse_foreign_step)
            _installed = True


def boosted_names(params: Iterable[Any]) -> tuple[ChunkManager | None, list[str]]:
    """The names of those of ``params`` that a live boosted model manages, and one such model's
    manager (for its rank)."""
    names: list[str] = []
    owner = None
    for p in params:
        if not isinstance(p, HookedParameter):
            continue  # chunkmem's managed parameters are all hooked: the cheap test first
        for manager in list(_managers):
            if manager.manages(p):
                names.append(manager.info(p).name)
                owner = manager
                break
    return owner, names


def the_fix(optimizer: torch.optim.Optimizer | None) -> str:
    """The one line that boosts a model with its optimizer."""
    cls = type(optimizer) if optimizer is not None else torch.optim.AdamW
    qualified = f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls else cls.__name__
    return f"model, optimizer, *_ = booster.boost(model, {qualified}(model.parameters(), ...))"


def _rank_prefix(manager: ChunkManager | None) -> str:
    if manager is None or manager.comm.world_size == 1:
        return ""
    return f"rank {manager.comm.rank}: "


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _own or not _managers:
        return
    manager, names = boosted_names(p for group in optimizer.param_groups for p in group["params"])
    if not names:
        return
    name = type(optimizer).__name__
    raise OptimizerAfterBoostError(
        f"{_rank_prefix(manager)}{name}.step() refused: this {name} was built from the parameters of a boosted model "
        f"({_listed(names)}): {name}(model.parameters()) after booster.boost, or before it without passing it to "
        "booster.boost. Those parameters hold placeholders; chunkmem keeps their values in its own fp32 master "
        "shards, so the update would be lost. "
        f"Build the optimizer from the original model before boosting and pass it to booster.boost, then step the "
        f"optimizer it returns: {the_fix(optimizer)}"
    )


def already_boosted(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, manager: ChunkManager | None
) -> None:
    """Refuse to boost ``model`` again: it is a boosted model (whose chunks ``manager`` holds), or
    its parameters are in the chunks of one (the module a boosted model wraps)."""
    what = "this model is already boosted"
    if manager is None:
        manager, names = boosted_names(model.parameters())
        if not names:
            return
        what = f"this model's parameters ({_listed(names)}) are already in the chunks of a boosted model"
    built_after = ""
    if optimizer is not None and boosted_names(p for g in optimizer.param_groups for p in g["params"])[1]:
        built_after = f" The {type(optimizer).__name__} given was built from the boosted model's parameters."
    raise AlreadyBoostedError(
        f"{_rank_prefix(manager)}{what}: booster.boost was called on it before, and a model is boosted once."
        f"{built_after} Train the model booster.boost returned with the optimizer it returned; to train with an "
        "optimizer, build it from the original, unboosted model and pass both to one booster.boost call: "
        f"{the_fix(optimizer)}"
    )
