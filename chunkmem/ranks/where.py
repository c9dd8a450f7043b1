"""``Where``: a point in the run (which iteration, which op), named in messages and compared by the
cross-rank checks. The runtime's ``IterationTracker`` (``chunkmem.execution.iteration``) says where the
run is; the ranks' checks only read it, so the type lives here, below both."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["IterationKind", "Where"]


class IterationKind(enum.Enum):
    TRAINING = "training"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True)
class Where:
    """A point in the run, for messages and cross-rank checks."""

    kind: IterationKind
    iteration: int
    """Training iterations begun so far minus one (the current one), or inference forwards."""
    position: int
    """Index of the latest op in the iteration (-1 before the first)."""
    between: bool = False
    """No iteration runs: the point is after iteration ``iteration`` ended."""

    def describe(self) -> str:
        if self.between:
            return f"after {self.kind.value} iteration {self.iteration}"
        op = "its start" if self.position < 0 else f"op {self.position}"
        return f"{self.kind.value} iteration {self.iteration}, {op}"
