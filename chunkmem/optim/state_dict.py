"""The optimizer state in plain PyTorch's format, assembled from and cut back into this rank's pieces,
and the checks a saved state passes before it is installed, whichever format it was saved in.

PyTorch's format (``torch.optim.Optimizer.state_dict``): ``{"state": {id: {key: value}},
"param_groups": [{..., "params": [ids]}]}``, ids counting the original parameters group by group,
elementwise state tensors shaped like their parameter. It loads into the same optimizer class in
plain PyTorch, or into chunkmem at any world size, chunk size or placement.

Saving gathers chunk by chunk: one small exchange of per-parameter scalars (``step``) and of which
elementwise keys each chunk has, then one all-gather per chunk and state key into a transient
buffer (never a collective per parameter). What is read from the disk tier is agreed across ranks
before the collectives that follow it (one small exchange, and one per chunk on disk): a file that
cannot be read on one rank raises ``DiskTierError`` on every rank. Loading validates everything against the model (group
sizes, ids, state shapes, the state keys the optimizer class keeps, the loss scaler) on every rank
and agrees across ranks before anything is installed: a refused load changes nothing.

The checks are the same for this format and for a sharded checkpoint
(``chunkmem.checkpoint.sharded_optimizer``), which describes its saved tensors by tensors on the
meta device and comes here twice: :func:`check_saved_layout` before any value is read (shapes and
dtypes: it reads into buffers of those shapes; which entries are elementwise), and
:func:`stage_read_state` once the values are read (settings, state keys, the loss scale), which
refuses them or stages them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..chunks.tensor_state import TensorInfo
from ..device.moves import to_host
from ..errors import DiskTierError, StateDictMismatchError
from ..execution.gather import Destination, gather_full
from ..ranks.agreement import agree
from .piece import Piece, is_elementwise
from .probe import state_keys

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk
    from ..chunks.manager import ChunkManager
    from ..execution.runtime import ChunkRuntime
    from .loss_scale import DynamicLossScaler

__all__ = [
    "CheckedLayout",
    "OptimizerSide",
    "SavedState",
    "StagedOptimizerState",
    "check_saved_layout",
    "full_optimizer_state",
    "refusal",
    "slice_state",
    "stage_optimizer_state",
    "stage_read_state",
]

log = logging.getLogger("chunkmem")


class OptimizerSide(Protocol):
    """What this module reads of the optimizer (``ChunkOptimizer`` is one; named by its
    behaviour so that this module does not import the optimizer that imports it)."""

    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]

    @property
    def runtime(self) -> ChunkRuntime: ...
    @property
    def manager(self) -> ChunkManager: ...
    @property
    def pieces(self) -> tuple[Piece, ...]: ...
    @property
    def group_infos(self) -> tuple[tuple[TensorInfo, ...], ...]: ...
    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]: ...
    @property
    def loss_scaler(self) -> DynamicLossScaler | None: ...
    def piece_state(self, piece: Piece) -> dict[str, Any]: ...
    def state_on_disk(self, chunk: Chunk) -> bool: ...
    def resident_state(self, chunk: Chunk, write_back: bool = False) -> AbstractContextManager[None]: ...
    def load_local_state(
        self,
        states: Mapping[torch.Tensor, Mapping[str, Any]],
        hyperparameters: Sequence[Mapping[str, Any]] | None = None,
        scaler_state: Mapping[str, Any] | None = None,
        stateful: Sequence[TensorInfo] | None = None,
    ) -> None: ...


_Where = tuple[int, int]  # (chunk id, index in chunk): a parameter, the same on every rank
# Group settings that torch optimizers fill in themselves when a state dict lacks them.
_FILLED_BY_TORCH = frozenset({"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"})
_MAX_LISTED = 12


def _where(info: TensorInfo) -> _Where:
    return (info.chunk_id, info.index)


def slice_state(state: Mapping[str, Any], piece: Piece) -> dict[str, Any]:
    """A parameter's full optimizer state cut down to a piece: tensors shaped like the parameter
    are sliced (elementwise state), anything else is kept. Devices and dtypes are left to
    ``Optimizer.load_state_dict``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.info.shape:
            # A view: installing copies it (runs concatenate their pieces), so a file mapped by
            # torch.load is read one run at a time, not all at once.
            out[key] = value.detach().reshape(-1)[piece.param_slice]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


