"""``ActivationPlacement``: where what autograd saves inside named blocks lives between a block's
forward and its backward (kept on the compute device, recomputed, or offloaded to host memory and,
beyond ``host_budget``, to the disk tier).

A config is data only; ``chunkmem.activations`` carries it out. Blocks are named by class: the
class's name (``"GPT2Block"``), its qualified name (``"transformers.models.gpt2.modeling_gpt2.GPT2Block"``)
or the class itself (``GPT2Block``, which also matches its subclasses), or found without naming it:
``RepeatedBlocks()`` (the model's repeated layers; ``placement.repeated_blocks``), which boosting
replaces by the class it finds (``resolved``). A block of no named class is kept: autograd saves
what it saves, as in plain PyTorch.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .activation_host import MIN_HOST_BUDGET
from .config import Budget
from .repeated_blocks import RepeatedBlocks

__all__ = ["ActivationPlacement", "BlockClass", "BlockPlacement", "block_class_name", "matches_block"]

BlockClass = str | type | RepeatedBlocks
"""A block class: its name, its qualified name, the class, or ``RepeatedBlocks()`` (found when boosting)."""


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
        if isinstance(item, type | RepeatedBlocks):
            continue
        raise ValueError(
            f"{field} holds {item!r}: give a block class's name (such as 'GPT2Block', no surrounding spaces), "
            "the class itself, or RepeatedBlocks() (the model's repeated layers, found when boosting)"
        )
    return tuple(value)


Blocks = Annotated[tuple[BlockClass, ...], BeforeValidator(_block_classes)]


def block_class_name(block: BlockClass) -> str:
    """How a block class is named in messages."""
    if isinstance(block, str | RepeatedBlocks):
        return str(block)
    return f"{block.__module__}.{block.__qualname__}"


def matches_block(block: BlockClass, module: object) -> bool:
    """Whether ``module`` is a block of ``block``: an instance of the class, or of a class of
    that name or qualified name (``RepeatedBlocks()`` matches nothing until ``resolved``)."""
    if isinstance(block, RepeatedBlocks):
        return False
    if isinstance(block, type):
        return isinstance(module, block)
    cls = type(module)
    return block in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")


class BlockPlacement(enum.Enum):
    """How a named block's saved tensors are placed: the ``ActivationPlacement`` field naming its class."""

    RECOMPUTE = "recompute"
    OFFLOAD = "offload"
    AUTO = "auto"
    OUTSIDE = "outside"
    """Not a block: a stretch of the model's forward outside every named block call, offloaded by
    ``ActivationPlacement.offload_outside`` (the planner's ``BlockForecast.how`` for it)."""


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
    auto: Blocks = ()
    """Block classes whose placement chunkmem chooses per block call under the placement's
    ``device_budget``, which then covers their saved activations as well as model data, plus the
    working set of one block (the budget needs one: a placement without ``device_budget`` is refused
    at boost). The first training step offloads every call (what it saves is measured and stays off
    the device); at the end of its backward the calls are measured (saved bytes, forward time, copy
    bandwidth, the maximum over ranks) and each is kept, offloaded or recomputed from then on, the
    kept ones while they fit, chosen to add the least estimated step time
    (``placement.choose_activations``; the plan is ``model.activation_plan``). A budget that cannot
    hold model data and one block's saved bytes is refused by the first training forward, as it
    measures the calls (``BudgetTooSmallError`` naming the minimum, on every rank; ``chunkmem.plan``
    gives it before a run); one where the first step's backward cannot fetch a call back beside the
    small tensors the calls before it keep on the device is refused there, naming a budget that
    holds them. What a kept or offloaded call saves is accounted in the ledger (``MemoryKind.ACTIVATION``,
    in ``Stats.peak_device_bytes``); offloaded calls are fetched up to ``max_prefetch`` calls ahead of
    their backward (the plan's ``prefetch``: the depth with the least estimated time whose room fits,
    reserved in the budget) and keep tensors under ``min_offload_bytes`` on the device, accounted."""
    offload_outside: Annotated[bool, Field(strict=True)] = False
    """Offload what autograd saves outside the named blocks during the boosted model's training
    forward (the embeddings, the head, a loss computed inside the model's forward: its logits' log
    softmax), as ``offload`` does inside a block, by the same rule (parameters and other chunk
    memory of the model, tensor subclasses and storages under ``min_offload_bytes`` stay as they
    are), under the same ``host_budget`` and disk tier. Each stretch between block calls is a call
    of its own, in forward order (a stretch ends when a named block's call starts and the next
    begins when it returns; the first begins at the model's forward start, the last ends at its
    return), so the backward fetches the head's first and the embeddings' last, ``max_prefetch``
    calls ahead. With ``auto`` blocks the stretches are offloaded calls of their plan (never kept
    nor recomputed: they cannot be) and their bytes are in the ledger under ``device_budget`` as an
    offloaded auto call's; without, they are outside the ledger as the ``offload`` blocks' are.
    Refused at the forward (``NotSupportedError``) where the whole model's forward runs inside an
    activation checkpoint of the user's (what it saves is recomputed already). Counted in
    ``Stats.activation_d2h_bytes`` / ``activation_h2d_bytes`` with the blocks' copies."""
    max_prefetch: Annotated[int, Field(ge=0, strict=True)] = 1
    """How many offloaded block calls, next in backward order, are copied back to the device
    ahead of their backward, when a block's backward starts (0: each is copied back when its
    backward first needs it). Each costs that block's saved bytes on the device early. For
    ``auto`` blocks the most: their plan chooses the depth, within the budget."""
    min_offload_bytes: Annotated[int, Field(ge=0, strict=True)] = 1024
    """Saved tensors whose storage is smaller than this many bytes stay on the device (a copy
    costs more than their room: layer-norm statistics, scalars)."""
    host_budget: Budget | None = None
    """Cap on the host memory the ``offload`` blocks' copies take, in bytes or a string such as
    ``"8GiB"`` (at least 4 KiB). Within a training forward, in the order they are saved, storages
    are copied to host memory while their copies fit under the cap less the disk tier's staging
    window (``placement.HostRoom``: two pieces, each the largest power of two at most an eighth of
    the cap, at most 32 MiB); on a GPU each copy counts as the pinned block it takes (the next power
    of two of its bytes);
    the others are written to the disk tier's scratch directory (``ChunkPlugin(disk_dir=...)``,
    required) through that window and read back through it before the block's backward. The host
    copies and the window are accounted in the ledger (``Stats.peak_host_bytes``), the disk
    traffic in ``Stats.activation_disk_write_bytes`` / ``activation_disk_read_bytes``. ``None``
    (default): every offloaded storage is copied to host memory, without a cap. Applies to the
    ``offload`` blocks and to the calls of ``auto`` blocks that are offloaded (every call in the
    first step, then those the plan offloads), in one budget, by the same rule."""

    def placement_of(self, module: object) -> BlockPlacement | None:
        """How ``module``'s saved tensors are placed (``None``: it is no named block)."""
        for how, blocks in (
            (BlockPlacement.RECOMPUTE, self.recompute),
            (BlockPlacement.OFFLOAD, self.offload),
            (BlockPlacement.AUTO, self.auto),
        ):
            if any(matches_block(b, module) for b in blocks):
                return how
        return None

    @property
    def repeated(self) -> RepeatedBlocks | None:
        """The ``RepeatedBlocks`` marker a field holds (``None``: every block is named)."""
        blocks = (*self.recompute, *self.offload, *self.auto)
        return next((b for b in blocks if isinstance(b, RepeatedBlocks)), None)

    def resolved(self, block: type) -> ActivationPlacement:
        """This placement with ``block`` (the class found) in the place of ``RepeatedBlocks()``."""
        fields = ("recompute", "offload", "auto")
        changed = {f: tuple(block if isinstance(b, RepeatedBlocks) else b for b in getattr(self, f)) for f in fields}
        return type(self)(**{**dict(self), **changed})

    @model_validator(mode="after")
    def _one_choice_per_class(self) -> ActivationPlacement:
        fields = {"recompute": self.recompute, "offload": self.offload, "auto": self.auto}
        names = {field: {block_class_name(b) for b in blocks} for field, blocks in fields.items()}
        for first, second in (("offload", "recompute"), ("auto", "recompute"), ("auto", "offload")):
            both = sorted(names[first] & names[second])
            if both:
                raise ValueError(
                    f"{first} and {second} both name {both}: a block's saved tensors are placed one way (recompute, "
                    "offload, or auto: chosen under the budget); name each class in one field"
                )
        return self

    @field_validator("host_budget")
    @classmethod
    def _host_budget_for_offload(cls, host_budget: int | None, info: ValidationInfo) -> int | None:
        # A field's own check (after the fields before it), so that the error names host_budget.
        if host_budget is None:
            return host_budget
        given = info.data
        if not given.get("offload") and not given.get("auto") and not given.get("offload_outside"):
            raise ValueError(
                "host_budget caps the host memory of the offload blocks' copies (and of the auto blocks' offloaded "
                "calls and the stretches offload_outside offloads), but neither offload nor auto names a block class "
                "and offload_outside is off: name the blocks to offload (offload=[...]) or to place under the budget "
                "(auto=[...]), set offload_outside=True, or drop host_budget"
            )
        if host_budget < MIN_HOST_BUDGET:
            raise ValueError(
                f"host_budget={int(host_budget)} bytes is below the minimum of {MIN_HOST_BUDGET} bytes (the disk "
                "tier's staging window takes a quarter of it): give at least 4KiB"
            )
        return host_budget
