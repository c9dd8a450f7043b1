"""The norm of a flat gradient shard, as accurate as ``torch.nn.utils.clip_grad_norm_``'s.

PyTorch's norm of one long fp32 vector accumulates in fp32 lanes, so its relative error grows
with the length: about 3e-5 for a million values, 1.5e-4 for four million, where
``clip_grad_norm_`` (a norm per parameter, then the norm of those) stays near 1e-6. A chunk's
shard is one such long vector, so it is cut into rows of ``_ROW`` values whose norms are taken in
fp32 (one kernel over a 2-D view, no copy) and combined in float64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["flat_norm"]

_ROW = 4096  # an fp32 norm over this many values errs by about 1e-7


def flat_norm(values: torch.Tensor, norm_type: float) -> float:
    """The ``norm_type`` norm of the 1-D tensor ``values`` (``inf``: the largest magnitude)."""
    if values.numel() == 0:
        return 0.0
    if norm_type == math.inf:
        return float(values.abs().max())
    full = values.numel() // _ROW * _ROW
    parts = [values[full:].unsqueeze(0)] if full < values.numel() else []
    if full:
        parts.insert(0, values[:full].reshape(-1, _ROW))
    rows = torch.cat([torch.linalg.vector_norm(part, norm_type, dim=1) for part in parts])
    return float(torch.linalg.vector_norm(rows.to(torch.float64), norm_type))
