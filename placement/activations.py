"""``ActivationPlacement``: where what autograd saves inside named blocks lives between a block's
forward and its backward (kept on the compute device, recomputed, or offloaded to host memory).

A config is data only; ``chunkmem.activations`` carries it out. Blocks are named by class: the
class's name (``"GPT2Block"``), its qualified name (``"transformers.models.gpt2.modeling_gpt2.GPT2Block"``)
or the class itself (``GPT2Block``, which also matches its subclasses). A block of no named class
is kept: autograd saves what it saves, as in plain PyTorch.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, model_validator

__all__ = ["ActivationPlacement", "BlockClass", "block_class_name", "matches_block"]

BlockClass = str | type
"""A block class: its name, its qualified name, or the class."""


def _block_classes(value: Any, info: ValidationInfo) -> Any:
    """A list of block classes: refuse a bare string (pydantic would read ``"GPT2Block"`` as
    nine one-letter names) and anything that is neither a non-empty name nor a class."""
    field = info.field_name
    if isinstance(value, str | type):
        raise ValueError(f"{field} must be a list of block classes, e.g. {field}=[{value!r}], not a single one")
    if not isinstance(value, list | tuple):
        raise ValueError(f"{field} must be a list of block class names or classes, got {type(value).__name__}")
    for item in value:
        if isinstance(item, str) and item.strip() and item == item.strip():
            continue
        if isinstance(item, type):
            continue
        raise ValueError(
            f"{field} holds {item!r}: give a block class's name (such as 'GPT2Block', no surrounding spaces) or "
            "the class itself"
        )
    return tuple(value)


Blocks = Annotated[tuple[BlockClass, ...], BeforeValidator(_block_classes)]


def block_class_name(block: BlockClass) -> str:
    """How a block class is named in messages."""
    return block if isinstance(block, str) else f"{block.__module__}.{block.__qualname__}"


def matches_block(block: BlockClass, module: object) -> bool:
    """Whether ``module`` is a block of ``block``: an instance of the class, or of a class of
    that name or qualified name."""
    if isinstance(block, type):
        return isinstance(module, block)
    cls = type(module)
    return block in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")


class ActivationPlacement(BaseModel):
    """Static activation placement per block class (``ChunkPlugin(activations=...)``).

    Every named class must match at least one module of the boosted model, a class may be named
    in one field only, and a matched block may not hold another matched block (each is refused at
    boost, naming the class)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, arbitrary_types_allowed=True)

    recompute: Blocks = ()
    """Block classes whose saved tensors are dropped after the forward and recomputed in the
    backward: the block runs under non-reentrant ``torch.utils.checkpoint`` with its RNG state
    preserved (dropout recomputes the same mask), so results equal plain PyTorch with the same
    checkpointing. Each recomputation counts in ``Stats.recomputed_blocks``."""
    offload: Blocks = ()
    """Block classes whose saved tensors are copied to pinned host memory during the forward (on the
    device layer's copy stream, overlapping compute) and copied back before the block's backward.
    Kept as they are: parameters and other chunk memory, the block's buffers, tensors below
    ``min_offload_bytes``. Results equal plain PyTorch bit for bit. On a CPU compute device the
    copy is made too (the "host" is the same memory: it costs a copy and saves nothing, but the
    path and its counters run as on a GPU). Counted in ``Stats.activation_d2h_bytes`` /
    ``activation_h2d_bytes``, apart from chunk traffic."""
    max_prefetch: Annotated[int, Field(ge=0, strict=True)] = 1
    """How many offloaded block calls, next in backward order, are copied back to the device
    ahead of their backward, when a block's backward starts (0: each is copied back when its
    backward first needs it). Each costs that block's saved bytes on the device early."""
    min_offload_bytes: Annotated[int, Field(ge=0, strict=True)] = 1024
    """Saved tensors whose storage is smaller than this many bytes stay on the device (a copy
    costs more than their room: layer-norm statistics, scalars)."""

    @model_validator(mode="after")
    def _one_choice_per_class(self) -> ActivationPlacement:
        named = {block_class_name(b) for b in self.recompute}
        both = sorted(named & {block_class_name(b) for b in self.offload})
        if both:
            raise ValueError(
                f"offload and recompute both name {both}: a block's saved tensors are either recomputed or "
                "offloaded; name each class in one field"
            )
        return self
