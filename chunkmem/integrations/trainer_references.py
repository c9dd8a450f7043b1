"""The frozen reference a preference or RL trainer keeps beside its policy, under chunkmem.

TRL's trainers (``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``...) hold the reference model in
their ``ref_model`` attribute. Given as a model, it is boosted beside the trained model under the
same budget (``Booster.boost(..., frozen=...)``) and the trainer's attribute points at the boosted
one. Left ``None`` with a PEFT model, those trainers compute the reference as the base with the
adapter disabled, which they decide with ``is_peft_model(self.model)``: ``False`` for a boosted model
(accelerate looks for its own wrappers only), so they would call ``None``. The attribute is set to
:class:`AdapterOffReference` instead: the boosted policy itself with its adapter disabled, the same
computation without a second copy. A policy that holds a second adapter named ``ref`` (TRL's
reference when an existing adapter is trained again) is refused at start: switching adapters
changes which parameters require gradients, which chunks cannot follow after boosting.
"""

from __future__ import annotations

from typing import Any

import torch

from ..boosted.model import ChunkedModel
from ..errors import NotSupportedError

__all__ = [
    "REFERENCE_ATTRIBUTE",
    "AdapterOffReference",
    "plain_reference",
    "reference_after_boost",
    "refuse_second_adapter",
]

REFERENCE_ATTRIBUTE = "ref_model"


def plain_reference(trainer: Any) -> torch.nn.Module | None:
    """The reference model the trainer holds, to boost beside its model (``None``: it holds none)."""
    reference = getattr(trainer, REFERENCE_ATTRIBUTE, None)
    if reference is None:
        return None
    if isinstance(reference, ChunkedModel):
        raise NotSupportedError(
            f"the trainer's {REFERENCE_ATTRIBUTE} is a boosted model already: give the plain reference model, which "
            "chunkmem's trainer boosts beside the trained model under the same budget"
        )
    if not isinstance(reference, torch.nn.Module):
        raise NotSupportedError(
            f"the trainer's {REFERENCE_ATTRIBUTE} is a {type(reference).__name__}, not a torch module: chunkmem "
            "boosts a reference model beside the trained one; pass the reference as a model"
        )
    return reference


class AdapterOffReference(torch.nn.Module):
    """A PEFT policy's reference: the boosted policy called with its adapter disabled (PEFT's
    ``disable_adapter``), so no second copy of the base exists. Its forward under ``no_grad`` in a
    training step is an inference forward of the policy's chunks, placed under the same budget. It
    holds no parameters of its own (the policy is not a submodule)."""

    def __init__(self, policy: ChunkedModel) -> None:
        super().__init__()
        self._policy = (policy,)  # a tuple: not registered as a submodule, its parameters stay the policy's

    @property
    def policy(self) -> ChunkedModel:
        return self._policy[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        trainable = [p for p in policy.module.parameters() if p.requires_grad]
        with policy.module.disable_adapter():
            # PEFT clears the adapter's requires_grad while it is off; chunks were built for it
            # trainable (the runtime refuses a change). A forward without the adapter reads none of
            # its parameters, so the flags change nothing here: they are set back until PEFT's own
            # exit sets them again.
            for param in trainable:
                param.requires_grad = True
            return policy(*args, **kwargs)


def _is_peft(module: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def reference_after_boost(trainer: Any, users_model: torch.nn.Module, boosted: ChunkedModel) -> None:
    """Point the trainer's reference at what chunkmem boosted: the frozen model boosted beside the
    policy, or, for a PEFT policy without one, the policy with its adapter off. A trainer without
    a reference attribute is left alone."""
    if not hasattr(trainer, REFERENCE_ATTRIBUTE):
        return
    if boosted.frozen_models:
        setattr(trainer, REFERENCE_ATTRIBUTE, boosted.frozen_models[0])
        return
    if getattr(trainer, REFERENCE_ATTRIBUTE) is None and _is_peft(users_model):
        setattr(trainer, REFERENCE_ATTRIBUTE, AdapterOffReference(boosted))


def refuse_second_adapter(trainer: Any, users_model: torch.nn.Module) -> None:
    """See the module docstring: a ``ref`` adapter beside the trained one is refused at start."""
    if getattr(trainer, REFERENCE_ATTRIBUTE, "absent") is None and _is_peft(users_model):
        adapters = sorted(getattr(users_model, "peft_config", {}))
        if "ref" in adapters:
            raise NotSupportedError(
                f"the PEFT model holds adapters {adapters}: the trainer would compute the reference with the 'ref' "
                "adapter active, and switching adapters changes which parameters require gradients, which chunkmem's "
                "chunks (built at boost) cannot follow. Merge the pretrained adapter into the base first "
                "(merge_and_unload) and train a new one, or pass ref_model= (a copy of the model with that adapter "
                "merged), which chunkmem boosts beside the policy under the same budget"
            )
