"""The frozen models a preference or RL trainer keeps beside its policy, under chunkmem.

TRL's trainers (``DPOTrainer``, ``GRPOTrainer``...) hold the reference model in their ``ref_model``
attribute, and ``GRPOTrainer`` its reward models among ``reward_funcs`` (each a module, or a plain
function). Each model is boosted beside the trained model under the same budget
(``Booster.boost(..., frozen=...)``) and the trainer's attribute points at the boosted one, whose
forward gathers its chunks (the user's module holds placeholders after boosting). Left ``None`` with
a PEFT model, those trainers compute the reference as the base with the adapter disabled, which they
decide with ``is_peft_model(self.model)``: ``False`` for a boosted model (accelerate looks for its
own wrappers only), so they would call ``None``. The attribute is set to
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
    "REWARD_ATTRIBUTE",
    "AdapterOffReference",
    "TrainerFrozenModels",
    "refuse_second_adapter",
]

REFERENCE_ATTRIBUTE = "ref_model"
REWARD_ATTRIBUTE = "reward_funcs"


def _plain_model(model: Any, where: str) -> torch.nn.Module:
    """``model`` (held at ``where`` in the trainer), checked to be a plain torch module to boost."""
    if isinstance(model, ChunkedModel):
        raise NotSupportedError(
            f"the trainer's {where} is a boosted model already: give the plain model, which chunkmem's trainer "
            "boosts beside the trained model under the same budget"
        )
    if not isinstance(model, torch.nn.Module):
        raise NotSupportedError(
            f"the trainer's {where} is a {type(model).__name__}, not a torch module: chunkmem boosts it beside "
            "the trained model; pass it as a model"
        )
    return model


class TrainerFrozenModels:
    """The models a trainer runs beside its trained model but never trains: its reference
    (``ref_model``) and the reward models among its ``reward_funcs``, read when the trainer's own
    ``__init__`` has built them, boosted with the trained model (``models``, in that order), then
    put back in the trainer's attributes (``after_boost``)."""

    def __init__(self, trainer: Any) -> None:
        reference = getattr(trainer, REFERENCE_ATTRIBUTE, None)
        self._reference = None if reference is None else _plain_model(reference, REFERENCE_ATTRIBUTE)
        # A reward function that is a module is a model TRL calls on the tokenized completions;
        # any other callable (a Python function) is left as it is.
        rewards = getattr(trainer, REWARD_ATTRIBUTE, None) or []
        self._reward_indices = [i for i, func in enumerate(rewards) if isinstance(func, torch.nn.Module)]
        self._rewards = [_plain_model(rewards[i], f"{REWARD_ATTRIBUTE}[{i}]") for i in self._reward_indices]

    @property
    def models(self) -> list[torch.nn.Module]:
        """What to boost frozen beside the trained model: the reference first, then the reward models."""
        return ([self._reference] if self._reference is not None else []) + self._rewards

    def after_boost(self, trainer: Any, users_model: torch.nn.Module, boosted: ChunkedModel) -> None:
        """Point the trainer's attributes at what chunkmem boosted: the frozen models boosted beside
        the policy, or, for a PEFT policy without a reference, the policy with its adapter off. A
        trainer without a reference attribute keeps none."""
        frozen = list(boosted.frozen_models)
        assert len(frozen) == len(self.models), "boost returns one frozen model per one given"
        if self._reference is not None:
            setattr(trainer, REFERENCE_ATTRIBUTE, frozen.pop(0))
        elif hasattr(trainer, REFERENCE_ATTRIBUTE) and _is_peft(users_model):
            setattr(trainer, REFERENCE_ATTRIBUTE, AdapterOffReference(boosted))
        rewards = getattr(trainer, REWARD_ATTRIBUTE, None)
        for index, model in zip(self._reward_indices, frozen, strict=True):
            rewards[index] = model


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


def refuse_second_adapter(trainer: Any, users_model: torch.nn.Module) -> None:
    """See the module docstring: a ``ref`` adapter beside the trained one is refused at start."""
    if getattr(trainer, REFERENCE_ATTRIBUTE, "absent") is None and _is_peft(users_model):
        adapters = sorted(getattr(users_model, "peft_config", {}))
        if "ref" in adapters:
            raise NotSupportedError(
                f"the PEFT model holds adapters {adapters}: the trainer would compute the reference with the 'ref' "
                "adapter active, and switching adapters changes which parameters require gradients, which chunkmem's "
                "chunks (built at boost) cannot follow. Merge the pretrained adapter into the base first "
                "(merge_and_unload) and train a new one (peft_config=), or, with a trainer that takes one "
                "(DPOTrainer), pass ref_model= (a copy of the model with that adapter merged), which chunkmem boosts "
                "beside the policy under the same budget"
            )
