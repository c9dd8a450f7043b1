"""``FrozenModels``: the frozen models one boost puts beside a trained one, under the same budget.

A reference model (DPO, GRPO), a reward model: modules that a training step runs but never trains.
Boosted beside the trained model they join its chunks' manager, runtime and placement: one policy
places every chunk of both, from one trace spanning both models' ops in a step, evicting by next use
across them. Frozen, they keep only their values in the compute dtype (no fp32 master, gradient or
optimizer state) on the device, the host or the disk.

This class checks what the user handed over before anything moves (each model once, no parameter
shared with another boosted model; values in memory where the boost reads them, asked by its
backing), then freezes the parameters and casts them to
the compute dtype, the state their chunks are built from, and puts both back if boosting is
refused, so a refused boost leaves every model as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..errors import NotSupportedError
from .boosted_params import already_boosted
from .model import ChunkedModel

__all__ = ["FrozenModels"]


class FrozenModels:
    """The frozen models of one boost; see the module docstring."""

    def __init__(
        self,
        trained: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        models: Sequence[torch.nn.Module],
    ) -> None:
        self.models = tuple(models)
        self._saved: list[tuple[torch.nn.Parameter, torch.Tensor, bool]] = []
        if not self.models:
            self.named: list[list[tuple[str, torch.nn.Parameter]]] = []
            return
        owner: dict[int, str] = {id(p): "the trained model" for p in trained.parameters()}
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]} if optimizer else set()
        for index, model in enumerate(self.models):
            what = f"frozen model {index} ({type(model).__name__})"
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"frozen models must be torch.nn.Module instances, got {type(model).__name__}")
            if model is trained:
                raise ValueError(
                    f"{what} is the trained model itself: a frozen model beside it must be a separate module. For a "
                    "reference copy, boost copy.deepcopy(model) taken before training; with a LoRA adapter the "
                    "reference is the base with the adapter off (with model.disable_adapter(): ...), no copy needed"
                )
            already_boosted(model, None, model.manager if isinstance(model, ChunkedModel) else None)
            named = list(model.named_parameters())
            if not named:
                raise ValueError(f"{what} has no parameters: there is nothing to boost; call it as a plain module")
            for name, param in named:
                if id(param) in owner:
                    raise ValueError(
                        f"parameter '{name}' of {what} is also a parameter of {owner[id(param)]}: each model boosted "
                        "together must hold its own parameters (one parameter lives in one chunk). Pass a separate "
                        "copy (copy.deepcopy before boosting)"
                    )
                if optimizer is not None and id(param) in in_optimizer:
                    raise ValueError(
                        f"the {type(optimizer).__name__} holds parameter '{name}' of {what}: frozen models are never "
                        "stepped. Build the optimizer over the trained model's parameters only"
                    )
                owner[id(param)] = what
        self.named = [list(model.named_parameters()) for model in self.models]

    def refuse_values_not_in_memory(self, trained: torch.nn.Module, weights: str | os.PathLike[str] | None) -> None:
        """A training boost reads a frozen model's values from the model itself: one on the meta
        device, or beside a trained model materialised while boosting, is refused (a plan, whose
        models are all on the meta device, reads no values)."""
        for index, named in enumerate(self.named):
            for name, param in named:
                if param.is_meta:
                    raise NotSupportedError(
                        f"parameter '{name}' of frozen model {index} ({type(self.models[index]).__name__}) is on the "
                        "meta device: frozen models are boosted from the values they hold. Load the frozen model's "
                        "weights first (from_pretrained), then boost it"
                    )
        if self.models and (weights is not None or any(p.is_meta for p in trained.parameters())):
            raise NotSupportedError(
                "frozen models beside a trained model that is materialised while boosting (built on the meta device "
                "or given weights=) are not supported yet: load the trained model's weights first (from_pretrained), "
                "then boost it with its frozen models"
            )

    def freeze(self, compute_dtype: torch.dtype) -> None:
        """Every parameter of the frozen models frozen and, if floating in another dtype, cast to
        ``compute_dtype``: only those values are kept (``ShardKind.FROZEN_VALUES``)."""
        for named in self.named:
            for _, param in named:
                self._saved.append((param, param.data, param.requires_grad))
                param.requires_grad_(False)
                if param.is_floating_point() and param.dtype != compute_dtype:
                    param.data = param.data.to(compute_dtype)

    def restore(self) -> None:
        """Boosting was refused: each parameter back as it was given (values, dtype, requires_grad)."""
        for param, data, requires_grad in reversed(self._saved):
            param.data = data
            param.requires_grad_(requires_grad)
        self._saved.clear()
