"""``GraphRecorder``: a dispatch mode that records every op touching the meta device into an
:class:`~chunkmem.materialize.graph.OpGraph`.

Ops on real tensors run as usual and are not recorded. An op on meta tensors runs on meta (for the
shapes) and is recorded. A random op on meta draws nothing from any generator, unlike the same op
on the CPU; with ``draw_random`` the recorder therefore also runs it for real on scratch CPU tensors
of the same geometry (then dropped), after saving the generator's state: the generator then moves
exactly as the CPU run would have moved it, and every later random op sees the state it would have
seen. Scratch tensors exist one op at a time, so recording a model holds at most its largest tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ..compat.torch import TorchDispatchMode, op_schema, tree_leaves, tree_map
from ..errors import MaterializeError
from .graph import Const, Node, OpGraph, RngSnapshot, TensorRef
from .init_functions import whole_calls_on_meta

__all__ = ["GraphRecorder"]

_META = torch.device("meta")
_CPU = torch.device("cpu")


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _meta_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "meta"
    return isinstance(value, str) and value == "meta"


def _on_cpu(value: Any) -> Any:
    return _CPU if _meta_device(value) else value


_ALIGN = 64


class _ScratchArena:
    """Zero-filled CPU stand-ins for the meta tensors of one random op, carved from one buffer
    kept across ops (grown when an op needs more): allocating and freeing a tensor per op would
    leave the allocator's heap fragmented, holding on to memory long after recording."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8, device=_CPU)
        self._used = 0

    def reset(self, needed: int) -> None:
        if self._buffer.numel() < needed:
            self._buffer = torch.empty(0, dtype=torch.uint8, device=_CPU)  # free before allocating
            self._buffer = torch.empty(needed, dtype=torch.uint8, device=_CPU)
        self._used = 0

    def stand_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A zero-filled CPU tensor with the geometry of ``tensor`` (its whole storage)."""
        nbytes = tensor.untyped_storage().nbytes()
        region = self._buffer[self._used : self._used + nbytes]
        region.zero_()
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        storage = region.untyped_storage()
        view = torch.empty(0, dtype=tensor.dtype, device=_CPU)
        offset = region.storage_offset() // tensor.dtype.itemsize + tensor.storage_offset()
        return view.set_(storage, offset, tensor.shape, tensor.stride())

    def release(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8, device=_CPU)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int | str, torch.Tensor]]:
    """The arguments the op writes in place (by the schema's alias annotations), with their
    position (int) or keyword (str)."""
    out: list[tuple[int | str, torch.Tensor]] = []
    for position, argument in enumerate(op_schema(func).arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        key: int | str = position if position < len(args) else argument.name
        value = args[position] if isinstance(key, int) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            out.append((key, value))
        elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            raise MaterializeError(
                f"{func} writes a list of tensors in place on the meta device; chunkmem cannot replay it"
            )
    return out


class GraphRecorder(TorchDispatchMode):
    """Records ops on meta tensors into ``graph`` (see the module docstring).

    Args:
        graph: where the ops go.
        draw_random: run random ops for real on scratch tensors so that the generators advance as
            on the CPU, and keep their states (without it, random ops are recorded but cannot be
            replayed, and no generator moves).
    """

    def __init__(self, graph: OpGraph, draw_random: bool) -> None:
        super().__init__()
        self._graph = graph
        self._draw_random = draw_random
        self._refuse_real_writes: str | None = None
        self._arena = _ScratchArena()
        self._patches = ExitStack()

    def __enter__(self) -> GraphRecorder:
        self._patches.enter_context(whole_calls_on_meta(self))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._arena.release()
        self._patches.close()
        return super().__exit__(*exc)

    def record_call(self, fn: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Any) -> None:
        """Record ``fn(tensor, *args, **kwargs)`` (an initialiser that writes all of ``tensor``,
        a meta tensor, and reads nothing else) as one write, drawing what it draws."""
        ref = self._graph.ref(tensor)
        rng = None
        if self._draw_random:
            leaves = [tensor, *tree_leaves((args, kwargs))]
            rng = self._draw(fn, (tensor, *args), kwargs, leaves)
        self._graph.add_write(Node(fn, (ref, *args), dict(kwargs), rng, random=True), ref)

    @contextmanager
    def not_drawing(self) -> Iterator[None]:
        """Within the block, random ops are recorded without drawing (their values will not be
        replayed: they come from a checkpoint) and no generator moves."""
        previous, self._draw_random = self._draw_random, False
        try:
            yield
        finally:
            self._draw_random = previous

    @contextmanager
    def refusing_real_writes(self, label: str) -> Iterator[None]:
        """Within the block, an op that would write a real tensor while meta ones are involved
        raises instead of running: recording must not change real data it cannot restore. ``label``
        names the code being recorded in the error."""
        previous, self._refuse_real_writes = self._refuse_real_writes, label
        try:
            yield
        finally:
            self._refuse_real_writes = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not any(_is_meta(leaf) for leaf in leaves) and not _meta_device(kwargs.get("device")):
            return func(*args, **kwargs)
        written = _written(func, args, kwargs)
        if self._refuse_real_writes is not None:
            for _, tensor in written:
                if not tensor.is_meta:
                    raise MaterializeError(
                        f"{self._refuse_real_writes} writes a tensor that is not on the meta device ({func} on a "
                        f"{tensor.device} tensor of shape {tuple(tensor.shape)}); chunkmem records initialisation on "
                        "the meta device only and will not change real data. Build the whole model on the meta "
                        "device, or on the CPU."
                    )
        random = torch.Tag.nondeterministic_seeded in func.tags
        rng = self._draw(func, args, kwargs, leaves) if random and self._draw_random else None
        template = tree_map(self._template, (args, kwargs))
        out = func(*args, **kwargs)
        node = Node(func, template[0], template[1], rng, random)
        for key, tensor in written:
            if tensor.is_meta:
                ref = template[0][key] if isinstance(key, int) else template[1][key]
                assert isinstance(ref, TensorRef), "a written meta argument is recorded as a reference"
                self._graph.add_write(node, ref)
        for index, leaf in enumerate(tree_leaves(out)):
            if _is_meta(leaf) and not self._graph.knows(leaf):
                self._graph.add_creation(node, index, leaf)
        return out

    def _template(self, value: Any) -> Any:
        if _is_meta(value):
            return self._graph.ref(value)
        if isinstance(value, torch.Tensor):
            return Const(value.detach().clone())
        return value

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any]) -> RngSnapshot:
        """Save the generator's state, then run the op on scratch CPU tensors to move it."""
        generators = [leaf for leaf in leaves if isinstance(leaf, torch.Generator)]
        generator = generators[0] if generators else None
        state = (generator or torch.random.default_generator).get_state()
        metas = [leaf for leaf in leaves if _is_meta(leaf)]
        self._arena.reset(sum(-(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN for t in metas))
        scratch_args, scratch_kwargs = tree_map(
            lambda v: self._arena.stand_in(v) if _is_meta(v) else _on_cpu(v), (args, kwargs)
        )
        func(*scratch_args, **scratch_kwargs)
        return RngSnapshot(state, generator)
