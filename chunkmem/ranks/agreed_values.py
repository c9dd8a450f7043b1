"""``AgreedValues``: named values every rank must hold alike at an entry point, such as each
param group's hyperparameters at an optimizer step.

The ranks already agree a fingerprint at every optimizer step (``RankChecks.entry``); the values
are folded into it, so checking them costs no collective of its own. A learning rate changed on
one rank only (``if rank == 0: scheduler.step()``) would otherwise train each rank's shard at a
different rate with no error. When the fingerprints differ, the ranks exchange the values and
every rank raises naming each value that differs, each rank's value, and what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AgreedValues", "hyperparameters"]

# Keys of a param group that choose a kernel, not what the step computes (chunkmem itself sets
# ``fused`` for the host runs of a group).
_KERNEL_CHOICES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})

_HYPERPARAMETER_FIX = (
    "Every rank must step with the same hyperparameters: step LR schedulers and change param_groups (lr, "
    "weight_decay, betas, ...) on every rank, not under `if rank == 0:`; log them on one rank only."
)


@dataclass(frozen=True)
class AgreedValues:
    values: Mapping[str, str]
    """Each value's name (``param group 0 'lr'``) and its text (``repr``)."""
    fix: str
    """What to do when the ranks hold different values."""

    def fingerprint_text(self) -> str:
        return ";".join(f"{name}={value}" for name, value in self.values.items())

    @staticmethod
    def differences(per_rank: Sequence[Mapping[str, str]]) -> str:
        """The values that differ between ranks (``per_rank[r]`` is rank r's), each with every
        rank's value; empty when they are alike."""
        names = list(dict.fromkeys(name for values in per_rank for name in values))
        lines = []
        for name in names:
            held = [values.get(name) for values in per_rank]
            if len(set(held)) > 1:
                each = ", ".join(
                    f"{value if value is not None else 'absent'} on rank {r}" for r, value in enumerate(held)
                )
                lines.append(f"{name}: {each}")
        return "; ".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    return repr(value)


def hyperparameters(groups: Sequence[Mapping[str, Any]]) -> AgreedValues:
    """Every param group's hyperparameters, as the optimizer step will use them."""
    values = {
        f"param group {index} {key!r}": _text(value)
        for index, group in enumerate(groups)
        for key, value in group.items()
        if key not in _KERNEL_CHOICES
    }
    return AgreedValues(values, _HYPERPARAMETER_FIX)
