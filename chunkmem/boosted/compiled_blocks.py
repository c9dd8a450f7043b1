"""``CompiledBlocks``: the blocks a ``CompileBlocks`` names, each call run compiled between eager
chunk hooks; ``find_compiled_blocks``: which modules those are, and what cannot be combined with
compiling them, refused when boosting (before anything is compiled or moved into chunks).

Each block's ``forward`` is replaced, on the instance, by one that runs the class's own ``forward``,
compiled once per class (``torch.compile`` of the function: every block of the class shares its
compiled code, Dynamo guarding on shapes and not on which block it is), as one op of the block's
parameters (``hooks.BlockOp``): the runtime gathers every chunk the block reads before the call and
its backward, and the compiled code sees plain tensors aliasing the gathered chunks. The trace then
holds one op per block call, and what the runtime decides (prefetch, releases, gradient reductions)
follows it as it follows single ops; a chunk is gathered once per phase, as in an eager run, where
the budget holds a block's chunks at once (``block_working_sets``: the placement's minimum budget
counts each compiled block's chunks together).

An ``ActivationPlacement`` composes around the compiled calls: a recomputed block's checkpoint, an
offloaded block's saved-tensor hooks and an ``auto`` block's choice wrap the replaced ``forward``
(``ActivationBlocks`` is built after this and wraps what it finds); a placed block inside a compiled
one is refused (Dynamo would trace its hooks). ``detached()`` takes the replacements away (a deep
copy of the module must not carry them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from chunkmem.hooks.block_op import BlockOp
from chunkmem.placement import ActivationPlacement, RepeatedBlocks, WorkingSet, block_class_name, matches_block

from ..activations.detect import agreed_repeated_block
from ..chunks.manager import ChunkManager
from ..compat.torch import dynamo_supported
from ..errors import NotSupportedError
from ..ranks.comm import Communicator
from .compile_config import CompileBlocks

__all__ = ["CompiledBlocks", "block_working_sets", "find_compiled_blocks"]

Block = tuple[str, torch.nn.Module]
"""A compiled block: its name in the model (``""`` for the model itself) and the module."""


def _shown(name: str) -> str:
    return name or "(the model)"


def find_compiled_blocks(
    model: torch.nn.Module, config: CompileBlocks, activations: ActivationPlacement | None, comm: Communicator
) -> list[Block]:
    """The modules ``config`` compiles, in module order, ``RepeatedBlocks()`` found the same way on
    every rank; ``activations``: the placement the blocks run under (its ``RepeatedBlocks()``
    resolved). Raises what cannot be compiled, naming the block and what to do."""
    if not dynamo_supported():
        raise NotSupportedError(
            "ChunkPlugin(compile=CompileBlocks(...)): torch.compile is not supported on this Python or platform "
            f"(torch {torch.__version__}): boost without compile"
        )
    classes = list(config.blocks)
    marker = next((b for b in classes if isinstance(b, RepeatedBlocks)), None)
    if marker is not None:
        found = agreed_repeated_block(model, marker, comm, owner="CompileBlocks").cls
        classes = [found if isinstance(b, RepeatedBlocks) else b for b in classes]
    chosen: list[Block] = []
    for name, module in model.named_modules():
        if not any(matches_block(b, module) for b in classes):
            continue
        outer = next((o for o, _ in chosen if o == "" or name.startswith(o + ".")), None)
        if outer is not None:
            raise ValueError(
                f"CompileBlocks names the class of {name} ({type(module).__name__}) and of {_shown(outer)}, which "
                "holds it: a block is compiled once, with what it holds; name one of the two classes"
            )
        if "forward" in vars(module):
            raise NotSupportedError(
                f"CompileBlocks: block {_shown(name)} ({type(module).__name__}) has a forward of its own on the "
                "instance (set by a wrapper or another library's hooks, such as accelerate's): compiling its "
                "class's forward would skip it. Remove that wrapper before boosting, or name another block class"
            )
        chosen.append((name, module))
    for block in classes:
        if not any(matches_block(block, m) for _, m in chosen):
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"CompileBlocks names the block class {block_class_name(block)!r}, but no module of the model is "
                f"one; its module classes are {present}"
            )
    if activations is not None:
        _refuse_placed_inside(chosen, activations)
    return chosen


def _refuse_placed_inside(chosen: Sequence[Block], activations: ActivationPlacement) -> None:
    """A block whose saved tensors an ``ActivationPlacement`` places runs its checkpoint or hooks
    around its own call: inside a compiled block, Dynamo would trace them."""
    for name, block in chosen:
        for inner_name, inner in block.named_modules():
            how = activations.placement_of(inner) if inner_name else None
            if how is not None:
                full = f"{name}.{inner_name}" if name else inner_name
                raise NotSupportedError(
                    f"ActivationPlacement places block {full} ({type(inner).__name__}, {how.value}), which runs "
                    f"inside the compiled block {_shown(name)} ({type(block).__name__}): its checkpoint or "
                    "saved-tensor hooks would be traced into the compiled code. Place the compiled block's class "
                    f"instead ({how.value}=[{type(block).__name__!r}]: placement wraps the compiled call), or "
                    "compile the inner class"
                )


def block_working_sets(blocks: Sequence[Block], manager: ChunkManager) -> list[WorkingSet]:
    """Each compiled block's chunks, which one op holds at once (the placement's minimum budget)."""
    sets = []
    for name, block in blocks:
        chunks = sorted({manager.info(p).chunk_id for p in block.parameters() if manager.manages(p)})
        if chunks:
            sets.append(WorkingSet(f"{_shown(name)} (compiled)", tuple(chunks)))
    return sets


def _call(op: BlockOp, compiled: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return op.run(functools.partial(compiled, module), args, kwargs)


class CompiledBlocks:
    """The compiled blocks of one model; see the module docstring. ``compile`` turns a class's
    ``forward`` into what runs it (``torch.compile``, or the function itself where nothing
    computes: a plan's meta run)."""

    def __init__(self, blocks: Sequence[Block], compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        by_class: dict[type, Callable[..., Any]] = {}
        self._blocks: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
        for _, module in blocks:
            cls = type(module)
            if cls not in by_class:
                by_class[cls] = compile(cls.forward)
            self._blocks.append((module, functools.partial(_call, BlockOp(module), by_class[cls], module)))
        for module, run in self._blocks:
            module.forward = run

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [module for module, _ in self._blocks]

    @contextmanager
    def detached(self) -> Iterator[None]:
        """Within the block, the blocks run their class's own ``forward`` (for a deep copy). Where an
        ``ActivationBlocks`` wraps them, detach it first: its wrapper holds this one, and while it is
        detached no block carries this one either."""
        taken = [(module, run) for module, run in self._blocks if vars(module).get("forward") is run]
        for module, _ in taken:
            del module.forward
        try:
            yield
        finally:
            for module, run in taken:
                module.forward = run
