"""``GradientRouter``: gradients from autograd into the chunks' flat buffers, and when each buffer's
reduction starts and ends.

A chunk's reduce-scatter starts, asynchronously, as soon as every one of its parameters has its
gradient for this backward (its ``all_ready_for_reduce``), so communication overlaps the rest of the
backward; the router waits for reductions only where it must: at the end of backward, before the
optimizer reads gradients, or when the plan executor needs the buffer's memory. Inside ``no_sync``
at world size > 1 nothing is reduced: buffers keep accumulating until the first synchronised
backward. Where the buffers' memory comes from is the plan executor's business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .chunk import Chunk
from .manager import ChunkManager
from .stats import Stats
from .tensor_state import TensorInfo

__all__ = ["GradientRouter"]


class GradientRouter:
    """See the module docstring."""

    def __init__(self, manager: ChunkManager, stats: Stats) -> None:
        self._manager = manager
        self._stats = stats
        self._world_size = manager.comm.world_size
        self._sync = True
        self._accepting: dict[int, None] = {}  # chunks whose buffer receives gradients
        self._reducing: dict[int, None] = {}  # chunks whose reduction is in flight, in start order
        self._on_start: Callable[[Chunk], None] | None = None

    def on_start(self, listener: Callable[[Chunk], None] | None) -> None:
        """Call ``listener`` with each chunk whose reduction has just started."""
        self._on_start = listener

    # --- state ----------------------------------------------------------------------------------
    @property
    def syncing(self) -> bool:
        """Gradients are reduced over ranks (not inside ``no_sync``)."""
        return self._sync

    @property
    def can_reduce(self) -> bool:
        """A reduction may run now: always at world size 1 (nothing to communicate), else only
        outside ``no_sync``."""
        return self._sync or self._world_size == 1

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; no gradient collective until the block exits."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def accepting(self) -> tuple[int, ...]:
        """Chunks whose buffer receives gradients now."""
        return tuple(self._accepting)

    @property
    def reducing(self) -> tuple[int, ...]:
        """Chunks whose reduction is in flight, oldest first."""
        return tuple(self._reducing)

    def has_buffer(self, chunk_id: int) -> bool:
        return chunk_id in self._accepting

    # --- verbs ----------------------------------------------------------------------------------
    def prepare(self, chunk: Chunk) -> None:
        """Give ``chunk`` a buffer (its memory already made room for); a reduction still in flight
        for it finishes first."""
        if chunk.chunk_id in self._reducing:
            self.finish(chunk)
        chunk.prepare_grad()
        self._accepting[chunk.chunk_id] = None

    def accumulate(self, chunk: Chunk, info: TensorInfo, grad: torch.Tensor) -> None:
        """Add a parameter's gradient; start the chunk's reduction once all its gradients are in."""
        chunk.accumulate_grad(info, grad)
        if chunk.all_ready_for_reduce and self.can_reduce:
            self.start(chunk)

    def start(self, chunk: Chunk) -> None:
        """Start reducing ``chunk``'s buffer (asynchronous)."""
        chunk.start_reduce()
        del self._accepting[chunk.chunk_id]
        self._reducing[chunk.chunk_id] = None
        if self._on_start is not None:
            self._on_start(chunk)

    def finish(self, chunk: Chunk) -> None:
        """Wait for ``chunk``'s reduction and free its buffer."""
        chunk.finish_reduce()
        del self._reducing[chunk.chunk_id]

    def flush(self, chunk: Chunk) -> None:
        """Free ``chunk``'s buffer now: finish its reduction in flight, or reduce it early (its
        later gradients go to a fresh buffer)."""
        if chunk.chunk_id in self._accepting:
            self.start(chunk)
            self._stats.grad_flushes += 1
        self.finish(chunk)

    def finish_all(self) -> None:
        """Wait for every reduction in flight (their order of start)."""
        for chunk_id in list(self._reducing):
            self.finish(self._manager.chunk(chunk_id))

    def reduce_all(self) -> None:
        """Reduce every buffer still accepting (in chunk order, the same on every rank), then wait
        for all reductions."""
        for chunk_id in sorted(self._accepting):
            self.start(self._manager.chunk(chunk_id))
        self.finish_all()

    def zero(self) -> None:
        """Drop all gradients (reductions in flight are waited for first: their buffers are in use)."""
        self.finish_all()
        for chunk in self._manager.chunks:
            chunk.zero_grad()
        self._accepting.clear()
