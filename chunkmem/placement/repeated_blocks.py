"""``RepeatedBlocks``: in an ``ActivationPlacement`` field, the model's repeated blocks, found
without naming their class (``ActivationPlacement(auto=[RepeatedBlocks()])``).

A config is data only; ``chunkmem.activations.detect`` finds the class when boosting (and when
planning), the same way on every rank:

* It looks at every ``nn.ModuleList``, ``nn.Sequential`` and ``nn.ModuleDict`` of the model and at their direct
  children that hold parameters, grouped by exact class.
* A class with at least ``min_count`` such children (over all those containers) is repeated.
* Of the repeated classes, the one whose children hold the most parameters is the block (the
  transformer layers of GPT-2, LLaMA, or a user's own stack of blocks in a ``ModuleList``); on equal
  parameters the class with fewer, larger instances; then the first found in module order.

No repeated class is refused, naming the containers looked at and the fix (name the class). The
class found takes the marker's place (``ChunkedModel.activation_placement``, the plan's report).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RepeatedBlocks"]


class RepeatedBlocks(BaseModel):
    """The model's repeated blocks, found when boosting; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_count: Annotated[int, Field(ge=1, strict=True)] = 2
    """The least number of instances of one class, as children of the model's ``nn.ModuleList``,
    ``nn.Sequential`` and ``nn.ModuleDict`` containers, for the class to count as repeated (1: a model of one layer)."""

    def __str__(self) -> str:
        return f"RepeatedBlocks(min_count={self.min_count})"
