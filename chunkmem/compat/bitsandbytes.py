"""bitsandbytes recognised without importing it. Checked on bitsandbytes 0.50.2."""

from __future__ import annotations

__all__ = ["defined_in_bitsandbytes"]


def defined_in_bitsandbytes(obj: object) -> bool:
    """Whether ``obj``'s class is one of bitsandbytes' (its module is under ``bitsandbytes``)."""
    return type(obj).__module__.startswith("bitsandbytes")
