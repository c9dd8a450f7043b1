"""The per-block activation choice under one device budget (``ActivationPlacement(auto=...)``):
from what the first step measured of each block call (the bytes autograd saved in it, its forward
time) and of the copies (bandwidth each way), which calls keep what they save on the device, which
offload it to host memory and which recompute it, so that model data, kept activations and the
working set of one block fit the budget with the least estimated step time.

Pure decisions: nothing here measures or moves a tensor.

The model (estimates, not guarantees of time; the byte bounds are what the runtime enforces):

* **keep** costs no time and holds the call's saved bytes on the device from its forward to its
  backward.
* **recompute** costs the call's forward once more in the backward; between the two it holds
  nothing, during its backward its saved bytes again (the working set of one block).
* **offload** costs the host time its hooks took in the first step (packing, fetching, waits)
  and the part of the two copies (device to host in the forward, back in the backward) that does
  not hide behind compute: on an asynchronous device the copy out hides behind the call's own
  forward and, fetched ``prefetch`` offloaded calls ahead of its backward, the copy back behind the
  backward of the ``prefetch`` calls after it (about twice their forward; fetched when its backward
  needs it, behind nothing); on a synchronous one (the CPU) nothing hides, and the copies are part
  of the hooks' time. It holds the call's saved bytes on the device while they are copied out and
  once fetched back: in the backward the call and the ``prefetch`` offloaded calls fetched ahead;
  and its small storages (``BlockMeasure.small_bytes``: under ``min_offload_bytes``, not copied)
  from its forward to its backward, as the ledger does (``chunkmem.activations.ledger``).

The budget: ``model + kept + small + reserve <= budget``, where ``model`` is what the placement of
model data needs at least (what stays on the device and the largest working set of one op),
``kept`` the kept calls' saved bytes, ``small`` the offloaded calls' small storages and ``reserve``
the largest call's saved bytes (one block's working set: the call being saved or copied, or a
recomputation in the backward) plus the ``prefetch`` largest copies of the offloaded calls (those
fetched ahead). Each call not kept goes its cheaper other way; where the offloaded calls' small
storages do not fit with nothing kept, those whose offload saves the least time per small byte are
recomputed instead (a recomputed call holds nothing). The choice then keeps, among the calls that
fit, those whose other way costs the most time per byte, and offloads again what was recomputed
for room where the room is left; it is made for each depth up to ``max_prefetch`` and the one with
the least estimated time is taken (on a tie the shallower).

The stretches of the forward outside the blocks (``ActivationPlacement.offload_outside``:
``BlockMeasure.outside``) are calls of the plan that are always offloaded: never kept nor
recomputed, their small storages always held, so the least budget adds them
(``activation_minimum``); a depth whose fetches ahead do not fit beside them is not taken.

A budget under the plan's least is refused from the first training forward on, as the calls are
measured (``refuse_below_minimum``). The measured step (the first training step offloads every call)
fits the plan's least where the calls keep no small storages; where they do, fetching a call back
for its backward beside those the calls before it keep may find no room, and is refused then
(``measured_step_refusal``), naming a budget that holds them (``measured_minimum``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .policy import BudgetTooSmallError, format_bytes

__all__ = [
    "ActivationChoice",
    "ActivationPlan",
    "BlockMeasure",
    "CopyRates",
    "activation_minimum",
    "choose_activations",
    "measured_minimum",
    "measured_step_refusal",
    "refuse_below_minimum",
]


class ActivationChoice(enum.Enum):
    """Where one block call's saved tensors live between its forward and its backward."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class BlockMeasure:
    """What the first step measured of one block call (the maximum over ranks)."""

    name: str
    """The block's module name."""
    saved_bytes: int
    """Bytes autograd saved in the call, apart from model memory (each storage once)."""
    forward_seconds: float
    """The call's forward time: what recomputing it costs."""
    offload_seconds: float = 0.0
    """Host time the call's offload took in the first step (packing, waiting for its copies out,
    fetching: copies included where they are synchronous)."""
    small_bytes: int = 0
    """Of ``saved_bytes``, what an offload of the call leaves on the device (storages under
    ``min_offload_bytes``: ``counting.SavedCount``), held from its forward to its backward."""
    outside: bool = False
    """A stretch of the forward outside the blocks (``ActivationPlacement.offload_outside``): always
    offloaded (it is no call that could be recomputed), never kept."""


