"""What would make a plan that does not fit fit (``Plan.fixes``), as the runtime's refusals say it:
each fix names the setting to change (a field of the plugin's configs) and, where the planner knows
one, the value to give it. ``python -m chunkmem.plan_command`` shows each as the flag that sets it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chunkmem.placement.policy import format_bytes

__all__ = ["FixKind", "PlanFix"]


class FixKind(enum.Enum):
    """Which setting a fix changes."""

    RAISE_DEVICE_BUDGET = "raise device_budget"
    """``value``: the least ``device_budget`` that runs (``None``: more than now)."""
    LOWER_DEVICE_BUDGET = "lower device_budget"
    """``value``: the most ``device_budget`` that leaves the device room for the activations."""
    RAISE_HOST_BUDGET = "raise host_budget"
    """``value``: the least host ``budget`` that holds what the placement keeps in host memory."""
    RECOMPUTE_BLOCKS = "recompute blocks"
    """``value``: the block class whose saved activations to recompute in the backward."""
    SMALLER_BATCH = "smaller batch"
    """A smaller micro-batch (fewer rows or a shorter sequence): fewer saved activations."""
    SMALLER_CHUNK_SIZE = "smaller chunk_size"
    """A smaller ``chunk_size``: a smaller working set for the largest op."""


@dataclass(frozen=True)
class PlanFix:
    """One way to make the plan fit; ``detail`` says what it is estimated to change."""

    kind: FixKind
    value: int | str | None = None
    detail: str = ""

    def describe(self) -> str:
        """The fix in the library's terms (``ChunkPlugin`` and its configs)."""
        value, kind = self.value, self.kind
        size = f"{value} ({format_bytes(value)})" if isinstance(value, int) else ""
        if kind is FixKind.RAISE_DEVICE_BUDGET:
            text = f"device_budget={size}" if size else "a larger device_budget (more of the model on the device)"
        elif kind is FixKind.LOWER_DEVICE_BUDGET:
            text = f"device_budget={size}, which leaves the device room for the activations"
        elif kind is FixKind.RAISE_HOST_BUDGET:
            text = f"host_budget={size}"
        elif kind is FixKind.RECOMPUTE_BLOCKS:
            text = f"ActivationPlacement(recompute=[{value!r}]) (or auto=[...] under a device_budget)"
        elif kind is FixKind.SMALLER_BATCH:
            text = "a smaller micro-batch (fewer rows or a shorter sequence)"
        else:
            text = "a smaller chunk_size"
        return f"{text}{f' ({self.detail})' if self.detail else ''}"


def describe_all(fixes: tuple[PlanFix, ...]) -> str:
    """``fixes`` as one sentence, the first first (empty without any)."""
    return f"Fix: {'; or '.join(f.describe() for f in fixes)}." if fixes else ""