# --- saving -----------------------------------------------------------------------------------
def full_optimizer_state(optimizer: OptimizerSide, destination: Destination) -> dict[str, Any]:
    """The full PyTorch-format state on the ranks ``destination`` names (``{}`` elsewhere), on the
    CPU. A collective: every rank calls it."""
    runtime = optimizer.runtime
    runtime.enter_state_access("gathering an optimizer state")
    comm = optimizer.manager.comm
    elementwise, scalars = agree(
        comm, "reading the optimizer state", lambda: _keys_and_scalars(optimizer), DiskTierError
    )
    merged_keys: dict[int, dict[str, str]] = {}
    merged: dict[_Where, dict[str, Any]] = {}
    for their_keys, their_scalars in comm.all_gather_object((elementwise, scalars)):
        for chunk_id, keys in their_keys.items():
            merged_keys.setdefault(chunk_id, {}).update(keys)
        for where, entry in their_scalars.items():
            mine = merged.setdefault(where, {})
            for key, value in entry.items():
                if mine.get(key) is None:
                    mine[key] = value
    receives = destination.receives(comm.rank)
    pieces_of: dict[int, list[Piece]] = {}
    for piece in optimizer.pieces:
        pieces_of.setdefault(piece.chunk.chunk_id, []).append(piece)
    for chunk in optimizer.manager.chunks:
        keys = merged_keys.get(chunk.chunk_id, {})
        if not keys:
            continue

        def read(chunk: Chunk = chunk, keys: dict[str, str] = keys) -> dict[str, torch.Tensor]:
            return _state_shards(optimizer, chunk, keys, pieces_of.get(chunk.chunk_id, []))

        if optimizer.state_on_disk(chunk):
            shards = agree(
                comm, f"reading the optimizer state of chunk {chunk.chunk_id} from disk", read, DiskTierError
            )
        else:
            shards = read()
        for key, shard in sorted(shards.items()):
            full = gather_full(runtime, comm, chunk, shard, destination, f"gathering optimizer state '{key}'")
            if full is None:
                continue
            for info in chunk.layout.tensors:
                entry = merged.get(_where(info))
                if entry is not None and key in entry:
                    entry[key] = full[info.offset : info.offset + info.numel].view(info.shape).clone()
    if not receives:
        return {}
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group, infos in zip(optimizer.param_groups, optimizer.group_infos, strict=True):
        ids = []
        for info in infos:
            entry = merged.get(_where(info)) if info.trainable else None
            if entry is not None:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    if optimizer.loss_scaler is not None:
        out["loss_scaler"] = optimizer.loss_scaler.state_dict()
    return out


def _keys_and_scalars(optimizer: OptimizerSide) -> tuple[dict[int, dict[str, str]], dict[_Where, dict[str, Any]]]:
    """This rank's elementwise state keys (with their dtype) per chunk, and each parameter's other
    state values (``None`` placeholders for the elementwise ones, in the class's key order)."""
    elementwise: dict[int, dict[str, str]] = {}
    scalars: dict[_Where, dict[str, Any]] = {}
    for piece in optimizer.pieces:
        state = optimizer.piece_state(piece)
        if not state:
            continue
        entry = scalars.setdefault(_where(piece.info), {})
        for key, value in state.items():
            if is_elementwise(value, piece.tensor):
                elementwise.setdefault(piece.chunk.chunk_id, {})[key] = str(value.dtype).removeprefix("torch.")
                entry.setdefault(key, None)  # keeps the class's key order; filled after the gather
            else:
                entry[key] = to_host(value.detach()).clone() if isinstance(value, torch.Tensor) else value
    return elementwise, scalars


