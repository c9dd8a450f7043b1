"""``StepRuns``: the flat tensors the user's optimizer steps.

This rank holds, of each parameter, a piece: a slice of its chunk's fp32 master shard. Pieces of one
param group that sit next to each other in one shard form a **run** (of up to ``RUN_ELEMENTS``), a
single view of the master shard, and the optimizer steps runs, not pieces: one tensor per run
instead of one per parameter, which is what makes a fused kernel (or any kernel) run at memory speed
rather than at Python speed on models with many small parameters. For an elementwise optimizer,
stepping a run is exactly stepping each of its pieces (the update of an element depends only on that
element's own history and on per-parameter scalars such as Adam's step count).

So a run only holds pieces that share every non-elementwise state value. PyTorch skips a parameter
without a gradient (its step count stays behind), so a step on which some of a run's pieces have a
gradient and others have none splits the run for good; a loaded state whose pieces differ in such
values is cut into runs along the differences. The optimizer's state is kept per run (the inner
optimizer looks it up by the tensors it steps); a piece's state is a view of its run's
(:meth:`StepRuns.piece_state`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..usage.accounting import Location
from .piece import Piece, is_elementwise

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk
    from .optimizer_state import OptimizerState

__all__ = ["Run", "StepRuns", "same_value"]


@dataclass(eq=False)
class Run:
    """Consecutive pieces of one chunk shard in one param group, stepped as one tensor."""

    group: int
    pieces: tuple[Piece, ...]
    tensor: torch.Tensor
    """The view of the master shard the optimizer steps (``master[start:stop]``)."""
    start: int
    """First element in this rank's shard."""
    location: Location
    """Where the master lives (it does not move once an optimizer holds views of it)."""

    @property
    def chunk(self) -> Chunk:
        return self.pieces[0].chunk

    @property
    def stop(self) -> int:
        return self.start + self.tensor.numel()

    def describe(self) -> str:
        names = [p.info.name for p in self.pieces]
        shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} parameters)"
        return f"run of chunk {self.chunk.chunk_id} [{self.start}, {self.stop}) in param group {self.group}: {shown}"


