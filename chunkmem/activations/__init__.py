"""Activation placement: what autograd saves inside the blocks an ``ActivationPlacement`` names is
kept, recomputed (``blocks``) or offloaded to host memory (``offload``)."""

from .blocks import ActivationBlocks, DeviceBudget
from .detect import RepeatedBlock, detect_repeated_block, resolve_blocks
from .offload import ActivationOffload, BlockCall

__all__ = [
    "ActivationBlocks",
    "ActivationOffload",
    "BlockCall",
    "DeviceBudget",
    "RepeatedBlock",
    "detect_repeated_block",
    "resolve_blocks",
]
