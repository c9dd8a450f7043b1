"""``AutoBlocks``: the calls of the ``ActivationPlacement(auto=...)`` blocks, placed under the device
budget. The first training forward offloads every call (the safe choice: what it saves leaves the
device, and the offload's hooks see every saved tensor) and measures each call's saved bytes and
forward time; the copies measure the bandwidth each way. At the next training forward, once every
measured call's backward ran (or its graph was dropped), the measurements are agreed over ranks (the
maximum) and ``placement.choose_activations`` decides each call's placement from then on; the
policy keeps the plan's reserve free of model data. Calls are numbered within each forward of the
model: the ``i``-th call of a forward is placed as the ``i``-th measured call was chosen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import placement as placement_pkg
from placement import ActivationChoice, ActivationPlan, BlockMeasure, CopyRates, PlacementPolicy, choose_activations

from ..errors import BudgetTooSmallError
from ..ranks.comm import Communicator
from ..usage.stats import Stats
from .ledger import DeviceActivations
from .offload import ActivationOffload, BlockCall

__all__ = ["AutoBlocks"]

Recompute = Callable[..., Any]
"""``recompute(name, module, forward, saved_bytes, *args, **kwargs)``: run a call checkpointed."""


class AutoBlocks:
    """See the module docstring."""

    def __init__(
        self,
        offload: ActivationOffload,
        account: DeviceActivations,
        comm: Communicator,
        policy: PlacementPolicy,
        copies: Stats,
        settle: Callable[[], None],
        recompute: Recompute,
    ) -> None:
        self._offload = offload
        self._account = account
        self._comm = comm
        self._layer = comm.layer
        self._policy = policy
        self._copies = copies
        self._settle = settle
        self._recompute = recompute
        self._index = 0
        self._measures: list[BlockMeasure] = []
        self._offload_times: list[list[float]] = []  # per call index: the offload's host seconds
        self._plan: ActivationPlan | None = None

    @property
    def plan(self) -> ActivationPlan | None:
        """The choice per block call (``None`` until the first step was measured)."""
        return self._plan

    def begin_forward(self) -> None:
        """The model's forward starts: calls are numbered from 0 again; a training forward after
        the measured step decides the plan (on every rank, with one agreement over ranks)."""
        self._index = 0
        if self._plan is None and self._measures and torch.is_grad_enabled() and not self._offload.waiting():
            self._decide()

    def run(self, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One call of an auto block whose saved tensors autograd records."""
        index = self._index
        self._index += 1
        if self._plan is None:
            return self._measure(index, name, module, forward, *args, **kwargs)
        choice = self._plan.choice(index)
        if choice is ActivationChoice.KEEP:
            with self._account.keep_hooks(module, f"block {name}"):
                return forward(*args, **kwargs)
        if choice is ActivationChoice.OFFLOAD:
            return self._offloaded(BlockCall(name, module), forward, *args, **kwargs)
        saved = self._plan.saved_bytes[index] if index < len(self._plan.saved_bytes) else 0
        return self._recompute(name, module, forward, saved, *args, **kwargs)

    def _offloaded(self, call: BlockCall, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            with self._offload.hooks(call):
                return forward(*args, **kwargs)
        finally:
            self._offload.settle(call)  # also after a failed forward: what it copied leaves the ledger

    def _measure(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        call = BlockCall(name, module)
        layer = self._layer
        layer.synchronize(layer.record_event())
        began = time.perf_counter()
        out = self._offloaded(call, forward, *args, **kwargs)
        layer.synchronize(layer.record_event())
        # The offload's own host time (its copies too, where they are synchronous) is not compute.
        seconds = max(0.0, time.perf_counter() - began - call.host_seconds[0])
        if index < len(self._measures):
            old = self._measures[index]
            self._measures[index] = BlockMeasure(
                name, max(old.saved_bytes, call.saved_bytes), max(old.forward_seconds, seconds)
            )
        else:
            self._measures.append(BlockMeasure(name, call.saved_bytes, seconds))
            self._offload_times.append(call.host_seconds)  # the fetch adds to it in the backward
        return out

    def _decide(self) -> None:
        """Agree the measurements over ranks (the maximum of bytes and seconds, the slowest copy
        rate) and choose."""
        self._settle()
        comm = self._comm
        count = torch.tensor([len(self._measures)], dtype=torch.int64, device=comm.tensor_device)
        comm.all_reduce(count, dist.ReduceOp.MAX)
        n = int(count.item())
        copies = self._copies
        per_byte = [
            copies.d2h_seconds / copies.d2h_bytes if copies.d2h_bytes else 0.0,
            copies.h2d_seconds / copies.h2d_bytes if copies.h2d_bytes else 0.0,
        ]
        saved = [m.saved_bytes for m in self._measures] + [0] * (n - len(self._measures))
        missing = n - len(self._measures)
        seconds = [m.forward_seconds for m in self._measures] + [0.0] * missing
        hooks = [box[0] for box in self._offload_times] + [0.0] * missing
        sizes = torch.tensor(saved, dtype=torch.int64, device=comm.tensor_device)
        times = torch.tensor(seconds + hooks + per_byte, dtype=torch.float64, device=comm.tensor_device)
        comm.all_reduce(sizes, dist.ReduceOp.MAX)
        comm.all_reduce(times, dist.ReduceOp.MAX)
        names = [m.name for m in self._measures] + ["(a call on another rank)"] * missing
        agreed = times.tolist()
        measures = [
            BlockMeasure(name, int(b), float(t), float(h))
            for name, b, t, h in zip(names, sizes.tolist(), agreed[:n], agreed[n : 2 * n], strict=True)
        ]
        to_host, to_device = agreed[2 * n :]
        if not to_device:  # no backward ran in the measured step: take the other direction's rate
            to_device = to_host
        rates = CopyRates(
            to_host=1.0 / to_host if to_host else 0.0,
            to_device=1.0 / to_device if to_device else 0.0,
            overlap=self._layer.asynchronous,
        )
        budget = self._policy.budget
        assert budget is not None, "auto blocks need a device budget (checked when boosting)"
        try:
            plan = choose_activations(measures, rates, budget, self._policy.placement_need().minimum)
        except placement_pkg.BudgetTooSmallError as error:
            raise BudgetTooSmallError.from_placement(error) from None
        self._policy.reserve_for_activations(plan.reserve)
        self._plan = plan