def same_value(a: Any, b: Any) -> bool:
    """Equal per-parameter state values (tensors by dtype, device and value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.device == b.device
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return bool(a == b)


# The most elements a run gathers from several pieces (4 MiB of fp32; a larger piece is a run of its
# own). An optimizer stepping tensor by tensor (PyTorch's default on a CPU) allocates temporaries
# the size of two or three consecutive tensors (Adam: sqrt and quotient of one while the previous
# denominator lives), so runs much larger than the model's parameters raised the step's peak host
# memory above plain PyTorch's (GPT-2 124M at W=1: chunk-sized runs of 111 MiB after the 147 MiB
# embedding, 369 MiB of temporaries against 295). Runs this large already step at memory speed.
RUN_ELEMENTS = 1 << 20


def _consecutive(pieces: Sequence[Piece]) -> Iterator[list[Piece]]:
    """Pieces of one group cut where the chunk changes or the shard has a gap between them (a
    trainable parameter of no param group sits there), and before a piece that would take a run
    past ``RUN_ELEMENTS``."""
    ordered = sorted(pieces, key=lambda p: (p.chunk.chunk_id, p.shard_slice.start))
    current: list[Piece] = []
    size = 0
    for piece in ordered:
        span = piece.shard_slice.stop - piece.shard_slice.start
        if current and (
            piece.chunk is not current[-1].chunk
            or piece.shard_slice.start != current[-1].shard_slice.stop
            or size + span > RUN_ELEMENTS
        ):
            yield current
            current, size = [], 0
        current.append(piece)
        size += span
    if current:
        yield current


class StepRuns:
    """The runs of every param group, and the optimizer state kept per run; see the module
    docstring. ``state``: the inner optimizer's, whose table is keyed by the tensors it steps."""

    def __init__(self, state: OptimizerState) -> None:
        self._state = state
        self._disk_view: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        self._before_access: Callable[[str], None] | None = None
        self._groups: list[list[Run]] = []
        self._run_of: dict[int, Run] = {}  # id(piece.tensor) -> its run

    # --- building ---------------------------------------------------------------------------
    def add_group(self, pieces: Sequence[Piece]) -> list[torch.Tensor]:
        """Runs for a new param group (its pieces have no state yet); returns their tensors."""
        self.settle_early_steps("a param group is added")
        group = len(self._groups)
        runs = [self._make(group, part) for part in _consecutive(pieces)]
        self._groups.append(runs)
        return [run.tensor for run in runs]

    def _make(self, group: int, pieces: Sequence[Piece]) -> Run:
        start, stop = pieces[0].shard_slice.start, pieces[-1].shard_slice.stop
        store = pieces[0].chunk.store
        run = Run(group, tuple(pieces), store.master_slice(start, stop), start, store.master_location)
        for piece in pieces:
            self._run_of[id(piece.tensor)] = run
        return run

    def settle_early_steps_with(self, cancel: Callable[[str], None]) -> None:
        """Early host steps (``EarlySteps.cancel``) are put back before anything but their worker
        reads or changes the state kept here: a save would read state the step has not taken yet,
        a load or a new group would be overwritten by an undo after it."""
        self._before_access = cancel

    def settle_early_steps(self, what: str) -> None:
        """``what`` is about to read or change the state kept here: early steps go back first."""
        if self._before_access is not None:
            self._before_access(what)

    def read_from_disk(self, view: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """How to read a state tensor whose values are on disk now (``DiskSides.view_of``)."""
        self._disk_view = view

    # --- reading ----------------------------------------------------------------------------
    @property
    def groups(self) -> tuple[tuple[Run, ...], ...]:
        return tuple(tuple(runs) for runs in self._groups)

    def runs(self) -> Iterator[Run]:
        for runs in self._groups:
            yield from runs

    def tensors(self, group: int) -> list[torch.Tensor]:
        """What param group ``group`` holds for the optimizer: its runs' tensors."""
        return [run.tensor for run in self._groups[group]]

    def run_of(self, piece: Piece) -> Run:
        return self._run_of[id(piece.tensor)]

    def piece_state(self, piece: Piece) -> dict[str, Any]:
        """The optimizer state of one piece: views of its run's elementwise state, and the run's
        other values (shared by all its pieces). Empty when the piece has no state yet. An
        elementwise state that is on disk now (``DiskSides``) is a view mapped from its file."""
        self.settle_early_steps("the optimizer state is read")
        run = self.run_of(piece)
        state = self._state.table.get(run.tensor)
        if not state:
            return {}
        begin = piece.shard_slice.start - run.start
        end = piece.shard_slice.stop - run.start
        out = {}
        for key, value in state.items():
            if not is_elementwise(value, run.tensor):
                out[key] = value
            elif value.untyped_storage().nbytes() < value.nbytes:
                on_disk = self._disk_view(value) if self._disk_view is not None else None
                if on_disk is None:
                    raise RuntimeError(f"{run.describe()}: its state '{key}' is neither in memory nor on disk")
                out[key] = on_disk[begin:end]
            else:
                out[key] = value[begin:end]
        return out

    def state_bytes(self, location: Callable[[Chunk], Location]) -> dict[Location, int]:
        """Bytes of optimizer state tensors per location (``location`` of each run's chunk)."""
        out = dict.fromkeys(Location, 0)
        for run in self.runs():
            for value in (self._state.table.get(run.tensor) or {}).values():
                if isinstance(value, torch.Tensor):
                    out[location(run.chunk)] += value.nbytes
        return out

    # --- changing ---------------------------------------------------------------------------
    def split_by_gradient(self, has_grad: Mapping[int, bool], only: Callable[[Chunk], bool] | None = None) -> None:
        """Before a step: cut each run whose pieces do not all have a gradient (``has_grad`` by
        ``id(piece.tensor)``) where that changes, so that every run is stepped whole or not at
        all, as PyTorch steps each parameter that has a gradient. ``only``: the runs of the chunks
        it accepts (``has_grad`` need only cover their pieces); their state must be in memory."""
        for group, runs in enumerate(self._groups):
            out: list[Run] = []
            for run in runs:
                if only is not None and not only(run.chunk):
                    out.append(run)
                    continue
                flags = [has_grad[id(p.tensor)] for p in run.pieces]
                if all(flags) or not any(flags):
                    out.append(run)
                    continue
                parts: list[list[Piece]] = []
                for piece, flag in zip(run.pieces, flags, strict=True):
                    if parts and flag == has_grad[id(parts[-1][-1].tensor)]:
                        parts[-1].append(piece)
                    else:
                        parts.append([piece])
                out.extend(self._split(group, run, parts))
            self._groups[group] = out

    def _split(self, group: int, run: Run, parts: Sequence[Sequence[Piece]]) -> list[Run]:
        """Cut ``run`` into runs of ``parts``, each with its share of the state, copied (each run
        owns its state: the disk tier moves whole state tensors; the parts may differ from now
        on). The state must be in memory."""
        state = self._state.table.pop(run.tensor, None)
        runs = [self._make(group, part) for part in parts]
        if state:
            for new in runs:
                begin, end = new.start - run.start, new.stop - run.start
                self._state.table[new.tensor] = {
                    key: value[begin:end].clone() if is_elementwise(value, run.tensor) else copy.deepcopy(value)
                    for key, value in state.items()
                }
        return runs

    def regroup(
        self, states: Mapping[int, Mapping[str, Any]], later: Callable[[Chunk], bool] | None = None
    ) -> tuple[dict[torch.Tensor, dict[str, Any]], dict[int, Callable[[], dict[torch.Tensor, dict[str, Any]]]]]:
        """Runs for a state being loaded (``states`` by ``id(piece.tensor)``, each piece's own, on
        the CPU or anywhere): the pieces of each group cut where their per-parameter values differ
        or where one has state and the next has none. Returns each run's state (elementwise state
        concatenated over its pieces) for the caller to install through the optimizer's own
        ``load_state_dict``, and, for the chunks ``later`` accepts, by chunk id, a function that
        builds them when called (one chunk's states in memory at a time: the disk tier's). The
        runs replace the old ones, whose state is forgotten."""
        self.settle_early_steps("an optimizer state is loaded")
        loaded: dict[torch.Tensor, dict[str, Any]] = {}
        deferred: dict[int, list[tuple[Run, list[Mapping[str, Any]]]]] = {}
        for group, runs in enumerate(self._groups):
            out: list[Run] = []
            for part in _consecutive([p for run in runs for p in run.pieces]):
                for pieces in self._alike(part, states):
                    run = self._make(group, pieces)
                    out.append(run)
                    parts = [states.get(id(p.tensor)) or {} for p in pieces]
                    if later is not None and later(run.chunk):
                        deferred.setdefault(run.chunk.chunk_id, []).append((run, parts))
                        continue
                    state = _concatenated(run, parts)
                    if state:
                        loaded[run.tensor] = state
            self._groups[group] = out
        self._state.table.clear()

        def builder(entries: list[tuple[Run, list[Mapping[str, Any]]]]) -> Callable[[], dict[torch.Tensor, Any]]:
            def build() -> dict[torch.Tensor, dict[str, Any]]:
                built = {run.tensor: _concatenated(run, parts) for run, parts in entries}
                return {tensor: state for tensor, state in built.items() if state}

            return build

        return loaded, {chunk_id: builder(entries) for chunk_id, entries in deferred.items()}

    @staticmethod
    def _alike(pieces: Sequence[Piece], states: Mapping[int, Mapping[str, Any]]) -> Iterator[list[Piece]]:
        current: list[Piece] = []
        for piece in pieces:
            if current and not _compatible(states.get(id(current[0].tensor)), states.get(id(piece.tensor)), piece):
                yield current
                current = []
            current.append(piece)
        if current:
            yield current


def _compatible(first: Mapping[str, Any] | None, other: Mapping[str, Any] | None, piece: Piece) -> bool:
    """Whether ``piece`` with state ``other`` may join a run whose first piece has ``first``."""
    first, other = first or {}, other or {}
    if set(first) != set(other):
        return False
    for key, value in other.items():
        mine = first[key]
        if is_elementwise(value, piece.part.numel):
            if not isinstance(mine, torch.Tensor) or mine.dim() != 1 or mine.dtype != value.dtype:
                return False
        elif not same_value(mine, value):
            return False
    return True


def _concatenated(run: Run, states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    parts = list(states)
    if not parts or not parts[0]:
        return {}
    out: dict[str, Any] = {}
    for key, value in parts[0].items():
        if is_elementwise(value, run.pieces[0].part.numel):
            out[key] = torch.cat([state[key].reshape(-1) for state in parts])
        else:
            out[key] = value
    return out
