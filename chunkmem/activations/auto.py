"""``AutoBlocks``: the calls of the ``ActivationPlacement(auto=...)`` blocks, placed under the device
budget. The first training forward offloads every call (the safe choice: what it saves leaves the
device, and the offload's hooks see every saved tensor) and measures each call's saved bytes and
forward time; the copies measure the bandwidth each way. Each measured call's bytes are agreed over
ranks (the maximum) at its end: the ledger holds those figures, never a rank's own (see ``ledger``).
At the next training forward, once every measured call's backward ran (or its graph was dropped) on
every rank (agreed: a rank that still holds a measured graph delays the choice on all), the times and
rates are agreed too and ``placement.choose_activations`` decides each call's placement from then
on; the policy keeps the plan's reserve free of model data. Calls are numbered within each forward of the
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
from .counting import Saved
from .ledger import CallBytes, CallHold, DeviceActivations
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
        self._measures: list[BlockMeasure] = []  # per call index: its own forward seconds
        self._agreed: list[CallBytes] = []  # per call index: its bytes, the maximum over ranks
        self._offload_times: list[list[float]] = []  # per call index: the offload's host seconds
        self._plan: ActivationPlan | None = None

    @property
    def plan(self) -> ActivationPlan | None:
        """The choice per block call (``None`` until the first step was measured)."""
        return self._plan

    def begin_forward(self) -> None:
        """The model's forward starts: calls are numbered from 0 again; a training forward after
        the measured step decides the plan once no rank waits for a measured call's backward."""
        self._index = 0
        if self._plan is None and self._measures and torch.is_grad_enabled():
            comm = self._comm
            done = torch.tensor([0 if self._offload.waiting() else 1], dtype=torch.int64, device=comm.tensor_device)
            comm.all_reduce(done, dist.ReduceOp.MIN)
            if int(done.item()):
                self._decide()

    def run(self, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One call of an auto block whose saved tensors autograd records."""
        index = self._index
        self._index += 1
        if self._plan is None:
            return self._measure(index, name, module, forward, *args, **kwargs)
        choice = self._plan.choice(index)
        if choice is ActivationChoice.KEEP:
            return self._kept(index, name, module, forward, *args, **kwargs)
        if choice is ActivationChoice.OFFLOAD:
            call, hold = self._call(name, module)
            agreed = call.agreed = self._agreed[index]
            call.count.limit(agreed.small, agreed.copied)
            hold.take(agreed.saved, f"block {name} (its saved tensors, on their way to the host)")
            call.drained = agreed.saved - agreed.small
            call.fetch_bytes = agreed.copied
            out = self._offloaded(call, forward, *args, **kwargs)
            self._account.kept_total += call.count.small_bytes
            return out
        saved = self._plan.saved_bytes[index] if index < len(self._plan.saved_bytes) else 0
        return self._recompute(name, module, forward, saved, *args, **kwargs)

    def _call(self, name: str, module: torch.nn.Module) -> tuple[BlockCall, CallHold]:
        """A new call, with its hold in the ledger."""
        hold = self._account.hold()
        return self._offload.call(name, module, hold), hold

    def _kept(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """A kept call holds its agreed saved bytes from its start until autograd lets go of the
        last tensor it saved (each handle keeps the call, and so its hold, alive)."""
        account = self._account
        call, hold = self._call(name, module)
        agreed = self._agreed[index].saved
        hold.take(agreed, f"block {name} (its saved tensors, kept)")

        def pack(tensor: torch.Tensor) -> Any:
            if self._offload.count(call, tensor) is Saved.MODEL:
                return tensor
            account.check(name, "saved", call.count.saved_bytes, agreed)
            return account.keep(tensor, call)

        with torch.autograd.graph.saved_tensors_hooks(pack, account.unpack):
            out = forward(*args, **kwargs)
        account.kept_total += call.count.saved_bytes
        return out

    def _offloaded(self, call: BlockCall, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            with self._offload.hooks(call):
                return forward(*args, **kwargs)
        finally:
            self._offload.settle(call)  # also after a failed forward: what it copied leaves the ledger

    def _measure(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        call, hold = self._call(name, module)
        layer = self._layer
        layer.synchronize(layer.record_event())
        began = time.perf_counter()
        out = self._offloaded(call, forward, *args, **kwargs)
        layer.synchronize(layer.record_event())
        # The offload's own host time (its copies too, where they are synchronous) is not compute.
        seconds = max(0.0, time.perf_counter() - began - call.host_seconds[0])
        count = call.count
        agreed = self._agree(CallBytes(count.saved_bytes, count.small_bytes, count.copied_bytes))
        hold.take(agreed.small, f"block {name} (small saved tensors it keeps)")
        call.fetch_bytes = agreed.copied
        self._account.kept_total += count.small_bytes
        if index < len(self._measures):
            old = self._measures[index]
            self._measures[index] = BlockMeasure(name, 0, max(old.forward_seconds, seconds))
            self._agreed[index] = self._agreed[index].most(agreed)
        else:
            self._measures.append(BlockMeasure(name, 0, seconds))
            self._agreed.append(agreed)
            self._offload_times.append(call.host_seconds)  # the fetch adds to it in the backward
        return out

    def _agree(self, own: CallBytes) -> CallBytes:
        """A measured call's bytes, the maximum over ranks (every rank measures the same calls)."""
        figures = torch.tensor(own, dtype=torch.int64, device=self._comm.tensor_device)
        self._comm.all_reduce(figures, dist.ReduceOp.MAX)
        return CallBytes(*(int(v) for v in figures.tolist()))

    def _decide(self) -> None:
        """Agree the times over ranks (the maximum of seconds, the slowest copy rate; the bytes are
        agreed already) and choose."""
        self._settle()  # every measured copy's time is in
        comm = self._comm
        n = len(self._measures)
        copies = self._copies
        per_byte = [
            copies.d2h_seconds / copies.d2h_bytes if copies.d2h_bytes else 0.0,
            copies.h2d_seconds / copies.h2d_bytes if copies.h2d_bytes else 0.0,
        ]
        seconds = [m.forward_seconds for m in self._measures]
        hooks = [box[0] for box in self._offload_times]
        times = torch.tensor(seconds + hooks + per_byte, dtype=torch.float64, device=comm.tensor_device)
        comm.all_reduce(times, dist.ReduceOp.MAX)
        agreed = times.tolist()
        measures = [
            BlockMeasure(m.name, b.saved, float(t), float(h))
            for m, b, t, h in zip(self._measures, self._agreed, agreed[:n], agreed[n : 2 * n], strict=True)
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
