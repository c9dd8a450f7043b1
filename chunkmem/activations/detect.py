"""``detect_repeated_block``: the class ``RepeatedBlocks()`` stands for in a model (the rule is in
``placement.repeated_blocks``), and ``resolve_blocks``: an ``ActivationPlacement`` with the class
found in the marker's place, agreed over ranks when boosting (a rank whose model finds another
class raises on every rank, before any block is placed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkmem.placement import ActivationPlacement, RepeatedBlocks, block_class_name

from ..errors import NotSupportedError
from ..ranks.comm import Communicator

__all__ = ["RepeatedBlock", "agreed_repeated_block", "detect_repeated_block", "resolve_blocks"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
# How each config that holds a marker names a class instead (for the messages).
_EXAMPLES = {
    "ActivationPlacement": "ActivationPlacement(auto=['MyBlock'])",
    "CompileBlocks": "CompileBlocks(blocks=['MyBlock'])",
}


@dataclass(frozen=True)
class RepeatedBlock:
    """The block class found, and what it was found from."""

    cls: type
    count: int
    """Its instances among the containers' children."""
    parameters: int
    """Parameters (elements) those instances hold."""
    share: float
    """Of the model's parameters."""

    def describe(self) -> str:
        return (
            f"{block_class_name(self.cls)} ({self.count} instances holding {self.share:.0%} of the model's parameters)"
        )


def detect_repeated_block(
    model: torch.nn.Module, marker: RepeatedBlocks, owner: str = "ActivationPlacement"
) -> RepeatedBlock:
    """The class ``marker`` stands for in ``model``; ``ValueError`` naming what was looked at when
    no class repeats (``owner``: the config the marker is in, for the message)."""
    count: dict[type, int] = {}
    held: dict[type, int] = {}
    looked: list[str] = []
    for name, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        looked.append(f"{name or '(the model)'} ({type(container).__name__} of {len(container)})")
        for child in container.children():
            numel = sum(p.numel() for p in child.parameters())
            if numel:
                count[type(child)] = count.get(type(child), 0) + 1
                held[type(child)] = held.get(type(child), 0) + numel
    repeated = [cls for cls in count if count[cls] >= marker.min_count]  # in module order
    if not repeated:
        seen = ", ".join(looked) if looked else "none: the model holds no nn.ModuleList, nn.Sequential or nn.ModuleDict"
        counts = ", ".join(f"{cls.__name__} x{n}" for cls, n in count.items()) or "none"
        raise ValueError(
            f"{owner}: {marker} found no repeated block in {type(model).__name__}: no class has "
            f"{marker.min_count} or more instances holding parameters among the children of its nn.ModuleList, "
            f"nn.Sequential and nn.ModuleDict containers (looked at: {seen}; classes found there: {counts}). Name the "
            f"block class instead, e.g. {_EXAMPLES.get(owner, owner)}, or lower min_count."
        )
    best = max(repeated, key=lambda cls: (held[cls], -count[cls]))  # max keeps the first of equals
    total = sum(p.numel() for p in model.parameters())
    return RepeatedBlock(best, count[best], held[best], held[best] / total if total else 0.0)


def resolve_blocks(
    model: torch.nn.Module, config: ActivationPlacement, comm: Communicator | None = None
) -> tuple[ActivationPlacement, RepeatedBlock | None]:
    """``config`` with the class ``RepeatedBlocks()`` stands for in its place (unchanged without
    one), and what was found; with ``comm``, every rank must find the same class."""
    marker = config.repeated
    if marker is None:
        return config, None
    found = agreed_repeated_block(model, marker, comm)
    return config.resolved(found.cls), found


def agreed_repeated_block(
    model: torch.nn.Module, marker: RepeatedBlocks, comm: Communicator | None, owner: str = "ActivationPlacement"
) -> RepeatedBlock:
    """The class ``marker`` (in the config ``owner``) stands for in ``model``; with ``comm``, every
    rank must find the same class, and a rank that finds none raises on every rank."""
    found: RepeatedBlock | None = None
    try:
        found = detect_repeated_block(model, marker, owner)
        mine: tuple[str, int] | str = (block_class_name(found.cls), found.count)
    except ValueError as error:
        if comm is None or comm.world_size == 1:
            raise
        mine = str(error)  # every rank raises it, not this one alone
    if comm is not None and comm.world_size > 1:
        everyone = comm.all_gather_object(mine)
        failed = [(rank, text) for rank, text in enumerate(everyone) if isinstance(text, str)]
        if failed:
            raise ValueError(f"on rank {failed[0][0]}: {failed[0][1]}")
        if len(set(everyone)) > 1:
            each = "; ".join(f"rank {rank}: {name} x{n}" for rank, (name, n) in enumerate(everyone))
            raise NotSupportedError(
                f"{owner}: {marker} found different blocks on the ranks ({each}): every rank must boost "
                "the same model. Name the block class instead of RepeatedBlocks(), or boost the same model everywhere."
            )
    assert found is not None, "found on every rank"
    return found
