"""Which entries of a boosted PEFT model's state its ``save_pretrained`` writes.

A PEFT model's ``save_pretrained`` writes the adapter only, but reads it out of a full state dict.
Gathering that state would put the whole base, in fp32, on rank 0 for a file of a few megabytes.
PEFT's own selection (``get_peft_model_state_dict``) is run once over placeholders on the meta
device that stand for every entry; the placeholders it returns name the entries to gather. Where
PEFT returns a tensor it derived rather than one of the placeholders, the answer is ``None``: the
caller gathers everything, as for any model.

Imported only for a model whose class comes from ``peft`` (``import chunkmem`` does not import it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.peft import defined_in_peft

__all__ = ["adapter_entries"]


def is_peft_model(module: torch.nn.Module) -> bool:
    return defined_in_peft(module) and hasattr(module, "peft_config")


def adapter_entries(
    module: torch.nn.Module, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], kwargs: dict[str, Any]
) -> set[str] | None:
    """The ``state_dict`` names ``module.save_pretrained(**kwargs)`` writes, or ``None`` when they
    cannot be told without values (not a PEFT model, a ``state_dict`` of the caller's own, a
    conversion of the initial weights, or a selection that computes new tensors)."""
    if not is_peft_model(module) or "state_dict" in kwargs or kwargs.get("path_initial_model_for_weight_conversion"):
        return None
    from peft.utils import get_peft_model_state_dict

    placeholders = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    names = {id(tensor): name for name, tensor in placeholders.items()}
    selected = kwargs.get("selected_adapters") or list(module.peft_config)  # type: ignore[attr-defined]
    entries: set[str] = set()
    for adapter in selected:
        chosen = get_peft_model_state_dict(
            module,
            state_dict=placeholders,
            adapter_name=adapter,
            save_embedding_layers=kwargs.get("save_embedding_layers", "auto"),
        )
        for value in chosen.values():
            if id(value) not in names:
                return None
            entries.add(names[id(value)])
    return entries