def _state_shards(
    optimizer: OptimizerSide, chunk: Chunk, keys: Mapping[str, str], pieces: Sequence[Piece]
) -> dict[str, torch.Tensor]:
    """This rank's shard of each elementwise state ``keys`` names (key -> dtype name) of ``chunk``,
    on the CPU (zero where this rank's pieces have none), read in one pass when on disk."""
    shards = {key: torch.zeros(chunk.layout.shard_numel, dtype=getattr(torch, name)) for key, name in keys.items()}
    with optimizer.resident_state(chunk):  # one chunk in memory at a time when on disk
        for piece in pieces:
            state = optimizer.piece_state(piece)
            for key, shard in shards.items():
                value = state.get(key)
                if value is not None:
                    shard[piece.shard_slice] = to_host(value.detach())
    return shards


# --- loading ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagedOptimizerState:
    """A validated state, cut down to this rank's pieces, ready to install."""

    states: dict[torch.Tensor, dict[str, Any]]
    hyperparameters: list[dict[str, Any]]
    scaler_state: dict[str, Any] | None
    stateful: list[TensorInfo]
    """Parameters with state in the full state (the same on every rank)."""

    def install(self, optimizer: OptimizerSide) -> None:
        optimizer.load_local_state(self.states, self.hyperparameters, self.scaler_state, self.stateful)


def refusal(optimizer: OptimizerSide, source: str, problems: list[str]) -> StateDictMismatchError:
    """The error refusing a state for ``problems`` (listed, the first dozen)."""
    listed = "\n  - ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return StateDictMismatchError(
        f"cannot load the optimizer state from {source} into this {optimizer.optimizer_class.__name__}; nothing "
        f"was changed:\n  - {listed}{more}"
    )


def _not_an_optimizer_state(source: str, state_dict: Any) -> StateDictMismatchError:
    if isinstance(state_dict, Mapping):
        keys = list(state_dict)[:4]
        if state_dict and all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            return StateDictMismatchError(
                f"{source} holds a model state dict (entries such as {keys}), not an optimizer state: load it with "
                "booster.load_model / model.load_state_dict"
            )
        return StateDictMismatchError(
            f"{source} is not an optimizer state dict: it has the keys {keys}, a torch optimizer state dict has "
            "'state' and 'param_groups'"
        )
    return StateDictMismatchError(f"{source} is not an optimizer state dict but a {type(state_dict).__name__}")


def _check_scaler_state(state: Any) -> str | None:
    """What is wrong with a saved loss scaler state, or ``None``."""
    if not isinstance(state, Mapping) or set(state) != {"scale", "clean_steps"}:
        return f"'loss_scaler' must be a mapping with 'scale' and 'clean_steps', got {state!r}"
    scale, clean = state["scale"], state["clean_steps"]
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        return f"'loss_scaler' scale must be a finite number > 0, got {scale!r}"
    if not isinstance(clean, int) or isinstance(clean, bool) or clean < 0:
        return f"'loss_scaler' clean_steps must be an integer >= 0, got {clean!r}"
    return None


def _lacking_settings(optimizer: OptimizerSide, group: Mapping[str, Any], saved_group: Mapping[str, Any]) -> list[str]:
    """Settings of ``group`` that the optimizer class needs and ``saved_group`` lacks."""
    return sorted(k for k in group if k in optimizer.defaults and k not in saved_group and k not in _FILLED_BY_TORCH)


SavedState = tuple[TensorInfo, str, Mapping[str, Any]]
"""A parameter's saved state: the parameter, how messages name it, and its state by key (tensors
with their values, or on the meta device; other values as saved)."""


