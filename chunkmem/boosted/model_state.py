"""The checks a saved model state passes before it is loaded, and the staged result.

The same checks serve every format a model state comes in: a full state dict
(``ChunkedModel.load_state_dict``, a checkpoint file) and a sharded checkpoint, which describes its
saved tensors as tensors on the meta device (their shapes and dtypes; see
``chunkmem.checkpoint.sharded_model``). Every key, shape and dtype is checked and every problem is
listed; nothing is written until the staged state is installed (``ChunkedModel.apply_load``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import StateDictMismatchError

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk
    from ..chunks.chunk_layout import ShardPiece

__all__ = ["StagedModelLoad", "check_model_state"]

_MAX_LISTED = 12


@dataclass(frozen=True)
class StagedModelLoad:
    """A validated model state, ready to write: this rank's piece of each parameter (its values,
    for the elements ``piece`` names in ``chunk``'s master shard) and each buffer's new value."""

    pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    missing: list[str]
    unexpected: list[str]


def _castable(value: torch.dtype, target: torch.dtype) -> bool:
    """What a copy may convert without losing the kind of number (floats into an integer buffer,
    complex into real, anything into bool or bool into numbers are refused)."""
    if (value == torch.bool) != (target == torch.bool) or value.is_complex != target.is_complex:
        return False
    return target.is_floating_point or target.is_complex or not value.is_floating_point


def check_model_state(
    model_name: str,
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    saved: Mapping[str, torch.Tensor | str],
    strict: bool,
    source: str,
    not_unexpected: Collection[str] = (),
) -> tuple[list[str], list[str]]:
    """Check ``saved`` (each name's tensor, real or on the meta device, or a text saying what else
    it is) against ``expected`` (each name's shape and dtype in this model) and return the missing
    and the unexpected names; raise :class:`StateDictMismatchError` listing every problem.
    ``not_unexpected``: names this model has but does not expect in ``saved`` (a tied parameter,
    saved once under its first name)."""
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected and name not in not_unexpected]
    problems: list[str] = []
    if strict and missing:
        problems.append(f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing[:_MAX_LISTED])}")
    if strict and unexpected:
        problems.append(f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected[:_MAX_LISTED])}")
    for name, (shape, dtype) in expected.items():
        value = saved.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            problems.append(f"'{name}' {value}")
        elif tuple(value.shape) != shape:
            problems.append(
                f"size mismatch for {name}: copying a param with shape {tuple(value.shape)} from the checkpoint, the "
                f"shape in the current model is {shape}"
            )
        elif not _castable(value.dtype, dtype):
            problems.append(f"dtype mismatch for {name}: cannot copy {value.dtype} values into {dtype}")
    if problems:
        listed = "\n\t".join(problems[:_MAX_LISTED])
        more = f"\n\t... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise StateDictMismatchError(
            f"Error(s) in loading state_dict for {model_name} from {source} (nothing was changed):\n\t{listed}{more}"
        )
    return missing, unexpected
