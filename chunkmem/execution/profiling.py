"""``NonModelProfile``: the measurement of non-model memory (activations, temporaries) that a
policy asks for (the auto policy, in its first step and after the trace changes): started with a
training iteration, sampled at every hook position, agreed over ranks (the maximum, so every rank
decides alike) and handed to the policy when the iteration ends."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from chunkmem.placement import ComputeTrace, PlacementPolicy

from ..ranks.comm import Communicator
from ..usage.accounting import MemoryLedger
from ..usage.memory import NonModelSampler

__all__ = ["NonModelProfile"]


class NonModelProfile:
    """See the module docstring."""

    def __init__(self, policy: PlacementPolicy, comm: Communicator, ledger: MemoryLedger) -> None:
        self._policy = policy
        self._comm = comm
        self._ledger = ledger
        self._sampler: NonModelSampler | None = None

    def start(self, trace: ComputeTrace | None) -> None:
        """A training iteration begins (``trace``: the one it is expected to follow)."""
        self._sampler = None
        if self._policy.needs_profile(trace):
            self._sampler = NonModelSampler(self._comm.device, self._ledger)
            self._sampler.reset()

    def context(self) -> Any:
        """Around the model's forward while measuring: saved-activation tracking."""
        return self._sampler.saved_tensor_hooks() if self._sampler is not None else nullcontext()

    def sample(self) -> None:
        """At a hook position of the measured iteration."""
        if self._sampler is not None:
            self._sampler.sample()

    def finish(self, trace: ComputeTrace | None) -> None:
        """The iteration ended with ``trace`` frozen: hand the samples to the policy, unless the
        iteration diverged mid-way (then the next one measures again)."""
        sampler, self._sampler = self._sampler, None
        if sampler is None or trace is None or len(sampler.samples) != len(trace):
            return
        profile = torch.tensor(sampler.samples, dtype=torch.int64, device=self._comm.tensor_device)
        self._comm.all_reduce(profile, dist.ReduceOp.MAX)
        self._policy.observe_profile(trace, profile.tolist())
