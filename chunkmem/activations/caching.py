"""Recomputed blocks and a ``transformers`` KV cache.

A recomputed block runs its forward again in the backward, and a KV cache it was handed is written
again there: its keys grow to twice the sequence (eager attention then fails in the backward with a
size mismatch, SDPA's backward returns a cache of twice the entries). Hugging Face's own gradient
checkpointing turns caching off for every forward it checkpoints (a training forward with gradients:
``use_cache=False``, with a warning, and no cache into its layers); chunkmem does the same where its
blocks may be recomputed (``ActivationPlacement(recompute=...)``, and ``auto``, whose plan may
recompute a call):

* ``without_cache``: a training forward of the boosted model that would cache (``use_cache=True``
  passed, or the model's ``config.use_cache``) gets ``use_cache=False``, and a warning once.
* ``holds_cache``: whether a block's call is handed a cache anyway (one the user passed, or a model
  that ignores ``use_cache``). A block in training mode is then refused (``NotSupportedError``), one
  in eval mode runs as it is, cache included, as Hugging Face's checkpointing leaves it.

A cache is recognised without importing ``transformers``: an instance of its ``cache_utils.Cache``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..compat.transformers import is_cache
from ..errors import NotSupportedError

__all__ = ["holds_cache", "refuse_cache", "without_cache"]

log = logging.getLogger("chunkmem")


def holds_cache(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a block's call is handed a ``transformers`` cache."""
    return any(is_cache(value) for value in (*args, *kwargs.values()))


def _takes_use_cache(module: torch.nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: leave the call as it is
        return False
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def without_cache(module: torch.nn.Module, kwargs: dict[str, Any], warned: list[bool]) -> dict[str, Any]:
    """``kwargs`` for a training forward of ``module`` whose blocks may be recomputed: with
    ``use_cache=False`` where it would cache (``warned[0]``: whether the warning was given)."""
    if not (module.training and torch.is_grad_enabled()):
        return kwargs
    asked = kwargs.get("use_cache")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "use_cache", None)
    if not asked or not _takes_use_cache(module):
        return kwargs
    if not warned[0]:
        warned[0] = True
        log.warning(
            "chunkmem: use_cache=True is incompatible with recomputed blocks (ActivationPlacement recompute or auto): "
            "the recomputation in the backward would write the cache again. Setting use_cache=False for training "
            "forwards, as Hugging Face's gradient checkpointing does."
        )
    return {**kwargs, "use_cache": False}


def refuse_cache(name: str, how: str) -> None:
    """Raise: block ``name``, ``how`` (recomputed, placed under the budget), is handed a cache in a
    training forward."""
    raise NotSupportedError(
        f"block {name} is {how} by ActivationPlacement, and this training forward hands it a KV cache (one passed "
        "as past_key_values / cache, or made by a model inside your own module whose use_cache reached it: chunkmem "
        "sets use_cache=False only on the boosted module's own forward): recomputing the block in the backward would "
        "write the cache a second time. Pass no cache and use_cache=False to a training forward (or set "
        "config.use_cache=False on the inner model), run it under torch.no_grad() or in eval mode, or name the "
        "block's class in ActivationPlacement(offload=[...]) instead."
    )
