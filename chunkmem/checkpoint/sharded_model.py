"""A boosted model's state as a sharded checkpoint: what each rank saves and reads.

The directory is a DCP checkpoint of the module's ``state_dict`` as plain PyTorch has it: each
parameter under its name (a tied parameter once, under its first name: GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``), in its own shape, fp32; each buffer whole, in its original dtype,
written by rank 0. A rank writes the elements of each parameter in its master shards, so no rank
holds more than its shards; a load reads, for each parameter, the saved elements that fall in this
rank's shards, whatever layout saved them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..chunk import Chunk
from ..chunk_layout import ShardPiece
from ..errors import CheckpointMismatchError, StateDictMismatchError
from ..shard import MASTER_DTYPE
from .dcp_layout import FlatRange, LoadTarget, SaveEntry, Whole, WholeTarget
from .directory import DirectoryManifest
from .identity import describe_difference, model_fingerprint
from .progress import check_pairing
from .sharded import Reading

if TYPE_CHECKING:
    from ..model import ChunkedModel

__all__ = ["StagedShardedModel", "install_model", "model_entries", "plan_model_load"]

_MAX_LISTED = 12


def _buffers(model: ChunkedModel) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """Each state-dict buffer (name, the tensor, its original dtype)."""
    manager = model.manager
    dtypes = {name: dtype for name, _, dtype in model.state_spec()}
    return [
        (name, tensor, getattr(torch, dtypes[name].removeprefix("torch.")))
        for name, tensor in model.module.state_dict(keep_vars=True).items()
        if not manager.manages(tensor)
    ]


def _aliases(model: ChunkedModel) -> set[str]:
    """State-dict names of parameters saved under another (their first) name."""
    manager = model.manager
    return {
        name
        for name, tensor in model.module.state_dict(keep_vars=True).items()
        if manager.manages(tensor) and manager.info(tensor).name != name
    }


def model_entries(model: ChunkedModel) -> dict[str, SaveEntry]:
    """What this rank saves: its piece of each parameter (views of the master shards), and, on
    rank 0, the buffers and any parameter without elements."""
    manager = model.manager
    first = manager.comm.rank == 0
    entries: dict[str, SaveEntry] = {}
    for chunk in manager.chunks:
        for info in chunk.tensors:
            piece = chunk.piece(info)
            if piece is not None:
                master = chunk.store.readable_master()  # mapped from the disk tier's file when there
                entries[info.name] = FlatRange(master[piece.shard], tuple(info.shape), piece.param.start)
            elif info.numel == 0 and first:
                entries[info.name] = Whole(torch.zeros(info.shape, dtype=MASTER_DTYPE))
    if first:
        for name, tensor, dtype in _buffers(model):
            entries[name] = Whole(tensor.detach().to("cpu", dtype))
    return entries


@dataclass(frozen=True)
class StagedShardedModel:
    """This rank's pieces and the buffers, read and checked, ready to install."""

    pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    missing: list[str]
    unexpected: list[str]


def _castable(value: torch.dtype, target: torch.dtype) -> bool:
    """The conversions ``ChunkedModel.load_state_dict`` accepts (no floats into integers, no
    complex into real, nothing into or out of bool)."""
    if (value == torch.bool) != (target == torch.bool) or value.is_complex != target.is_complex:
        return False
    return target.is_floating_point or target.is_complex or not value.is_floating_point


