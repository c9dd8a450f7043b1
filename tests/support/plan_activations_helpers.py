"""Pieces of ``integration/activations/test_plan_activations.py`` that other tests use too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from chunkmem import Booster, ChunkPlugin, Plan, plan
from chunkmem.placement import ActivationPlacement, StaticPlacementConfig
from support.models import batches, gpt2, llama


def _model(arch: str, attention: str) -> torch.nn.Module:
    return (gpt2 if arch == "gpt2" else llama)(n_layer=2, attn_implementation=attention)


def _plugin(activations: ActivationPlacement, budget: int | None = None, **kwargs: Any) -> ChunkPlugin:
    kwargs.setdefault("precision", "fp32")
    return ChunkPlugin(placement=StaticPlacementConfig(device_budget=budget), activations=activations, **kwargs)


def _adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(params))


def _lm_plan(arch: str, activations: ActivationPlacement, attention: str, precision: str = "fp32") -> Plan:
    with torch.device("meta"):
        model = _model(arch, attention)
    ids = torch.zeros(4, 16, dtype=torch.long)
    plugin = _plugin(activations, precision=precision)
    return plan(model, plugin, {"input_ids": ids, "labels": ids}, device="cpu", steps=2)


def _lm_run(
    arch: str, activations: ActivationPlacement, attention: str, precision: str = "fp32"
) -> list[dict[str, int]]:
    """Two real training steps: per step, the activation counters' differences."""
    model = _model(arch, attention)
    booster = Booster(_plugin(activations, precision=precision))
    chunked, optimizer, *_ = booster.boost(model, _adamw(model.parameters()))
    names = ("activation_d2h_bytes", "activation_h2d_bytes", "recomputed_blocks")
    steps = []
    for ids in batches(2):
        before = vars(chunked.stats())
        booster.backward(chunked(input_ids=ids, labels=ids).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        after = vars(chunked.stats())
        steps.append({name: after[name] - before[name] for name in names})
    return steps
