"""PEFT's internals that chunkmem relies on. Checked on peft 0.21.

Classes recognised by name (without importing PEFT), and the private method that moves a new
adapter to its base layer's device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch

__all__ = ["after_adapter_moves", "defined_in_peft", "is_peft_class"]


def defined_in_peft(obj: object) -> bool:
    """Whether ``obj``'s class is one of PEFT's (its module is under ``peft.``)."""
    return type(obj).__module__.startswith("peft.")


def is_peft_class(module: object, name: str) -> bool:
    """Whether ``module`` is an instance of PEFT's class called ``name`` (or of a subclass of it)."""
    return any(cls.__name__ == name and cls.__module__.startswith("peft.") for cls in type(module).__mro__)


@contextmanager
def after_adapter_moves(then: Callable[[Any, str], None]) -> Iterator[None]:
    """Within the block, ``then(layer, adapter_name)`` runs after each of PEFT's
    ``BaseTunerLayer._move_adapter_to_device_of_base_layer(adapter_name, device)`` (which places a
    new adapter where its base layer is, and which skips a base on the meta device)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def move(layer: Any, adapter_name: str, device: torch.device | None = None) -> None:
        original(layer, adapter_name, device)
        then(layer, adapter_name)

    with mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", move):
        yield
