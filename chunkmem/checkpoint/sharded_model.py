"""A boosted model's state as a sharded checkpoint: what each rank saves and reads.

The directory is a DCP checkpoint of the module's ``state_dict`` as plain PyTorch has it: each
parameter under its name (a tied parameter once, under its first name: GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``), in its own shape, fp32; each buffer whole, in its original dtype,
written by rank 0. A rank writes the elements of each parameter in its master shards, so no rank
holds more than its shards; a load reads, for each parameter, the saved elements that fall in this
rank's shards, whatever layout saved them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..boosted.model_state import StagedModelLoad, check_model_state
from ..chunks.chunk import Chunk
from ..chunks.chunk_layout import ShardPiece
from ..device.moves import to_host
from .dcp_layout import Entry, FlatRange, Whole, as_meta, read_whole
from .sharded import Reading

if TYPE_CHECKING:
    from ..boosted.model import ChunkedModel

__all__ = ["model_save_entries", "plan_model_load"]


def _state(model: ChunkedModel) -> tuple[list[tuple[str, torch.Tensor, torch.dtype]], set[str]]:
    """Each state-dict buffer (name, the tensor, its original dtype), and the state-dict names of
    parameters saved under another (their first) name."""
    manager, shapes = model.manager, model.state_shapes()
    buffers: list[tuple[str, torch.Tensor, torch.dtype]] = []
    aliases: set[str] = set()
    for name, tensor in model.module.state_dict(keep_vars=True).items():
        if not manager.manages(tensor):
            buffers.append((name, tensor, shapes[name][1]))
        elif manager.info(tensor).name != name:
            aliases.add(name)
    return buffers, aliases


def model_save_entries(model: ChunkedModel) -> dict[str, Entry]:
    """What this rank saves: its piece of each parameter (views of the master shards), and, on
    rank 0, the buffers and any parameter without elements."""
    manager = model.manager
    first = manager.comm.rank == 0
    entries: dict[str, Entry] = {}
    for chunk in model.chunks:
        for info in chunk.layout.tensors:
            piece = chunk.layout.piece(info)
            if piece is not None:
                master = chunk.store.readable_master()  # mapped from the disk tier's file when there
                entries[info.name] = FlatRange(master[piece.shard], tuple(info.shape), piece.param.start)
            elif info.numel == 0 and first:
                entries[info.name] = Whole(torch.zeros(info.shape, dtype=chunk.store.values_dtype))
    if first:
        for name, tensor, dtype in _state(model)[0]:
            entries[name] = Whole(to_host(tensor.detach(), dtype))
    return entries


def plan_model_load(model: ChunkedModel, strict: bool, source: Path, metadata: Metadata) -> Reading[StagedModelLoad]:
    """What this rank reads of a directory (``metadata``, DCP's): every key, shape and dtype
    checked against the model (every problem listed), then this rank's pieces and the buffers."""
    manager = model.manager
    model_buffers, aliases = _state(model)
    expected = {name: shape for name, shape in model.state_shapes().items() if name not in aliases}
    saved = {
        name: as_meta(entry) if isinstance(entry, TensorStorageMetadata) else "is not a tensor in the checkpoint"
        for name, entry in metadata.state_dict_metadata.items()
    }
    missing, unexpected = check_model_state(
        type(model.module).__name__, expected, saved, strict, str(source), not_unexpected=aliases
    )
    targets: dict[str, Entry] = {}
    pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]] = []
    for info in model.param_infos:
        chunk = manager.chunk(info.chunk_id)
        piece = chunk.layout.piece(info)
        if info.name in saved and piece is not None:
            staging = chunk.store.staging_for_master(piece.numel)
            targets[info.name] = FlatRange(staging, tuple(info.shape), piece.param.start)
            pieces.append((chunk, piece, staging))
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, tensor, _ in model_buffers:
        if isinstance(saved.get(name), torch.Tensor):
            targets[name] = read_whole(saved[name])
            buffers.append((tensor, targets[name].value))
    staged = StagedModelLoad(pieces, buffers, missing, unexpected)
    return Reading(targets, lambda: staged)
