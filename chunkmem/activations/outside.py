"""``OutsideStretches``: what autograd saves outside the named blocks during a training forward
(``ActivationPlacement(offload_outside=True)``: the embeddings, the head, a loss computed inside the
model's forward), offloaded by the same ``ActivationOffload`` as the blocks' calls.

The region outside the blocks is not one call: in the backward the head's and the loss's saved
tensors are needed first and the embeddings' last. So each stretch between block calls is an
offloaded call of its own, in forward order (fetched in backward order, ``max_prefetch`` calls
ahead, beside the blocks' calls of the same offload): the first begins when the model's forward
starts, a stretch ends when a named block's call starts and the next begins when it returns, the
last ends when the forward returns. One pair of saved-tensor hooks is entered for the whole
forward, below the blocks' own (offload, checkpoint, the ``auto`` keep): what a block saves is the
block's, and what is saved while a block runs but under no hooks of its own (the inputs a
checkpoint saves for its recomputation) stays as it is, as without this option.

The model's parameters and whatever shares their storage (chunk memory), tensor subclasses and
storages under ``min_offload_bytes`` stay as they are (``counting.SavedCount`` with the whole model
as the module). With ``auto`` blocks the stretches are calls of their plan, always offloaded and
held in the ledger as an offloaded ``auto`` call (``AutoBlocks.begin_stretch``); without, they are
outside the ledger, as the ``offload`` blocks' calls are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..usage.saved import unlinked
from .auto import AutoBlocks
from .offload import ActivationOffload, BlockCall

__all__ = ["OutsideStretches"]


class OutsideStretches:
    """The stretches of one model's training forwards outside its named blocks; see the module docstring."""

    def __init__(self, model: torch.nn.Module, offload: ActivationOffload, auto: AutoBlocks | None) -> None:
        self._model = model
        self._offload = offload
        self._auto = auto
        self._hooks: Any = None  # the saved-tensor hooks, while a training forward runs
        self._call: BlockCall | None = None  # the stretch now (None while a block runs)
        self._stretches = 0  # stretches begun in this forward

    def enter(self) -> None:
        """A training forward starts: the hooks are entered and its first stretch begins."""
        assert self._hooks is None, "a forward of the model inside its own forward"
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._offload.unpack)
        hooks.__enter__()
        self._hooks = hooks
        self._stretches = 0
        try:
            self._open()
        except BaseException:  # no stretch (an auto plan's room refused): the hooks go with the error
            self._hooks = None
            hooks.__exit__(None, None, None)
            raise

    def leave(self, finished: bool) -> None:
        """The forward returned (``finished``: its last stretch ends) or raised; the hooks go."""
        hooks, self._hooks = self._hooks, None
        try:
            if finished and self._call is not None:
                self._close()
        finally:
            self._call = None
            hooks.__exit__(None, None, None)

    @contextmanager
    def block(self) -> Iterator[None]:
        """Around a named block's call: the stretch before it ends, the next begins once it returned."""
        if self._hooks is None or self._call is None:  # no training forward, or inside a block's call
            yield
            return
        self._close()
        try:
            yield
        finally:  # also where the model catches what the block raised and goes on
            self._open()

    def _open(self) -> None:
        name = f"stretch {self._stretches} outside the blocks"
        self._stretches += 1
        if self._auto is not None:
            self._call = self._auto.begin_stretch(name, self._model)
            return
        call = self._offload.call(name, self._model)
        self._offload.begin(call)
        self._call = call

    def _close(self) -> None:
        call, self._call = self._call, None
        assert call is not None, "a stretch ends once"
        if self._auto is not None:
            self._auto.end_stretch(call)
        else:
            self._offload.finish(call)  # its writes to disk (beyond host_budget), agreed over ranks

    def _pack(self, tensor: torch.Tensor) -> Any:
        call = self._call
        return unlinked(tensor) if call is None else self._offload.pack(call, tensor)
