"""Replay a policy on a trace without tensors: predicts fetches, transfer volume and peak device
bytes for a model that is not run (or checks a policy against an independent optimum).

The replay is the runtime's own :class:`DeviceResidency`, driven the way the runtime drives it (an
op's chunks made resident and let go, which completes gradients by the residency's one rule, the
end of each backward pass, the optimizer step), with nothing behind its actions: what it predicts
is what a run does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .actions import Action, Verb
from .policy import PlacementPolicy
from .residency import DeviceResidency, NoRoomError
from .snapshot import ChunkSpec, WorkingSet
from .trace import ComputeTrace

__all__ = ["SimulationResult", "simulate"]


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What a replay of a policy on a trace did."""

    demand_fetches: int
    """Gathers an op had to start itself."""
    prefetches: int
    """Gathers started ahead of use."""
    flushes: int
    """Gradient buffers reduced early to make room."""
    fetched_bytes: int
    """Device bytes brought in by all gathers."""
    peak_device_bytes: int
    over_budget: bool
    """Whether some op could not run within the policy's hard budget."""
    actions: tuple[tuple[Action, ...], ...] = field(default=(), compare=False)
    """The actions of each iteration, in order (what the runtime would carry out)."""

    @property
    def fetches(self) -> int:
        return self.demand_fetches + self.prefetches


class _Tally:
    """Counts the actions of a replay and the device bytes after each."""

    def __init__(self, residency: DeviceResidency, specs: Sequence[ChunkSpec], budget: int | None) -> None:
        self.residency = residency
        self.specs = specs
        self.budget = budget
        self.counts = dict.fromkeys(Verb, 0)
        self.fetched = 0
        self.peak = residency.device_bytes
        self.over = False
        self.actions: list[Action] = []

    def run(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self.actions.append(action)
            self.counts[action.verb] += 1
            if action.verb in (Verb.GATHER, Verb.PREFETCH):
                self.fetched += self.residency.gather_bytes(action.chunk)
            now = self.residency.device_bytes
            self.peak = max(self.peak, now)
            self.over = self.over or (self.budget is not None and now > self.budget)


def simulate(
    policy: PlacementPolicy,
    specs: Sequence[ChunkSpec],
    trace: ComputeTrace,
    iterations: int = 1,
    working_sets: Sequence[WorkingSet] = (),
    world_size: int = 1,
) -> SimulationResult:
    """Run ``iterations`` training iterations of ``trace`` through ``policy`` (whose layout is
    decided here) as the runtime runs them: each op's chunks made resident and its prefetches
    started, a chunk's gradients complete after its last backward op in the pass (the residency's
    rule), the end of each backward pass (everything reduced: no ``no_sync``), the optimizer step
    (everything released or refreshed) and ``zero_grad``. An op that cannot fit under the budget
    ends the replay (``over_budget``)."""
    specs = tuple(specs)
    layout = policy.layout(specs, working_sets or [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    kept = sum(
        p.fetch_bytes(s, ignore_keep=True) for p, s in zip(layout.placements, specs, strict=True) if p.keep_gathered
    )
    resting = layout.at_rest_bytes(specs) - kept  # kept gathered buffers are the residency's own
    residency = DeviceResidency(policy, specs, world_size, lambda: resting)
    tally = _Tally(residency, specs, policy.budget)
    per_iteration: list[tuple[Action, ...]] = []
    steps = trace.steps
    try:
        tally.run(residency.start())
        for _ in range(iterations):
            begin = len(tally.actions)
            residency.begin_iteration()
            open_ops: list[int] = []
            for position, step in enumerate(steps):
                tally.run(residency.before_op(position, step.phase, step.chunks, trace))
                open_ops.append(position)
                # Ops let go of their chunks innermost first, where the trace says they did.
                while open_ops and trace.closes[open_ops[-1]] == position:
                    op = open_ops.pop()
                    done = steps[op]
                    tally.run(residency.after_op(position, done.phase, done.chunks, done.in_backward_pass, trace, op))
                if step.in_backward_pass and (position + 1 == len(steps) or not steps[position + 1].in_backward_pass):
                    tally.run(residency.end_backward())  # loss.backward() returns
            if residency.unreduced:  # the optimizer step (as the runtime prepares it)
                tally.run(residency.reduce_all())
            tally.run(residency.release_idle())
            tally.run(residency.after_step())
            tally.run(residency.zero_grads())
            per_iteration.append(tuple(tally.actions[begin:]))
    except NoRoomError:
        tally.over = True
    counts = tally.counts
    return SimulationResult(
        demand_fetches=counts[Verb.GATHER],
        prefetches=counts[Verb.PREFETCH],
        flushes=counts[Verb.REDUCE_EARLY],
        fetched_bytes=tally.fetched,
        peak_device_bytes=tally.peak,
        over_budget=tally.over,
        actions=tuple(per_iteration),
    )
