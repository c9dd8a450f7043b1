"""``Replayer``: computes one recorded tensor for real, on the CPU, from an
:class:`~chunkmem.materialize.graph.OpGraph`.

Only what the tensor depends on is run: its storage's creator and writes up to the version the
tensor saw, and, recursively, the storages those ops read. Random ops run from the generator state
saved when they were recorded, so each tensor comes out as the CPU would have computed it whatever
order tensors are asked for in (and whichever ones are never asked for). The caller's generator
states are restored afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.torch import tree_leaves, tree_map
from ..errors import MaterializeError
from .graph import Const, Node, OpGraph, TensorRef

__all__ = ["Replayer"]

_CPU = torch.device("cpu")
_Memo = dict[tuple[int, int], torch.UntypedStorage]


def _view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=_CPU).set_(storage, ref.offset, ref.size, ref.stride)


class Replayer:
    """Computes tensors of one graph (see the module docstring)."""

    def __init__(self, graph: OpGraph) -> None:
        self._graph = graph

    def value(self, ref: TensorRef, out: torch.UntypedStorage | None = None) -> torch.Tensor:
        """The values ``ref`` saw, as a CPU tensor of its shape. Raises ``MaterializeError`` when
        they were not all computed by recorded ops.

        With ``out`` (a CPU storage at least as large as ``ref``'s), the result is built in it
        whenever what the storage first held cannot show (it starts from ``torch.empty`` or is
        wholly overwritten): writes before the last whole overwrite are skipped, and nothing is
        allocated for it. Otherwise the result is a new tensor sharing nothing with other calls."""
        if not self._graph.is_defined(ref):
            raise MaterializeError(
                f"the values of a tensor of shape {ref.size} were never fully written by a recorded op "
                f"({self._graph.storage(ref.storage).describe()})"
            )
        default = torch.random.default_generator.get_state()
        try:
            with torch.no_grad():
                memo: _Memo = {}
                return _view(self._storage(ref.storage, ref.version, memo, out), ref)
        finally:
            torch.random.default_generator.set_state(default)

    def _storage(
        self, index: int, version: int, memo: _Memo, out: torch.UntypedStorage | None = None
    ) -> torch.UntypedStorage:
        """A new real storage (or ``out``, see ``value``) holding storage ``index`` at ``version``.
        Memoised storages are never written again: each build starts afresh."""
        key = (index, version)
        if key in memo:
            return memo[key]
        record = self._graph.storage(index)
        start = self._graph.replay_start(index, version)
        if (
            out is not None
            and out.nbytes() >= record.nbytes
            and (start is not None or self._graph.starts_uninitialised(index))
        ):
            storage = out
        elif start is not None or record.creator is None:
            storage = torch.empty(record.nbytes, dtype=torch.uint8, device=_CPU).untyped_storage()
        else:
            node, position = record.creator
            storage = tree_leaves(self._run(node, memo, None))[position].untyped_storage()
            if storage.nbytes() != record.nbytes:
                raise MaterializeError(
                    f"replaying {node.name} gave a storage of {storage.nbytes()} bytes where the meta device had "
                    f"{record.nbytes}; this op cannot be replayed on the CPU"
                )
        first = start if start is not None else 0
        for step in range(first, version):
            self._run(record.writes[step][0], memo, (index, step, storage))
        memo[key] = storage
        return storage

    def _run(self, node: Node, memo: _Memo, building: tuple[int, int, torch.UntypedStorage] | None) -> Any:
        """Run ``node`` on real tensors. ``building``: the storage being replayed in place (its
        index, the version reached, its real storage), which references to that version read."""

        def real(leaf: Any) -> Any:
            if isinstance(leaf, TensorRef):
                if building is not None and (leaf.storage, leaf.version) == building[:2]:
                    return _view(building[2], leaf)
                return _view(self._storage(leaf.storage, leaf.version, memo), leaf)
            if isinstance(leaf, Const):
                return leaf.value.clone()
            if (isinstance(leaf, torch.device) and leaf.type == "meta") or (isinstance(leaf, str) and leaf == "meta"):
                return _CPU
            if isinstance(leaf, torch.Generator) and node.rng is not None:
                generator = torch.Generator(device=leaf.device)
                generator.set_state(node.rng.state)
                return generator
            return leaf

        args, kwargs = tree_map(real, (node.args, node.kwargs))
        if node.random:
            if node.rng is None:
                raise MaterializeError(
                    f"{node.name} draws random numbers, which were not drawn when it was recorded; it cannot be "
                    "replayed"
                )
            if node.rng.generator is None:
                torch.random.default_generator.set_state(node.rng.state)
        return node.func(*args, **kwargs)
