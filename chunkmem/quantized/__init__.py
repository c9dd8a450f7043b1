"""Quantized frozen bases: bitsandbytes 4-bit (NF4 / FP4) ``Linear4bit`` layers whose packed bytes and
scales live in chunks like any parameter, dequantized by each op that reads them (``QuantizedBase``);
the one module that names bitsandbytes is ``bnb4``."""

from .base import QuantizedBase, QuantizedLinear
from .linear import QuantizedForward, linear_4bit
from .values import QuantizingValues

__all__ = ["QuantizedBase", "QuantizedForward", "QuantizedLinear", "QuantizingValues", "linear_4bit"]
