"""``OptimizerState``: the user's optimizer's state table and param groups, one object that every
part of the optimizer side reading or writing them shares (the step runs, the state ledger, the disk
pipeline, the early steps). Each read goes to where the optimizer holds them now:
``load_state_dict`` puts a new table in place of the old one."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["OptimizerState"]


class OptimizerState:
    """The state of ``optimizer`` (the user's, stepping the runs)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    @property
    def table(self) -> MutableMapping[torch.Tensor, Any]:
        """Per tensor the optimizer steps, its state (``optimizer.state``)."""
        return self._optimizer.state

    @property
    def groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups, with their settings."""
        return self._optimizer.param_groups

    @property
    def name(self) -> str:
        """The optimizer's class, for messages."""
        return type(self._optimizer).__name__
