"""What a load can read back, checked when saving.

Loads read checkpoints with ``torch.load(weights_only=True)``, which builds only tensors and plain
Python values (and what the user registered with ``torch.serialization.add_safe_globals``).
``torch.save`` writes anything, so a state holding another object (a numpy scalar as a learning
rate, ``lr=np.float64(1e-3)``, or inside an LR scheduler's lambda) would save and then never load,
with a load calling the file damaged. A save is refused instead, naming the value and where it is.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch

from ..errors import NotSupportedError

__all__ = ["check_loadable"]

_PLAIN = (str, int, float, bool, complex, bytes, type(None))
_CONTAINERS = (dict, OrderedDict, list, tuple)


def _reads_back(value: Any) -> bool:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _unreadable(value: Any, where: str) -> tuple[str, Any] | None:
    """The first value in ``value`` (at ``where``) that a safe load cannot read back, with its place."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor | torch.dtype | torch.device | torch.Size):
        return None
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            found = _unreadable(key, f"a key of {where}") if isinstance(value, dict) else None
            found = found or _unreadable(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    return None if _reads_back(value) else (where, value)


def check_loadable(state: Any, root: str, what: str) -> None:
    """Refuse to save ``state`` (called ``root`` in the message: ``optimizer.state_dict()``) as
    ``what`` (``optimizer checkpoint ckpt/optim.pt``) when a load could not read it back."""
    found = _unreadable(state, root)
    if found is None:
        return
    where, value = found
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    hint = (
        "a plain Python number (float(x) or x.item())"
        if type(value).__module__ == "numpy"
        else "a plain Python value or a tensor"
    )
    raise NotSupportedError(
        f"cannot save {what}: {where} is {value!r}, a {kind}, which a load cannot read back (loads use "
        "torch.load(weights_only=True): tensors and plain Python values only). Nothing was written. Make it "
        f"{hint} where it is set (e.g. the optimizer's or scheduler's arguments), or, if you trust every file you "
        f"load, register the class with torch.serialization.add_safe_globals([{type(value).__qualname__}])."
    )
