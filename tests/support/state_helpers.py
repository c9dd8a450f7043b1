"""Snapshots of everything a boosted model and optimizer hold, read from the shards themselves
(not through chunkmem's gathering), to prove that a refused operation changed nothing."""

from __future__ import annotations

import copy
from typing import Any

import torch

from chunkmem import ChunkedModel, ChunkOptimizer


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def raw_state(model: ChunkedModel, optimizer: ChunkOptimizer | None = None, scheduler: Any = None) -> dict[str, Any]:
    """This rank's master shards, buffers, optimizer piece state, param group settings, loss
    scale and scheduler state, cloned."""
    manager = model.manager
    out: dict[str, Any] = {
        "masters": [chunk.store.master.detach().clone() for chunk in manager.chunks],
        "buffers": {name: b.detach().clone() for name, b in model.module.named_buffers()},
    }
    if optimizer is not None:
        out["optim_state"] = [_clone(dict(optimizer.state.get(piece.tensor, {}))) for piece in optimizer.pieces]
        out["groups"] = [_clone({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
        out["loss_scale"] = optimizer.loss_scale
    if scheduler is not None:
        out["scheduler"] = _clone(scheduler.state_dict())
    return out


def assert_identical(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-identical: tensors equal in dtype, shape and every bit (NaNs included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, expected a tensor"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        bits = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected)]
        assert torch.equal(bits[0], bits[1]), f"{where}: values differ"
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{where}: keys differ"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
        return
    if isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}[{i}]")
        return
    assert actual == expected, f"{where}: {actual!r} != {expected!r}"
