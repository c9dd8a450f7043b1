"""What chunkmem learns about a user's optimizer class by probing it on small tensors: whether its
update is elementwise (so it can run on flat pieces of parameters), how much state it keeps per
element, and which state keys it keeps (to check a loaded state before installing it)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StateSize", "check_elementwise", "hyperparameters", "optimizer_state_size", "state_keys"]

log = logging.getLogger("chunkmem")
# torch optimizers whose update of each element depends only on that element's history.
_ELEMENTWISE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


def hyperparameters(
    optimizer: torch.optim.Optimizer | type[torch.optim.Optimizer], group: Mapping[str, Any]
) -> dict[str, Any]:
    """The group's settings that the optimizer class's constructor accepts."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in group.items() if k != "params" and k in accepted}


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """chunkmem runs the optimizer on flat pieces of each parameter, which is exact only for an
    update that treats every element on its own. Known torch optimizers are; any other class is
    probed: a few steps on a 2-D tensor must equal the same steps on its flattened halves."""
    if type(optimizer) in _ELEMENTWISE:
        return
    name = type(optimizer).__name__
    g = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=g)
    grads = [torch.randn(4, 6, generator=g) for _ in range(3)]
    for group in optimizer.param_groups:
        hyper = hyperparameters(optimizer, group)
        whole = start.clone().requires_grad_()
        halves = [start.reshape(-1)[:7].clone().requires_grad_(), start.reshape(-1)[7:].clone().requires_grad_()]
        try:
            on_whole, on_halves = type(optimizer)([whole], **hyper), type(optimizer)(halves, **hyper)
            for grad in grads:
                whole.grad = grad.clone()
                halves[0].grad, halves[1].grad = grad.reshape(-1)[:7].clone(), grad.reshape(-1)[7:].clone()
                on_whole.step()
                on_halves.step()
        except Exception as error:
            raise ValueError(
                f"could not check that {name} updates parameters elementwise ({type(error).__name__}: {error}); "
                "chunkmem runs the optimizer on flat pieces of each parameter"
            ) from error
        if not torch.allclose(whole.detach().reshape(-1), torch.cat([h.detach() for h in halves]), atol=1e-6):
            raise ValueError(
                f"{name} does not update parameters elementwise (its update depends on a parameter's shape, e.g. "
                "factored second moments); chunkmem shards parameters into flat pieces and cannot run it exactly. "
                "Use an elementwise optimizer such as AdamW, Adam, SGD, Adagrad or RMSprop."
            )


@dataclass(frozen=True)
class StateSize:
    """Optimizer state an fp32 parameter piece of ``n`` elements costs: ``per_element * n +
    per_tensor`` bytes (scalars such as Adam's step count)."""

    per_element: int
    per_tensor: int

    def reserved(self, shard_numel: int, tensors: int) -> int:
        """What a chunk's optimizer state may take on any rank: every element of its shard and
        every one of its ``tensors`` having state (an upper bound over ranks, the same on each)."""
        return shard_numel * self.per_element + tensors * self.per_tensor


def optimizer_state_size(optimizer: torch.optim.Optimizer) -> StateSize:
    """Measured by one step of the same optimizer class with each group's hyperparameters on a
    small probe tensor; the largest over groups (momentum in one group only still needs room)."""
    n = 64
    per_element = per_tensor = 0
    for group in optimizer.param_groups:
        probe = torch.zeros(n, requires_grad=True)
        try:
            trial = type(optimizer)([probe], **hyperparameters(optimizer, group))
            probe.grad = torch.full_like(probe, 1e-3)
            trial.step()
        except Exception as error:  # an optimizer we cannot probe: assume Adam-like state
            log.warning(
                "chunkmem: could not probe %s state size (%s); assuming Adam-like state",
                type(optimizer).__name__,
                error,
            )
            return StateSize(max(per_element, 8), max(per_tensor, 8))
        tensors = [v for v in trial.state[probe].values() if isinstance(v, torch.Tensor)]
        per_element = max(per_element, sum(v.numel() * v.element_size() for v in tensors if v.numel() == n) // n)
        per_tensor = max(per_tensor, sum(v.numel() * v.element_size() for v in tensors if v.numel() != n))
    return StateSize(per_element, per_tensor)


def state_keys(cls: type[torch.optim.Optimizer], group: Mapping[str, Any]) -> frozenset[str] | None:
    """The state keys optimizer class ``cls`` keeps for a parameter after a step with ``group``'s
    hyperparameters (``None`` when it cannot be probed)."""
    probe = torch.zeros(4, requires_grad=True)
    try:
        trial = cls([probe], **hyperparameters(cls, group))
        probe.grad = torch.full_like(probe, 1e-3)
        trial.step()
    except Exception:
        return None
    return frozenset(trial.state[probe])
