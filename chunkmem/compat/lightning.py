"""Lightning's internals that ``ChunkStrategy`` relies on. Checked on lightning 2.5 and 2.6.
Imported only by ``chunkmem.integrations.lightning`` (it imports Lightning)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available

__all__ = ["init_dist_connection", "layer_sync", "sync_ddp_if_available"]


def init_dist_connection(environment: Any, backend: str) -> None:
    """``lightning.fabric.utilities.distributed._init_dist_connection``: the process group set up from
    the cluster environment as Lightning's own DDP strategies set it up."""
    _init_dist_connection(environment, backend)


def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> Any:
    """``lightning.fabric.utilities.distributed._sync_ddp_if_available``: ``Strategy.reduce`` as
    Lightning's DDP strategies do it (an all-reduce, "mean" as the sum divided by the world size)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def layer_sync(strategy: Any) -> Any:
    """``strategy._layer_sync``: the ``LayerSync`` plugin ``Trainer(sync_batchnorm=True)`` sets on the
    strategy (``None`` without)."""
    return strategy._layer_sync