@dataclass(frozen=True, slots=True)
class CopyRates:
    """Copy bandwidths the first step measured (bytes per second; 0: none measured) and whether
    copies run beside compute."""

    to_host: float
    to_device: float
    overlap: bool


@dataclass(frozen=True, slots=True)
class ActivationPlan:
    """The choice for each block call of a training forward, in forward order."""

    blocks: tuple[str, ...]
    choices: tuple[ActivationChoice, ...]
    saved_bytes: tuple[int, ...]
    kept_bytes: int
    """Saved bytes of the kept calls (on the device from their forward to their backward)."""
    reserve: int
    """Device bytes kept free of model data for the working set of one block and the fetches ahead."""
    seconds: float
    """The model's estimate of the time the choice adds to a step (0 when everything is kept)."""
    prefetch: int = 0
    """How many offloaded calls, next in backward order, are fetched back when an offloaded call's
    backward starts (its room is in ``reserve``; 0 when no call is offloaded)."""
    small_bytes: int = 0
    """The small storages the offloaded calls leave on the device (from their forward to their
    backward, as the kept calls' saved bytes)."""

    def choice(self, index: int) -> ActivationChoice:
        """The choice for the ``index``-th block call of a forward (calls past the measured ones
        are recomputed: they were not measured, and recomputing holds nothing)."""
        return self.choices[index] if index < len(self.choices) else ActivationChoice.RECOMPUTE

    @property
    def device_bytes(self) -> int:
        """The most saved activations this plan holds on the device (kept, the offloaded calls'
        small storages, plus one block)."""
        return self.kept_bytes + self.small_bytes + self.reserve

    def by_block(self) -> dict[str, ActivationChoice]:
        """Each block's choice (a block called more than once a forward: its first call's)."""
        out: dict[str, ActivationChoice] = {}
        for name, choice in zip(self.blocks, self.choices, strict=True):
            out.setdefault(name, choice)
        return out


def _offload_seconds(index: int, measures: Sequence[BlockMeasure], rates: CopyRates, prefetch: int) -> float:
    measure = measures[index]
    if rates.to_host <= 0 or rates.to_device <= 0:
        return float("inf")  # nothing measured: never preferred
    out = measure.saved_bytes / rates.to_host
    back = measure.saved_bytes / rates.to_device
    if not rates.overlap:  # the copies ran on the host, inside the hooks' time
        return max(measure.offload_seconds, out + back)
    # Fetched ``prefetch`` offloaded calls ahead, the copy back runs beside the backward of at least
    # the ``prefetch`` calls after it in forward order (about twice their forward); 0: beside nothing.
    behind = 2 * sum(m.forward_seconds for m in measures[index + 1 : index + 1 + prefetch])
    return measure.offload_seconds + max(0.0, out - measure.forward_seconds) + max(0.0, back - behind)


def activation_minimum(saved_bytes: Sequence[int], model_bytes: int, outside_small: int = 0) -> int:
    """The least budget an ``auto`` plan can run in: model data's need and the largest call's
    saved bytes (a call kept nowhere else still lives on the device while it runs), and the small
    storages the stretches outside the blocks leave on the device (``outside_small``: they are
    offloaded whatever the plan)."""
    return model_bytes + max(saved_bytes, default=0) + outside_small


def measured_minimum(small: Sequence[int], copied: Sequence[int], model_bytes: int) -> tuple[int, int]:
    """The least budget the measured step runs in (the first training step of ``auto`` blocks:
    every call offloaded, the calls fetched back one at a time), and the index of the call that
    needs it: model data's need and, when a call is fetched for its backward, its copies back and
    its small storages beside the small storages of the calls before it in forward order (their
    backward is still to come; the calls after it are gone)."""
    held, most, which = 0, 0, 0
    for index, (kept, back) in enumerate(zip(small, copied, strict=True)):
        if held + kept + back > most:
            most, which = held + kept + back, index
        held += kept
    return model_bytes + most, which


