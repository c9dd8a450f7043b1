"""``CompileBlocks``: which blocks of a boosted model ``torch.compile`` compiles, and how
(``ChunkPlugin(compile=...)``; ``compiled_blocks`` carries it out).

A config is data only. Blocks are named as ``ActivationPlacement`` names them: a class's name, its
qualified name, the class itself, or ``RepeatedBlocks()`` (the model's repeated layers, found when
boosting). The other fields are ``torch.compile``'s own, passed through as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkmem.placement import RepeatedBlocks
from chunkmem.placement.activations import Blocks

__all__ = ["CompileBlocks"]

# Modes whose preset records CUDA graphs (torch._inductor.list_mode_options).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class CompileBlocks(BaseModel):
    """Compile each block of the named classes with ``torch.compile``, the chunk hooks eager at its
    boundaries (``ChunkPlugin(compile=CompileBlocks(...))``).

    Each call of a block is one op for chunkmem: before it, every chunk the block's parameters live
    in is gathered (and the next block's prefetched, as the trace says); the compiled code then runs
    on plain tensors aliasing the gathered chunks, with no tensor subclass and no hook inside it; its
    backward is bracketed the same way (the chunks gathered again before it, the gradients into the
    chunks' buffers after it). What runs outside the blocks (embeddings, head, loss) runs eagerly.
    One compiled function serves every block of a class: one compile per distinct call signature
    (shapes, dtypes, grad mode, train/eval), shared by all the blocks of the class."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, arbitrary_types_allowed=True)

    blocks: Blocks = (RepeatedBlocks(),)
    """The block classes compiled (default: the model's repeated layers). Every named class must
    match a module of the model, and a compiled block may not hold another."""
    backend: str | Callable[..., Any] = "inductor"
    """``torch.compile(backend=...)``: a registered backend's name or a backend callable."""
    mode: str | None = None
    """``torch.compile(mode=...)`` (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...)."""
    dynamic: bool | None = None
    """``torch.compile(dynamic=...)``. ``None`` (torch's default): the first call compiles for its
    shapes, a call with another sequence length compiles once more with that size symbolic, and no
    later length recompiles. ``True``: symbolic from the first call (one compile for every length);
    ``False``: one compile per distinct shape."""
    fullgraph: Annotated[bool, Field(strict=True)] = False
    """``torch.compile(fullgraph=...)``: raise on a graph break inside a block rather than running
    that part eagerly (it runs on the same plain tensors either way)."""
    options: dict[str, Any] | None = None
    """``torch.compile(options=...)``: the backend's options (not with ``mode``)."""

    @model_validator(mode="after")
    def _check(self) -> CompileBlocks:
        if not self.blocks:
            raise ValueError("blocks names no block class: name the classes to compile, or pass compile=None")
        if self.mode is not None and self.options is not None:
            raise ValueError(
                "mode and options both given: torch.compile takes one of the two (a mode is a preset of options)"
            )
        options = self.options or {}
        if self.mode in _CUDA_GRAPH_MODES or options.get("triton.cudagraphs"):
            raise ValueError(
                f"{f'mode={self.mode!r}' if self.mode in _CUDA_GRAPH_MODES else 'triton.cudagraphs'} records CUDA "
                "graphs, which replay the input addresses they were recorded with; chunkmem frees a gathered chunk's "
                "storage between uses and allocates it again at the next gather, so the graphs would be recorded "
                "again and again. Use mode='max-autotune-no-cudagraphs' or the default mode"
            )
        if options.get("freezing"):
            raise ValueError(
                "freezing folds the parameters into the compiled code as constants, but chunkmem's parameters change "
                "at every optimizer step and live in chunks gathered and released between uses: drop freezing"
            )
        return self

    def compile(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` compiled as this config says (lazily: Dynamo traces it at its first call)."""
        return torch.compile(
            forward,
            backend=self.backend,
            mode=self.mode,
            dynamic=self.dynamic,
            fullgraph=self.fullgraph,
            options=self.options,
        )
