"""What a checkpoint was saved for: the model's fingerprint and the tensors a manifest lists, the
checks that a manifest describes a checkpoint of this model (or optimizer), whichever format it
is in, and a readable account of how two tensor lists differ for the message that refuses one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointMismatchError
from .manifest import Manifest, TensorEntry

if TYPE_CHECKING:
    from ..boosted.model import ChunkedModel
    from ..chunks.manager import ChunkManager
    from ..optim import ChunkOptimizer

__all__ = [
    "check_saved_for_model",
    "check_saved_for_optimizer",
    "describe_difference",
    "model_fingerprint",
    "model_tensors",
    "optimizer_tensors",
]


def model_fingerprint(manager: ChunkManager) -> str:
    """Hash of the model's parameters (names, shapes, fp32) in registration order: equal for the
    same model structure."""
    entries = [[info.name, list(info.shape), "torch.float32"] for info in manager.infos]
    text = json.dumps(entries, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_tensors(model: ChunkedModel) -> list[TensorEntry]:
    """Every ``state_dict`` entry of the model (parameters as fp32 masters, buffers in their
    original dtype), in its order."""
    return [(name, shape, str(dtype)) for name, (shape, dtype) in model.state_shapes().items()]


def optimizer_tensors(optimizer: ChunkOptimizer) -> list[TensorEntry]:
    """The optimizer's parameters in param group order (what a PyTorch-format state counts)."""
    return [(info.name, tuple(info.shape), "torch.float32") for infos in optimizer.group_infos for info in infos]


def describe_difference(saved: list[TensorEntry], here: list[TensorEntry]) -> str:
    """How the tensors a checkpoint lists differ from this model's (names only on one side, other
    shapes or dtypes, or another order)."""
    saved_map = {name: (tuple(shape), dtype) for name, shape, dtype in saved}
    here_map = {name: (tuple(shape), dtype) for name, shape, dtype in here}
    only_saved = [n for n in saved_map if n not in here_map]
    only_here = [n for n in here_map if n not in saved_map]
    changed = [
        f"'{n}' {saved_map[n]} there, {here_map[n]} here"
        for n in saved_map
        if n in here_map and saved_map[n] != here_map[n]
    ]
    parts = []
    if only_saved:
        parts.append(f"only in the checkpoint: {only_saved[:5]}{' ...' if len(only_saved) > 5 else ''}")
    if only_here:
        parts.append(f"only in this model: {only_here[:5]}{' ...' if len(only_here) > 5 else ''}")
    if changed:
        parts.append(f"different: {'; '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}")
    if not parts and [n for n, _, _ in saved] != [n for n, _, _ in here]:
        parts.append("the same tensors in another order")
    return "; ".join(parts) or "the same tensors"


def check_saved_for_model(manifest: Manifest, model: ChunkedModel, target: Path) -> None:
    """Refuse a model checkpoint of another model."""
    if manifest.model_fingerprint != model_fingerprint(model.manager):
        raise CheckpointMismatchError(
            f"{target} was saved for another model ({describe_difference(manifest.tensors, model_tensors(model))}). "
            "Load a checkpoint of this model, or boost the model the checkpoint was saved from."
        )


def check_saved_for_optimizer(manifest: Manifest, optimizer: ChunkOptimizer, target: Path) -> None:
    """Refuse an optimizer checkpoint of another model, or over other parameters."""
    here = optimizer_tensors(optimizer)
    if manifest.model_fingerprint != model_fingerprint(optimizer.manager) or manifest.tensors != here:
        raise CheckpointMismatchError(
            f"optimizer checkpoint {target} was saved for an optimizer over other parameters "
            f"({describe_difference(manifest.tensors, here)}). Load the optimizer checkpoint saved with this model."
        )