def refuse_below_minimum(
    measures: Sequence[BlockMeasure], budget: int, model_bytes: int, complete: bool = True
) -> None:
    """``BudgetTooSmallError`` naming ``activation_minimum`` where ``budget`` is under it: no plan of
    these calls fits. ``complete``: ``measures`` are every call of the forward; else the calls so
    far (the first training forward refuses as it measures them), and the minimum is a lower bound."""
    outside_small = sum(m.small_bytes for m in measures if m.outside)
    minimum = activation_minimum([m.saved_bytes for m in measures], model_bytes, outside_small)
    if minimum > budget:
        raise _too_small(measures, budget, model_bytes, minimum, complete)


def measured_step_refusal(
    measures: Sequence[BlockMeasure], copied: Sequence[int], budget: int, model_bytes: int
) -> BudgetTooSmallError:
    """The refusal where the measured step finds no room for a call's bytes (a budget at least
    ``activation_minimum``, where the small storages of the calls before it are held beside it):
    naming the larger of the plan's least and ``measured_minimum`` (``copied``: what the offload of
    each call copies), which takes model data at its least need beside every fetch, so it runs."""
    outside_small = sum(m.small_bytes for m in measures if m.outside)
    plan = activation_minimum([m.saved_bytes for m in measures], model_bytes, outside_small)
    first, which = measured_minimum([m.small_bytes for m in measures], copied, model_bytes)
    measured = (
        f"the first training step offloads every call to measure it, and fetching {measures[which].name} back for "
        f"its backward takes up to {format_bytes(first - model_bytes)} beside model data (its copies, and the small "
        "saved tensors it and the calls before it keep on the device)"
    )
    return _too_small(measures, budget, model_bytes, max(plan, first), True, measured)


def _too_small(
    measures: Sequence[BlockMeasure],
    budget: int,
    model_bytes: int,
    minimum: int,
    complete: bool,
    measured: str | None = None,
) -> BudgetTooSmallError:
    """The refusal of ``budget``, naming ``minimum`` and what it holds (``measured``: the measured
    step's part, where it is what does not fit)."""
    outside_small = sum(m.small_bytes for m in measures if m.outside)
    largest = max(measures, key=lambda m: m.saved_bytes, default=BlockMeasure("(none)", 0, 0.0))
    parts = [
        f"model data needs at least {format_bytes(model_bytes)}, and block {largest.name} saves "
        f"{format_bytes(largest.saved_bytes)} (the most any rank's call saved)"
    ]
    if outside_small:
        parts.append(f"the stretches outside the blocks leave {format_bytes(outside_small)} on the device")
    if measured is not None:
        parts.append(measured)
    so_far = (
        ""
        if complete
        else f" (for the calls up to {measures[-1].name}, measured so far in the first training forward: the calls "
        "after it may need more; chunkmem.plan(model, plugin, example_inputs) gives the whole figure before a run)"
    )
    fewer_small = ", lower ActivationPlacement.min_offload_bytes (fewer small tensors stay)" if measured else ""
    return BudgetTooSmallError(
        f"device_budget={budget} ({format_bytes(budget)}) cannot hold model data and the saved activations of one "
        f"block: {'; '.join(parts)}. A device_budget of at least {minimum} ({format_bytes(minimum)}){so_far} would "
        "train with every block recomputed or offloaded; raise device_budget, shorten the sequence or the "
        f"micro-batch{fewer_small}, or offload more model data to the host.",
        budget,
        minimum,
    )


def _in_flight(measures: Sequence[BlockMeasure], offloaded: Sequence[bool], prefetch: int) -> int:
    """Room for the fetches ahead: the ``prefetch`` largest copies of the offloaded calls (what a
    fetch brings back: the saved bytes less the small storages that stayed)."""
    copies = (m.saved_bytes - m.small_bytes for m, o in zip(measures, offloaded, strict=True) if o)
    return sum(sorted(copies, reverse=True)[:prefetch])


