"""bitsandbytes recognised without importing it, and the one private function of it chunkmem calls.
Checked on bitsandbytes 0.50.2."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["defined_in_bitsandbytes", "repacked_for_cpu_inference"]


def defined_in_bitsandbytes(obj: object) -> bool:
    """Whether ``obj``'s class is one of bitsandbytes' (its module is under ``bitsandbytes``)."""
    return type(obj).__module__.startswith("bitsandbytes")


def repacked_for_cpu_inference(packed: torch.Tensor, quant_state: Any) -> tuple[torch.Tensor, Any]:
    """``packed`` (a 4-bit weight's bytes) and ``quant_state`` in the layout bitsandbytes' CPU
    inference kernel reads (what ``Linear4bit.forward`` converts its weight into, in place, on its
    first eval forward on an AVX-512 BF16 CPU): new tensors, ``quant_state`` converted in place.
    bitsandbytes 0.50.2's ``functional._convert_weight_packed_for_cpu``; it asserts that the
    weight's out_features is a multiple of 32 and its in_features even."""
    functional = sys.modules["bitsandbytes.functional"]
    return functional._convert_weight_packed_for_cpu(packed, quant_state)
