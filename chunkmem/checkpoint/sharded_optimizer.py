"""A boosted optimizer's state as a sharded checkpoint: what each rank saves and reads.

The directory is a DCP checkpoint of the optimizer state keyed by parameter name, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives it and DCP flattens it:

* ``state.<parameter>.<key>``: elementwise state (``exp_avg``...) in the parameter's shape, each
  rank writing the elements of its pieces; other state (``step``) whole, written once, by the rank
  holding the parameter's first element;
* ``param_groups.<i>.<setting>``: each group's hyperparameters, and ``param_groups.<i>.params``,
  its parameters' names, written by rank 0;
* ``loss_scaler.scale`` and ``loss_scaler.clean_steps`` with fp16, written by rank 0.

Loading reads, for each piece of this rank, the overlapping elements of its elementwise state and
its whole other state, and every hyperparameter; everything is checked as for a full optimizer
state (group sizes and parameters, the settings and state keys the optimizer class keeps, shapes,
dtypes, the loss scale) before anything is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import StateDictMismatchError
from ..optim.state_dict import StagedOptimizerState, check_saved_layout, refusal, stage_read_state
from .dcp_layout import Blob, Entry, FlatRange, as_meta, read_whole, whole
from .sharded import Reading

if TYPE_CHECKING:
    from ..chunks.tensor_state import TensorInfo
    from ..optim import ChunkOptimizer, Piece

__all__ = ["optimizer_save_entries", "plan_optimizer_load"]


def optimizer_save_entries(optimizer: ChunkOptimizer) -> dict[str, Entry]:
    """What this rank saves: the elementwise state of its pieces, the other state of the
    parameters whose first element it holds, and, on rank 0, the param groups and loss scale."""
    entries: dict[str, Entry] = {}
    for piece in optimizer.pieces:
        for key, value in optimizer.piece_state(piece).items():
            name = f"state.{piece.info.name}.{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.tensor.shape:
                entries[name] = FlatRange(value.detach().contiguous(), tuple(piece.info.shape), piece.param_slice.start)
            elif piece.param_slice.start == 0:
                entries[name] = whole(value)
    if optimizer.communicator.rank == 0:
        for position, (group, infos) in enumerate(zip(optimizer.param_groups, optimizer.group_infos, strict=True)):
            for setting, value in group.items():
                if setting != "params":
                    entries[f"param_groups.{position}.{setting}"] = whole(value)
            entries[f"param_groups.{position}.params"] = Blob([info.name for info in infos])
        if optimizer.loss_scaler is not None:
            for key, value in optimizer.loss_scaler.state_dict().items():
                entries[f"loss_scaler.{key}"] = Blob(value)
    return entries


class _Layout:
    """The entries of a saved optimizer state, sorted by what they hold."""

    def __init__(self, optimizer: ChunkOptimizer, metadata: Metadata, source: Path) -> None:
        self.infos: dict[str, TensorInfo] = {info.name: info for infos in optimizer.group_infos for info in infos}
        self.groups: dict[int, dict[str, Any]] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.scaler: dict[str, Any] = {}
        self.problems: list[str] = []
        for name, saved in metadata.state_dict_metadata.items():
            head, _, rest = name.partition(".")
            if head == "state":
                parameter, _, key = rest.rpartition(".")
                if parameter in self.infos:
                    self.state.setdefault(parameter, {})[key] = as_meta(saved)
                else:
                    self.problems.append(
                        f"'state' has an entry for parameter '{parameter}', which no param group lists"
                    )
            elif head == "param_groups" and rest.partition(".")[0].isdigit():
                position, _, setting = rest.partition(".")
                self.groups.setdefault(int(position), {})[setting] = as_meta(saved)
            elif head == "loss_scaler":
                self.scaler[rest] = as_meta(saved)
            else:
                self.problems.append(f"'{name}' is not part of an optimizer state")
        if not self.groups:
            examples = list(metadata.state_dict_metadata)[:4]
            raise StateDictMismatchError(
                f"{source} holds no optimizer state (no 'param_groups'; entries such as {examples}); a model "
                "checkpoint loads with booster.load_model"
            )
        sizes = sorted(self.groups)
        expected = len(optimizer.param_groups)
        if sizes != list(range(expected)) or any("params" not in settings for settings in self.groups.values()):
            raise refusal(
                optimizer,
                str(source),
                [
                    f"{len(sizes)} param groups in the checkpoint (each with its 'params'), {expected} in this "
                    "optimizer: it was saved for another model or other param groups"
                ],
            )


def plan_optimizer_load(optimizer: ChunkOptimizer, source: Path, metadata: Metadata) -> Reading[StagedOptimizerState]:
    """What this rank reads of a directory (``metadata``, DCP's): the saved state's structure and
    shapes checked against the optimizer, then this rank's pieces of it and the hyperparameters;
    ``finish`` checks the values read (parameters of each group, settings, state keys, loss scale)."""
    layout = _Layout(optimizer, metadata, source)
    saved = [
        (layout.infos[name], f"parameter '{name}' (shape {tuple(layout.infos[name].shape)})", state)
        for name, state in layout.state.items()
    ]
    checked = check_saved_layout(optimizer, str(source), saved, layout.problems)

    targets: dict[str, Entry] = {}
    for position, settings in layout.groups.items():
        for setting, value in settings.items():
            targets[f"param_groups.{position}.{setting}"] = read_whole(value)
    for key, value in layout.scaler.items():
        targets[f"loss_scaler.{key}"] = read_whole(value)
    staged_keys: list[tuple[Piece, str, str]] = []
    for piece in optimizer.pieces:
        parameter = piece.info.name
        for key, value in layout.state.get(parameter, {}).items():
            name = f"state.{parameter}.{key}"
            if (parameter, key) in checked.elementwise:
                staging = optimizer.state_staging(piece.chunk, piece.part.numel, value.dtype)
                targets[name] = FlatRange(staging, tuple(piece.info.shape), piece.param_slice.start)
            else:
                targets[name] = read_whole(value)
            staged_keys.append((piece, key, name))

    def finish() -> StagedOptimizerState:
        problems: list[str] = []
        hyperparameters: list[dict[str, Any]] = []
        for position, infos in enumerate(optimizer.group_infos):
            settings = {
                setting: targets[f"param_groups.{position}.{setting}"].value for setting in layout.groups[position]
            }
            names = settings.pop("params")
            if list(names) != [info.name for info in infos]:
                problems.append(
                    f"param group {position} holds the parameters {list(names)[:4]}... in the checkpoint, "
                    f"{[info.name for info in infos][:4]}... here: it was saved for other param groups"
                )
            hyperparameters.append(settings)
        scaler_state = {key: targets[f"loss_scaler.{key}"].value for key in layout.scaler} or None
        states: dict[torch.Tensor, dict[str, Any]] = {}
        for piece, key, name in staged_keys:
            states.setdefault(piece.tensor, {})[key] = targets[name].value
        return stage_read_state(optimizer, str(source), checked, saved, states, hyperparameters, scaler_state, problems)

    return Reading(targets, finish)