def _saved_elementwise(value: Any, info: TensorInfo) -> bool:
    """Whether a saved state value is elementwise: a tensor of at least one dimension, unless it
    is a one-element tensor of another shape than the parameter's (a scalar)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and not (value.numel() == 1 and tuple(value.shape) != tuple(info.shape))
    )


def _check_state_shapes(optimizer: OptimizerSide, saved: Sequence[SavedState]) -> tuple[list[str], list[str]]:
    """What is wrong with the shapes and dtypes of the saved elementwise state, and the names of
    the parameters whose state is not loaded (they do not require grad here)."""
    problems: list[str] = []
    dropped: list[str] = []
    for info, where, entry in saved:
        if not info.trainable:
            dropped.append(info.name)
            continue
        for key, value in entry.items():
            if not _saved_elementwise(value, info):
                continue  # scalars (a step count) are kept whole
            if tuple(value.shape) != tuple(info.shape):
                problems.append(
                    f"state '{key}' of {where} has shape {tuple(value.shape)}: it was saved for a parameter of "
                    "another shape"
                )
            elif not (value.is_floating_point() or value.is_complex()):
                problems.append(f"state '{key}' of {where} has dtype {value.dtype}, not a floating point dtype")
    return problems, dropped


def _check_settings(
    optimizer: OptimizerSide,
    settings: Sequence[Mapping[str, Any]],
    saved: Sequence[tuple[TensorInfo, str, Collection[str]]],
    scaler_state: Any,
) -> list[str]:
    """What is wrong with the saved settings of each param group (one the optimizer class needs
    is missing), with the state keys of each parameter (not those the class keeps with these
    settings) and with the loss scaler's state."""
    problems: list[str] = []
    keys_by_group: list[frozenset[str] | None] = []
    for position, (saved_group, group) in enumerate(zip(settings, optimizer.param_groups, strict=True)):
        lacking = _lacking_settings(optimizer, group, saved_group)
        if lacking:
            problems.append(f"param group {position} lacks the settings {lacking}")
        keys_by_group.append(state_keys(optimizer.optimizer_class, {**group, **saved_group}) if not lacking else None)
    group_of = {id(info): position for position, infos in enumerate(optimizer.group_infos) for info in infos}
    for info, where, keys in saved:
        expected = keys_by_group[group_of[id(info)]]
        if info.trainable and expected is not None and set(keys) != expected:
            problems.append(
                f"the state of {where} has the keys {sorted(keys)}, but {optimizer.optimizer_class.__name__} with "
                f"these settings keeps {sorted(expected)}: it was saved by another optimizer class or settings"
            )
    if scaler_state is not None:
        problem = _check_scaler_state(scaler_state)
        if problem:
            problems.append(problem)
    return problems


def _accept(optimizer: OptimizerSide, source: str, problems: list[str], dropped: list[str], scaler_state: Any) -> None:
    """Refuse a state with ``problems`` (listing them); say what a valid one leaves unused."""
    if problems:
        raise refusal(optimizer, source, problems)
    if dropped:
        log.warning(
            "chunkmem: %s has optimizer state for %d parameter(s) that do not require grad here (%s...); it is "
            "not loaded",
            source,
            len(dropped),
            ", ".join(dropped[:3]),
        )
    if scaler_state is not None and optimizer.loss_scaler is None:
        log.info("chunkmem: %s holds an fp16 loss scale; this run is not fp16, so it is not used", source)


@dataclass(frozen=True)
class CheckedLayout:
    """A sharded checkpoint's saved state, its structure checked before any value is read."""

    elementwise: frozenset[tuple[str, str]]
    """The (parameter name, state key) pairs saved elementwise: read into this rank's pieces."""
    dropped: list[str]
    """Parameters with saved state that do not require grad here (not loaded)."""


def check_saved_layout(
    optimizer: OptimizerSide, source: str, saved: Sequence[SavedState], problems: Sequence[str] = ()
) -> CheckedLayout:
    """Refuse a saved state (``saved``: its values as tensors on the meta device) whose shapes or
    dtypes are wrong, or with the caller's ``problems``, listing every one; otherwise say which of
    its entries are elementwise and which parameters' state is not loaded. Reads nothing."""
    shape_problems, dropped = _check_state_shapes(optimizer, saved)
    if problems or shape_problems:
        raise refusal(optimizer, source, [*problems, *shape_problems])
    elementwise = frozenset(
        (info.name, key) for info, _, entry in saved for key, value in entry.items() if _saved_elementwise(value, info)
    )
    return CheckedLayout(elementwise, dropped)