def _problem(name: str, saved: Any, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    if not isinstance(saved, TensorStorageMetadata):
        return f"'{name}' is not a tensor in the checkpoint"
    if tuple(saved.size) != shape:
        return (
            f"size mismatch for {name}: copying a param with shape {tuple(saved.size)} from the checkpoint, the shape "
            f"in the current model is {shape}"
        )
    if not _castable(saved.properties.dtype, dtype):
        return f"dtype mismatch for {name}: cannot copy {saved.properties.dtype} values into {dtype}"
    return None


def plan_model_load(
    model: ChunkedModel, strict: bool, source: Path
) -> Callable[[DirectoryManifest | None, Metadata], Reading[StagedShardedModel]]:
    """The ``plan`` for ``load_directory``: check the directory against the model (every key,
    shape and dtype, listing every problem) and stage this rank's pieces and the buffers."""

    def plan(manifest: DirectoryManifest | None, metadata: Metadata) -> Reading[StagedShardedModel]:
        runtime = model.runtime
        manager = model.manager
        if manifest is not None:
            if strict and manifest.model_fingerprint != model_fingerprint(manager):
                raise CheckpointMismatchError(
                    f"{source} was saved for another model "
                    f"({describe_difference(manifest.tensors, model.state_spec())}). Load a checkpoint of this model, "
                    "or boost the model the checkpoint was saved from."
                )
            check_pairing(runtime, "model", manifest.step, source)
        saved = metadata.state_dict_metadata
        params = {info.name: info for info in manager.infos}
        buffers = {name: (tensor, dtype) for name, tensor, dtype in _buffers(model)}
        missing = [name for name in [*params, *buffers] if name not in saved]
        aliases = _aliases(model)
        unexpected = [name for name in saved if name not in params and name not in buffers and name not in aliases]
        problems: list[str] = []
        if strict and missing:
            problems.append(f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing[:_MAX_LISTED])}")
        if strict and unexpected:
            problems.append(f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected[:_MAX_LISTED])}")
        targets: dict[str, LoadTarget] = {}
        pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]] = []
        for name, info in params.items():
            if name not in saved:
                continue
            problem = _problem(name, saved[name], tuple(info.shape), MASTER_DTYPE)
            if problem:
                problems.append(problem)
                continue
            chunk = manager.chunk(info.chunk_id)
            piece = chunk.piece(info)
            if piece is not None:
                staging = chunk.store.staging_for_master(piece.numel)
                targets[name] = FlatRange(staging, tuple(info.shape), piece.param.start)
                pieces.append((chunk, piece, staging))
        loaded_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, (tensor, dtype) in buffers.items():
            if name not in saved:
                continue
            problem = _problem(name, saved[name], tuple(tensor.shape), dtype)
            if problem:
                problems.append(problem)
                continue
            entry = saved[name]
            assert isinstance(entry, TensorStorageMetadata), "checked above"
            staging = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            targets[name] = WholeTarget(staging)
            loaded_buffers.append((tensor, staging))
        if problems:
            listed = "\n\t".join(problems[:_MAX_LISTED])
            more = f"\n\t... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            raise StateDictMismatchError(
                f"Error(s) in loading state_dict for {type(model.module).__name__} from {source} (nothing was "
                f"changed):\n\t{listed}{more}"
            )
        staged = StagedShardedModel(pieces, loaded_buffers, missing, unexpected)
        return Reading(targets, lambda: staged)

    return plan


def install_model(model: ChunkedModel, staged: StagedShardedModel) -> Any:
    """Write the staged pieces into this rank's master shards, then the buffers (and refresh the
    chunks) the way ``ChunkedModel.load_state_dict`` does."""
    from ..model import StagedModelLoad

    model.runtime.cancel_early_steps()
    model.manager.prepare_master_writes()
    by_chunk: dict[int, list[tuple[Chunk, ShardPiece, torch.Tensor]]] = {}
    for entry in staged.pieces:
        by_chunk.setdefault(entry[0].chunk_id, []).append(entry)
    with torch.no_grad():
        for pieces in by_chunk.values():  # one chunk in memory at a time when masters are on disk
            with pieces[0][0].store.resident_master(write_back=True) as master:
                for _, piece, values in pieces:
                    master[piece.shard].copy_(values)
    rest = StagedModelLoad([], staged.buffers, staged.missing, staged.unexpected)
    return model.apply_load(rest)