def _choose_at(
    measures: Sequence[BlockMeasure], rates: CopyRates, room: int, largest: int, prefetch: int
) -> ActivationPlan | None:
    """The plan that fetches ``prefetch`` offloaded calls ahead, keeping what fits ``room`` (the
    budget less model data) beside one block's working set, the fetches ahead and the small storages
    the offloaded calls leave on the device (``None`` where even every call but the stretches
    outside the blocks recomputed does not fit: at depth 0 that is below ``activation_minimum``)."""
    n = len(measures)
    saved = [m.saved_bytes for m in measures]
    offload = [_offload_seconds(i, measures, rates, prefetch) for i in range(n)]
    # Each call not kept goes the cheaper other way.
    choice = [
        ActivationChoice.OFFLOAD if m.outside or offload[i] < m.forward_seconds else ActivationChoice.RECOMPUTE
        for i, m in enumerate(measures)
    ]

    def cost(i: int) -> float:
        return {ActivationChoice.KEEP: 0.0, ActivationChoice.OFFLOAD: offload[i]}.get(
            choice[i], measures[i].forward_seconds
        )

    def held() -> tuple[int, int]:
        """The kept calls' saved bytes, the offloaded calls' small storages."""
        kept = sum(saved[i] for i in range(n) if choice[i] is ActivationChoice.KEEP)
        return kept, sum(measures[i].small_bytes for i in range(n) if choice[i] is ActivationChoice.OFFLOAD)

    def reserve() -> int:
        return largest + _in_flight(measures, [c is ActivationChoice.OFFLOAD for c in choice], prefetch)

    def fits() -> bool:
        return sum(held()) + reserve() <= room

    # An offloaded call keeps its small storages on the device until its backward: where they (and
    # the fetches ahead) do not fit beside nothing kept, recompute the offloaded calls whose offload
    # saves the least time per byte it leaves there (ties: the earlier call; so every rank agrees).
    offloaded = [i for i in range(n) if choice[i] is ActivationChoice.OFFLOAD and not measures[i].outside]
    demoted = []
    for i in sorted(
        offloaded, key=lambda i: ((measures[i].forward_seconds - offload[i]) / max(1, measures[i].small_bytes), i)
    ):
        if fits():
            break
        choice[i] = ActivationChoice.RECOMPUTE
        demoted.append(i)
    if not fits():
        return None
    # Keep the calls whose other way costs the most per byte, while they fit (ties: the earlier
    # call, whose bytes wait longest for their backward either way). A kept call is not fetched nor
    # leaves small storages: the room they took may shrink as calls are kept.
    for i in sorted((i for i in range(n) if not measures[i].outside), key=lambda i: (-cost(i) / max(1, saved[i]), i)):
        other, choice[i] = choice[i], ActivationChoice.KEEP
        if not fits():
            choice[i] = other
    # The room kept calls left: offload again what was recomputed for the small storages, where it fits.
    for i in reversed(demoted):
        if choice[i] is ActivationChoice.RECOMPUTE:
            choice[i] = ActivationChoice.OFFLOAD
            if not fits():
                choice[i] = ActivationChoice.RECOMPUTE
    kept, small = held()
    return ActivationPlan(
        blocks=tuple(m.name for m in measures),
        choices=tuple(choice),
        saved_bytes=tuple(saved),
        kept_bytes=kept,
        reserve=reserve(),
        seconds=sum(cost(i) for i in range(n)),
        prefetch=prefetch if ActivationChoice.OFFLOAD in choice else 0,
        small_bytes=small,
    )


def choose_activations(
    measures: Sequence[BlockMeasure], rates: CopyRates, budget: int, model_bytes: int, max_prefetch: int = 0
) -> ActivationPlan:
    """The plan for ``measures`` (block calls in forward order) under ``budget`` with
    ``model_bytes`` of model data at least, its offloaded calls fetched up to ``max_prefetch``
    calls ahead of their backward; ``BudgetTooSmallError`` naming the minimum when even keeping
    nothing does not fit.

    Each depth from 0 to ``max_prefetch`` that fits is planned (the deeper, the more room the
    fetches ahead take from kept calls, the more of the copies back hide behind compute on an
    asynchronous device); the plan with the least estimated time is chosen, on a tie the shallower
    (on a synchronous device fetching ahead hides nothing)."""
    reserve = max((m.saved_bytes for m in measures), default=0)
    refuse_below_minimum(measures, budget, model_bytes)
    best: ActivationPlan | None = None
    for depth in range(max_prefetch + 1):
        plan = _choose_at(measures, rates, budget - model_bytes, reserve, depth)
        if plan is not None and (best is None or plan.seconds < best.seconds):
            best = plan
    assert best is not None, "depth 0 is always planned"
    return best
