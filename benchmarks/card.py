"""Sizing the memory-budget experiment's model from the memory of the card it runs on.

A pure function of byte counts (the device capacity this process may use and the host memory), so it
is tested without a GPU. The model is the smallest GPT-2-family shape (GPT-2 medium or larger, 1024
tokens per sequence) whose plain-PyTorch training does not fit the card, so the experiment shows a
model that plain PyTorch cannot train next to what chunkmem does with it under each budget; the host
must hold chunkmem's fully offloaded model data. When even the largest shape the host can hold fits
the card, that shape is used and the table shows plain PyTorch training it too (pass
``--device-memory`` to emulate a smaller card).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.common import GPT2Shape

__all__ = [
    "LADDER",
    "CardModel",
    "activation_bytes_per_sequence",
    "chunk_model_bytes",
    "plain_training_bytes",
    "size_for_card",
]

GPT2_VOCAB = 50257
SEQ = 1024

# GPT-2 medium, large and XL, then the widths of the usual 2.7B and 6.7B decoder shapes.
LADDER: tuple[tuple[str, int, int], ...] = (
    ("GPT-2 medium", 24, 1024),
    ("GPT-2 large", 36, 1280),
    ("GPT-2 XL", 48, 1600),
    ("GPT 2.7B", 32, 2560),
    ("GPT 6.7B", 32, 4096),
)

HOST_SHARE = 0.5
"""Share of host memory the fully offloaded model data may take (the base copy of the model, the
data loader and the OS need the rest)."""
ACTIVATION_SHARE = 0.35
"""Share of the device capacity the activations of one step may take; the rest is for model data
under the budgets and for working memory."""
MAX_BATCH = 8


def plain_training_bytes(params: int) -> int:
    """Device bytes plain PyTorch AdamW training holds besides activations: fp32 weights and
    gradients and two fp32 Adam moments (autocast keeps the weights fp32)."""
    return 16 * params


def chunk_model_bytes(params: int, compute_itemsize: int) -> int:
    """chunkmem's model data at world size 1: the compute-dtype parameters, fp32 masters, fp32
    gradients and two fp32 Adam moments (fp32 compute shares one copy for parameters and masters)."""
    masters = 0 if compute_itemsize == 4 else 4
    return params * (compute_itemsize + masters + 4 + 8)


def activation_bytes_per_sequence(shape: GPT2Shape, compute_itemsize: int) -> int:
    """Activation memory one sequence keeps for backward: per block about 17 values per token and
    hidden unit (with fused attention, no seq x seq scores), and the logits in the compute dtype
    plus their fp32 upcast and gradient for the loss."""
    blocks = shape.layers * shape.seq * shape.width * 17 * compute_itemsize
    logits = shape.seq * shape.vocab * (compute_itemsize + 4 + 4)
    return blocks + logits


@dataclass(frozen=True)
class CardModel:
    """The model and batch chosen for a card, and why."""

    name: str
    shape: GPT2Shape
    batch: int
    capacity: int
    """Device bytes this process may use (the card's free memory, or the emulated cap)."""
    plain_bytes: int
    """Estimated plain PyTorch need: weights, gradients, Adam moments and activations."""
    plain_fits: bool
    reason: str


def size_for_card(
    capacity: int, host_bytes: int, compute_itemsize: int = 2, vocab: int = GPT2_VOCAB, seq: int = SEQ
) -> CardModel:
    """The smallest ladder shape whose plain-PyTorch training exceeds ``capacity``, among those
    whose fully offloaded chunkmem model data fits ``HOST_SHARE`` of ``host_bytes``; the largest
    such shape when all of them fit the card. The batch (1 to 8 sequences) keeps the activations
    within ``ACTIVATION_SHARE`` of the capacity."""
    if capacity <= 0 or host_bytes <= 0:
        raise ValueError(f"capacity and host_bytes must be positive, got {capacity} and {host_bytes}")
    shapes = [(name, GPT2Shape(layers, width, vocab, seq)) for name, layers, width in LADDER]
    hostable = [
        (name, shape)
        for name, shape in shapes
        if chunk_model_bytes(shape.params(), compute_itemsize) <= HOST_SHARE * host_bytes
    ]
    if not hostable:
        need = chunk_model_bytes(shapes[0][1].params(), compute_itemsize) / HOST_SHARE
        raise ValueError(
            f"host memory of {host_bytes / 2**30:.1f} GiB cannot hold {shapes[0][0]} offloaded "
            f"(needs about {need / 2**30:.1f} GiB); pass --layers/--width for a smaller model"
        )

    def batch_for(shape: GPT2Shape) -> int:
        per_sequence = activation_bytes_per_sequence(shape, compute_itemsize)
        return max(1, min(MAX_BATCH, int(ACTIVATION_SHARE * capacity // per_sequence)))

    def plain_need(shape: GPT2Shape, batch: int) -> int:
        return plain_training_bytes(shape.params()) + batch * activation_bytes_per_sequence(shape, compute_itemsize)

    for name, shape in hostable:
        batch = batch_for(shape)
        need = plain_need(shape, batch)
        if need > capacity:
            return CardModel(
                name,
                shape,
                batch,
                capacity,
                need,
                False,
                f"{name} is the smallest shape plain PyTorch cannot train in {capacity / 2**30:.1f} GiB "
                f"(needs about {need / 2**30:.1f} GiB)",
            )
    name, shape = hostable[-1]
    batch = batch_for(shape)
    need = plain_need(shape, batch)
    return CardModel(
        name,
        shape,
        batch,
        capacity,
        need,
        True,
        f"{name} is the largest shape the host can hold offloaded, and plain PyTorch fits the card "
        f"({need / 2**30:.1f} of {capacity / 2**30:.1f} GiB): pass --device-memory to emulate a smaller card",
    )
