"""``StateLedger``: the optimizer state the ledger accounts, where ``SidePlaces`` says it lives.

For each chunk one of whose parameters has state (on some rank) it accounts what the placement
reserved, ``StateSize.reserved``: an upper bound over ranks, so every rank's ledger, and every
placement decision made from it, is the same without a collective. This rank's actual state must
fit in it (the optimizer was probed for that). Elementwise state keeps its size, so both are
measured again only when state appeared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import NotSupportedError
from ..usage.accounting import Location, MemoryKind
from .optimizer_state import OptimizerState
from .places import SidePlaces
from .probe import StateSize
from .runs import StepRuns

if TYPE_CHECKING:
    from ..chunks.manager import ChunkManager
    from ..chunks.tensor_state import TensorInfo

__all__ = ["StateLedger"]


class StateLedger:
    """See the module docstring. ``state``: the inner optimizer's."""

    def __init__(
        self,
        manager: ChunkManager,
        places: SidePlaces,
        size: StateSize,
        runs: StepRuns,
        state: OptimizerState,
    ) -> None:
        self._manager = manager
        self._places = places
        self._size = size
        self._runs = runs
        self._state = state
        self._stateful: set[int] = set()  # ids of the TensorInfos whose optimizer state exists (on some rank)
        self._accounted: Counter[Location] = Counter()
        self._accounted_for: tuple[int, int, int] | None = None  # what ``account`` measured last

    def note_stateful(self, infos: Iterable[TensorInfo]) -> None:
        """These parameters have state now (a gradient on some rank stepped them, or a load)."""
        self._stateful.update(id(info) for info in infos)

    def replace_stateful(self, infos: Iterable[TensorInfo]) -> None:
        """Exactly these parameters have state (a load: the same on every rank)."""
        self._stateful = {id(info) for info in infos}

    def account(self) -> None:
        """Bring the ledger to what is reserved for the chunks with state; refuse an optimizer
        whose state outgrew what probing it predicted."""
        table = self._state.table
        key = (len(self._stateful), len(table), id(table))
        if key == self._accounted_for:
            return
        self._accounted_for = key
        reserved: Counter[Location] = Counter()
        for chunk in self._manager.chunks:
            if chunk.layout.trainable and any(id(info) in self._stateful for info in chunk.layout.tensors):
                layout = chunk.layout
                reserved[self._places.states(chunk)] += self._size.reserved(layout.shard_numel, len(layout.tensors))
        actual = self._runs.state_bytes(self._places.states)
        for location in Location:
            if actual[location] > reserved[location]:
                raise NotSupportedError(
                    f"rank {self._manager.comm.rank}: {self._state.name} holds {actual[location]} bytes of state on "
                    f"the {location.value}, more than the {reserved[location]} that probing it predicted "
                    f"({self._size}): "
                    "its state does not grow like an elementwise optimizer's, so chunkmem cannot plan memory for it. "
                    "Use an elementwise optimizer such as AdamW."
                )
        ledger = self._manager.ledger
        for location in Location:
            delta = reserved[location] - self._accounted[location]
            if delta > 0:
                ledger.alloc(location, MemoryKind.OPTIM_STATE, delta)
            elif delta < 0:
                ledger.free(location, MemoryKind.OPTIM_STATE, -delta)
        self._accounted = reserved