def stage_read_state(
    optimizer: OptimizerSide,
    source: str,
    checked: CheckedLayout,
    saved: Sequence[SavedState],
    states: dict[torch.Tensor, dict[str, Any]],
    hyperparameters: list[dict[str, Any]],
    scaler_state: dict[str, Any] | None,
    problems: Sequence[str] = (),
) -> StagedOptimizerState:
    """What a sharded load read (``states``: this rank's pieces' state; each group's
    ``hyperparameters``; the loss scaler's state), refused with the caller's ``problems`` and
    those of its settings, state keys and loss scale, listing every one, or staged."""
    found = [*problems, *_check_settings(optimizer, hyperparameters, saved, scaler_state)]
    _accept(optimizer, source, found, checked.dropped, scaler_state)
    # Which parameters have state is read from the checkpoint's layout, the same on every rank.
    stateful = [info for info, _, _ in saved if info.name not in checked.dropped]
    return StagedOptimizerState(states, hyperparameters, scaler_state, stateful)


def stage_optimizer_state(optimizer: OptimizerSide, state_dict: Any, source: str) -> StagedOptimizerState:
    """Check ``state_dict`` (PyTorch's format) against the optimizer and the model and cut it to
    this rank's pieces; raise :class:`StateDictMismatchError` listing every problem. Writes nothing."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise _not_an_optimizer_state(source, state_dict)
    saved_groups, saved = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, list | tuple) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list | tuple) for g in saved_groups
    ):
        raise refusal(optimizer, source, ["'param_groups' must be a list of mappings, each with a 'params' list"])
    if not isinstance(saved, Mapping):
        raise refusal(optimizer, source, [f"'state' must be a mapping, got {type(saved).__name__}"])
    infos_by_group = optimizer.group_infos
    sizes = [len(g["params"]) for g in saved_groups]
    expected = [len(infos) for infos in infos_by_group]
    if sizes != expected:
        raise refusal(
            optimizer,
            source,
            [
                f"param groups of sizes {sizes} in the file, {expected} in this optimizer: it was saved for another "
                "model or other param groups"
            ],
        )
    problems: list[str] = []
    info_of: dict[Any, TensorInfo] = {}
    id_of: dict[int, Any] = {}
    for saved_group, infos in zip(saved_groups, infos_by_group, strict=True):
        for pid, info in zip(saved_group["params"], infos, strict=True):
            if pid in info_of:
                problems.append(f"parameter id {pid!r} appears twice in 'param_groups'")
            info_of[pid] = info
            id_of[id(info)] = pid
    entries: list[SavedState] = []
    for pid, entry in saved.items():
        info = info_of.get(pid)
        if info is None and isinstance(pid, str) and pid.isdigit():
            info = info_of.get(int(pid))
        if info is None:
            problems.append(f"'state' has an entry for parameter id {pid!r}, which no param group lists")
            continue
        where = f"parameter '{info.name}' (id {pid!r}, shape {tuple(info.shape)})"
        if not isinstance(entry, Mapping):
            problems.append(f"the state of {where} is a {type(entry).__name__}, not a mapping")
            continue
        entries.append((info, where, entry))
    shape_problems, dropped = _check_state_shapes(optimizer, entries)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
    scaler_state = state_dict.get("loss_scaler")
    problems += shape_problems + _check_settings(optimizer, hyper, entries, scaler_state)
    _accept(optimizer, source, problems, dropped, scaler_state)
    states: dict[torch.Tensor, dict[str, Any]] = {}
    for piece in optimizer.pieces:
        pid = id_of[id(piece.info)]
        entry = saved.get(pid, saved.get(str(pid)))
        if entry:
            states[piece.tensor] = slice_state(entry, piece)
    stateful = [
        info
        for group in optimizer.group_infos
        for info in group
        if saved.get(id_of[id(info)], saved.get(str(id_of[id(info)])))
    ]
    return StagedOptimizerState(states, hyper, dict(scaler_state) if scaler_state is not None else None, stateful)
