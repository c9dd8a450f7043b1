"""Pieces of ``integration/activations/test_activations.py`` that other tests use too."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from support.models import (
    adamw_two_groups,
    as_reference,
    device_of,
)

WIDTH, HIDDEN, BATCH, BLOCKS, STEPS = 32, 64, 8, 2, 3


class Block(torch.nn.Module):
    """Linear + GELU, and a product that saves one tensor twice."""

    def __init__(self, dropout: float, inner_checkpoint: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.inner_checkpoint = inner_checkpoint

    def _tail(self, g: torch.Tensor) -> torch.Tensor:
        return self.fc2(g * g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.gelu(self.fc1(x))
        tail = checkpoint(self._tail, g, use_reentrant=False) if self.inner_checkpoint else self._tail(g)
        return x + self.drop(tail)


class Stack(torch.nn.Module):
    def __init__(self, dropout: float = 0.0, inner_checkpoint: bool = False, outer_checkpoint: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(dropout, inner_checkpoint) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 4)
        self.outer_checkpoint = outer_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.outer_checkpoint else block(x)
        return self.head(x)


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, WIDTH, generator=g) for _ in range(STEPS)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _plain(model: torch.nn.Module) -> dict[str, Any]:
    """Plain PyTorch where chunkmem computes (on a GPU machine, the GPU)."""
    model = as_reference(model)
    optimizer = adamw_two_groups(model)
    torch.manual_seed(7)
    losses = []
    for x in _data():
        loss = _loss(model, x.to(device_of(model)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": model.state_dict()}


def _trained(chunked: Any, optimizer: Any, booster: Any) -> dict[str, Any]:
    """Losses and final state of ``_plain``'s training, run by ``chunked``."""
    torch.manual_seed(7)
    losses = []
    for x in _data():
        loss = _loss(chunked, x)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": chunked.state_dict()}


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["state"].keys() == b["state"].keys()
    for key, value in a["state"].items():
        assert torch.equal(value.cpu(), b["state"][key].cpu()), f"{key} differs"


def _saved_bytes(blocks: Iterable[torch.nn.Module], run: Callable[[], Any], keep_below: int = 1024) -> int:
    """What autograd saves inside the calls of ``blocks`` (of a plain model) while ``run()`` runs,
    apart from parameters and views of them (such as a transposed weight): each storage once per
    call, those under ``keep_below`` bytes left out."""
    return sum(saved_storages(blocks, run, keep_below))


def saved_storages(blocks: Iterable[torch.nn.Module], run: Callable[[], Any], keep_below: int = 1024) -> list[int]:
    """The sizes of the storages ``_saved_bytes`` counts, in the order first saved."""
    calls: list[dict[int, int]] = []
    contexts: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.untyped_storage().nbytes()
        parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
        if not parameter and nbytes >= keep_below:
            calls[-1].setdefault(tensor.untyped_storage().data_ptr(), nbytes)
        return tensor

    def enter(module: torch.nn.Module, args: Any) -> None:
        calls.append({})
        contexts.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        contexts[-1].__enter__()

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        contexts.pop().__exit__(None, None, None)

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return [nbytes for call in calls for nbytes in call.values()]
