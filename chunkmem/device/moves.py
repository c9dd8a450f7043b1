"""Moves of a tensor between devices outside the copy protocol: blocking, so nothing waits for them.

Chunk memory crosses between host and device through ``chunkmem.tiers.transfers.HostTransfers``
(asynchronous copies from and into pinned buffers, each waited for before its buffer is read or
written again). What else moves (a state dict's values, a shard staged for a full gather, a
buffer installed on the compute device, a user's inputs) goes through these two functions: a plain
``.to()``, which returns only once the bytes have moved (never ``non_blocking``), and the one
place outside the layer that moves tensors, so the layer's lint (``tests/unit/device/test_device_layer.py``)
can forbid every other ``.to(device)``, ``.cpu()``, ``.cuda()``, ``non_blocking`` and pinning.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host"]

_HOST = torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (in ``dtype``), moved now; the tensor itself when it is there already."""
    return tensor.to(device=device, dtype=dtype)


def to_host(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` in host memory (in ``dtype``), moved now; the tensor itself when it is there already."""
    return tensor.to(device=_HOST, dtype=dtype)
