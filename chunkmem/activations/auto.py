"""``AutoBlocks``: the calls of the ``ActivationPlacement(auto=...)`` blocks, placed under the device
budget. The first training forward offloads every call (the safe choice: what it saves leaves the
device, and the offload's hooks see every saved tensor) and measures each call's saved bytes and
forward time; the copies measure the bandwidth each way. Each measured call's bytes are agreed over
ranks (the maximum) at its end: the ledger holds those figures, never a rank's own (see ``ledger``).
At the next training forward, once every measured call's backward ran (or its graph was dropped) on
every rank (agreed: a rank that still holds a measured graph delays the choice on all), the times and
rates are agreed too and ``placement.choose_activations`` decides each call's placement from then
on, and how many offloaded calls are fetched ahead of their backward (up to ``max_prefetch``; the
measured calls are fetched one at a time); the policy keeps the plan's reserve (one block's
working set and the fetches ahead) free of model data. Calls are numbered within each forward of the
model: the ``i``-th call of a forward is placed as the ``i``-th measured call was chosen.

At the end of every training forward the ranks agree (one small all-gather) how many auto calls
it made and which ranks' calls saved more than their figures (a later step with a longer sequence
or a larger micro-batch than any rank's first). Differing counts raise the same error on every
rank. An overrun is **re-planned** on every rank alike: the figures become the largest over ranks
of the calls' own (a second collective, only then), the plan is chosen again from them (forward
and offload times scaled by each call's growth in bytes, an estimate), and the forward's kept and
offloaded calls hold their new figures from then on. Where no plan fits the budget, every rank
raises the same ``BudgetTooSmallError`` naming the call, its bytes, the budget and the minimum.

The budget is refused as early as the figures allow: in the first training forward, at the end of
the first measured call whose figures (with those before it) no plan can hold, and in its backward
where a measured call's bytes find no room beside the small storages the calls before it keep
(``placement.refuse_below_minimum``, ``measured_step_refusal``; the same figures and ledger on every
rank, so every rank raises at the same call). A refusal forgets the measured figures, and the
reserve the policy kept for their fetches: the next training forward measures again, so the fix
the refusal names (a shorter sequence or micro-batch) works on the same model.
Between the overrun and the forward's end, the overrunning rank holds more on the device than the
ledger accounts (the pack hooks do not raise: one rank's error would leave the others waiting in
their next collective)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import chunkmem.placement as placement_pkg
from chunkmem.placement import (
    ActivationChoice,
    ActivationPlan,
    BlockMeasure,
    CopyRates,
    PlacementPolicy,
    choose_activations,
)
from chunkmem.placement.activation_plan import measured_step_refusal, refuse_below_minimum
from chunkmem.placement.policy import format_bytes

from ..errors import BudgetExceededError, BudgetTooSmallError, NotSupportedError, TraceDivergenceError
from ..ranks.comm import Communicator
from ..usage.saved import unlinked
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
        max_prefetch: int,
    ) -> None:
        """``offload`` fetches nothing ahead until the plan says how many (up to ``max_prefetch``)."""
        self._offload = offload
        self._max_prefetch = max_prefetch
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
        self._first_saved: list[int] = []  # per call index: its saved bytes when the first plan was chosen
        # This training forward's kept and offloaded calls (``None``: no training forward runs).
        self._placed: list[tuple[int, ActivationChoice, BlockCall]] | None = None

    @property
    def plan(self) -> ActivationPlan | None:
        """The choice per block call (``None`` until the first step was measured)."""
        return self._plan

    def begin_forward(self) -> None:
        """The model's forward starts: calls are numbered from 0 again; a training forward after
        the measured step decides the plan once no rank waits for a measured call's backward."""
        self._index = 0
        self._placed = [] if torch.is_grad_enabled() else None
        if self._plan is None and self._measures and torch.is_grad_enabled():
            comm = self._comm
            done = torch.tensor([0 if self._offload.waiting() else 1], dtype=torch.int64, device=comm.tensor_device)
            comm.all_reduce(done, dist.ReduceOp.MIN)
            if int(done.item()):
                self._decide()

    def end_forward(self) -> None:
        """The model's training forward returned: the ranks agree its number of auto calls and
        whether a call saved more than its figures (then every rank re-plans); see the module
        docstring."""
        placed, self._placed = self._placed, None
        if placed is None:
            return
        comm = self._comm
        overran = sum(1 for index, choice, call in placed if _exceeds(_own(call), self._agreed[index], choice))
        mine = torch.tensor([self._index, overran], dtype=torch.int64, device=comm.tensor_device)
        everyone = [[int(v) for v in t.tolist()] for t in comm.all_gather_tensors(mine)]
        counts = [count for count, _ in everyone]
        if len(set(counts)) > 1:
            each = ", ".join(f"{count} on rank {rank}" for rank, count in enumerate(counts))
            raise TraceDivergenceError(
                f"the ranks called the ActivationPlacement(auto=...) blocks a different number of times in one "
                f"training forward ({each}): each call is placed by its position in the forward, so every rank must "
                "make the same calls. Keep rank-dependent branches and torch.no_grad() regions out of the model's "
                "forward, or name the block class in recompute or offload instead of auto."
            )
        overrunning = [rank for rank, (_, count) in enumerate(everyone) if count]
        if overrunning:
            self._replan(placed, overrunning)

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
            call = self._planned_offload(index, name, module, f"block {name}")
            out = self._offloaded(call, forward, *args, **kwargs)
            self._account.kept_total += call.count.small_bytes
            return out
        saved = self._plan.saved_bytes[index] if index < len(self._plan.saved_bytes) else 0
        return self._recompute(name, module, forward, saved, *args, **kwargs)

    def begin_stretch(self, name: str, model: torch.nn.Module) -> BlockCall:
        """A stretch of the training forward outside the blocks begins (``offload_outside``): a call
        the plan offloads (measured as every call in the first step), its tensors packed by the
        offload until ``end_stretch``."""
        index = self._index
        self._index += 1
        if self._plan is None:
            call, _ = self._call(name, model, self._measured_refusal)
        elif index < len(self._plan.choices):
            call = self._planned_offload(index, name, model, name)
        else:
            raise NotSupportedError(
                f"{name}: this training forward made more calls of the placed blocks than the first step measured "
                f"({len(self._plan.choices)} calls and stretches between them): a stretch outside the blocks past them "
                "has no figures in the plan. Keep the number of block calls of a forward fixed, or set "
                "ActivationPlacement(offload_outside=False)."
            )
        call.stretch = index
        self._offload.begin(call)
        return call

    def end_stretch(self, call: BlockCall) -> None:
        """The stretch ``call`` ended (a block call starts, or the model's forward returned)."""
        try:
            self._offload.settle(call)
        finally:
            self._offload.finish(call)
        if self._plan is None:
            self._measured(call.stretch, call, 0.0, outside=True)
        else:
            self._account.kept_total += call.count.small_bytes

    def _planned_offload(self, index: int, name: str, module: torch.nn.Module, what: str) -> BlockCall:
        """The ``index``-th call, offloaded as planned (``what``: it, in messages): it holds its
        agreed saved bytes until its copies out are done."""
        call, hold = self._call(name, module)
        agreed = call.agreed = self._agreed[index]
        call.count.limit(agreed.small, agreed.copied)
        hold.take(agreed.saved, f"{what} (its saved tensors, on their way to the host)")
        call.drained = agreed.saved - agreed.small
        call.fetch_bytes = agreed.copied
        self._note(index, ActivationChoice.OFFLOAD, call)
        return call

    def _call(
        self, name: str, module: torch.nn.Module, refusal: Callable[[], Exception] | None = None
    ) -> tuple[BlockCall, CallHold]:
        """A new call, with its hold in the ledger (``refusal``: what it raises where it finds no room)."""
        hold = self._account.hold(refusal)
        return self._offload.call(name, module, hold), hold

    def _kept(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """A kept call holds its agreed saved bytes from its start until autograd lets go of the
        last tensor it saved (each handle keeps the call, and so its hold, alive)."""
        account = self._account
        call, hold = self._call(name, module)
        hold.take(self._agreed[index].saved, f"block {name} (its saved tensors, kept)")
        self._note(index, ActivationChoice.KEEP, call)

        def pack(tensor: torch.Tensor) -> Any:
            if self._offload.count(call, tensor) is Saved.MODEL:
                return unlinked(tensor)
            return account.keep(tensor, call)

        with torch.autograd.graph.saved_tensors_hooks(pack, account.unpack):
            out = forward(*args, **kwargs)
        account.kept_total += call.count.saved_bytes
        return out

    def _note(self, index: int, choice: ActivationChoice, call: BlockCall) -> None:
        """A kept or offloaded call of this training forward, checked against its figures at its end."""
        if self._placed is not None:
            self._placed.append((index, choice, call))

    def _replan(self, placed: list[tuple[int, ActivationChoice, BlockCall]], overrunning: list[int]) -> None:
        """Some rank's calls saved more than their figures: agree the new figures (the largest over
        ranks), choose the plan again, and let this forward's calls hold their new figures."""
        n = len(self._agreed)
        own = [0] * (3 * n)
        for index, _, call in placed:
            own[3 * index : 3 * index + 3] = _own(call)
        figures = torch.tensor(own, dtype=torch.int64, device=self._comm.tensor_device)
        self._comm.all_reduce(figures, dist.ReduceOp.MAX)
        values = [int(v) for v in figures.tolist()]
        before = list(self._agreed)
        self._agreed = [old.most(CallBytes(*values[3 * i : 3 * i + 3])) for i, old in enumerate(before)]
        grown = max(range(n), key=lambda i: self._agreed[i].saved - before[i].saved)
        overrun = (
            f"ActivationPlacement(auto=...): a step saved more than the plan's figures on ranks {overrunning} (call "
            f"{grown} of the forward, block {self._measures[grown].name}: {format_bytes(self._agreed[grown].saved)} "
            f"saved, where the plan was made for {format_bytes(before[grown].saved)})"
        )
        try:
            self._decide()
        except BudgetTooSmallError as error:
            raise BudgetTooSmallError(
                f"{overrun}, and no plan for the new figures fits. {error} Run with a device_budget for the largest "
                "shape, or cap the sequence length.",
                error.budget,
                error.minimum,
            ) from None
        extra = 0
        try:
            for index, choice, call in placed:
                old, new = before[index], self._agreed[index]
                hold = call.hold
                assert hold is not None, "an auto call has a hold"
                if choice is ActivationChoice.KEEP:
                    extra += new.saved - old.saved
                    hold.take(new.saved - old.saved, f"block {call.block} (its saved tensors, kept, re-planned)")
                else:  # offloaded: its fetch (in the backward, to come) takes the new copied bytes
                    extra += new.small - old.small
                    hold.take(new.small - old.small, f"block {call.block} (small saved tensors it keeps, re-planned)")
                    call.agreed, call.fetch_bytes = new, new.copied
        except BudgetExceededError as error:
            raise BudgetExceededError(
                f"{overrun}: the calls of this step the old plan kept on the device hold at least "
                f"{format_bytes(extra)} more than it accounted, which device_budget={self._policy.budget} cannot hold "
                "even after releasing every idle chunk. This step is refused; the plan is made again for the new "
                "figures (model.activation_plan): the next step of this shape runs under it. Or raise device_budget.",
                error.minimum,
            ) from None

    def _offloaded(self, call: BlockCall, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            with self._offload.hooks(call):
                out = forward(*args, **kwargs)
        finally:
            self._offload.settle(call)  # also after a failed forward: what it copied leaves the ledger
        self._offload.finish(call)  # its writes to disk (beyond host_budget), agreed over ranks
        return out

    def _measure(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        call, _ = self._call(name, module, self._measured_refusal)
        layer = self._layer
        layer.synchronize(layer.record_event())
        began = time.perf_counter()
        out = self._offloaded(call, forward, *args, **kwargs)
        layer.synchronize(layer.record_event())
        # The offload's own host time (its copies too, where they are synchronous) is not compute.
        seconds = max(0.0, time.perf_counter() - began - call.host_seconds[0])
        self._measured(index, call, seconds)
        return out

    def _measured(self, index: int, call: BlockCall, seconds: float, outside: bool = False) -> None:
        """A measured call's forward ended: its figures are agreed over ranks, and it holds its small
        storages from now on, and its copied bytes from its fetch."""
        count, name = call.count, call.block
        agreed = self._agree(CallBytes(count.saved_bytes, count.small_bytes, count.copied_bytes))
        assert call.hold is not None, "an auto call has a hold"
        if index < len(self._measures):
            old = self._measures[index]
            self._measures[index] = BlockMeasure(name, 0, max(old.forward_seconds, seconds), outside=outside)
            self._agreed[index] = self._agreed[index].most(agreed)
        else:
            self._measures.append(BlockMeasure(name, 0, seconds, outside=outside))
            self._agreed.append(agreed)
            self._offload_times.append(call.host_seconds)  # the fetch adds to it in the backward
        self._refuse_below_minimum(index)
        call.hold.take(agreed.small, f"{'' if outside else 'block '}{name} (small saved tensors it keeps)")
        call.fetch_bytes = agreed.copied
        # Its fetch in the backward needs room that model data (gradient buffers, prefetched chunks)
        # would fill: the policy keeps the largest measured call's copies free until the plan.
        self._policy.reserve_for_measured_activations(agreed.copied)
        self._account.kept_total += count.small_bytes

    def _refuse_below_minimum(self, index: int) -> None:
        """``BudgetTooSmallError`` on every rank (the figures are agreed) as soon as the calls measured
        up to ``index`` need more than the budget can hold with any plan (``placement.refuse_below_minimum``):
        the user learns the minimum at the first training forward, not in its backward."""
        measures, _ = self._figures(index + 1)
        try:
            refuse_below_minimum(measures, self._budget(), self._policy.placement_need().minimum, complete=False)
        except placement_pkg.BudgetTooSmallError as error:
            self._forget_measures()
            raise BudgetTooSmallError.from_placement(error) from None

    def _measured_refusal(self) -> BudgetTooSmallError:
        """What a measured call raises where its bytes find no room: the budget's refusal, naming a
        budget that holds the small storages of the calls measured so far beside each fetch."""
        measures, copied = self._figures(len(self._agreed))
        model = self._policy.placement_need().minimum
        refusal = BudgetTooSmallError.from_placement(measured_step_refusal(measures, copied, self._budget(), model))
        self._forget_measures()
        return refusal

    def _forget_measures(self) -> None:
        """The measured step is refused: its figures go, and the reserve kept for its fetches, so
        that the next training forward measures afresh (the user followed the refusal: a shorter
        sequence or micro-batch) rather than plan from the refused shape's. The figures are agreed,
        so every rank forgets alike."""
        self._measures.clear()
        self._agreed.clear()
        self._offload_times.clear()
        self._policy.forget_measured_activations()

    def _figures(self, calls: int) -> tuple[list[BlockMeasure], list[int]]:
        """The first ``calls`` measured calls' agreed figures, and what their offload copies."""
        figures = self._agreed[:calls]
        measures = [
            BlockMeasure(m.name, b.saved, 0.0, small_bytes=b.small, outside=m.outside)
            for m, b in zip(self._measures, figures, strict=False)
        ]
        return measures, [b.copied for b in figures]

    def _budget(self) -> int:
        budget = self._policy.budget
        assert budget is not None, "auto blocks need a device budget (checked when boosting)"
        return budget

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
        if not self._first_saved:
            self._first_saved = [b.saved for b in self._agreed]
        # A re-plan's calls save more than when their times were measured: their times grow alike.
        growth = [b.saved / first if first else 1.0 for b, first in zip(self._agreed, self._first_saved, strict=True)]
        measures = [
            BlockMeasure(m.name, b.saved, float(t) * g, float(h) * g, small_bytes=b.small, outside=m.outside)
            for m, b, t, h, g in zip(self._measures, self._agreed, agreed[:n], agreed[n : 2 * n], growth, strict=True)
        ]
        to_host, to_device = agreed[2 * n :]
        if not to_device:  # no backward ran in the measured step: take the other direction's rate
            to_device = to_host
        rates = CopyRates(
            to_host=1.0 / to_host if to_host else 0.0,
            to_device=1.0 / to_device if to_device else 0.0,
            overlap=self._layer.asynchronous,
        )
        try:
            plan = choose_activations(
                measures, rates, self._budget(), self._policy.placement_need().minimum, self._max_prefetch
            )
        except placement_pkg.BudgetTooSmallError as error:
            raise BudgetTooSmallError.from_placement(error) from None
        self._policy.reserve_for_activations(plan.reserve)
        self._offload.set_prefetch(plan.prefetch)
        self._plan = plan


def _own(call: BlockCall) -> CallBytes:
    """A call's own figures (this rank's)."""
    count = call.count
    return CallBytes(count.saved_bytes, count.small_bytes, count.copied_bytes)


def _exceeds(own: CallBytes, agreed: CallBytes, choice: ActivationChoice) -> bool:
    """Whether a call's own bytes exceed the figures it is accounted by (a kept call holds its
    saved bytes only)."""
    if choice is ActivationChoice.KEEP:
        return own.saved > agreed.saved
    return any(a > b for a, b in zip(own, agreed, strict=True))
