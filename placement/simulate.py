"""Replay a policy on a trace without tensors: predicts fetches, transfer volume and peak device
bytes for a model that is not run (or checks a policy against an independent optimum)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .policy import PlacementPolicy
from .snapshot import BufferKind, ChunkSpec, OpSnapshot, ReleaseSnapshot, ResidentChunk, ResidentSet, WorkingSet
from .trace import ComputeTrace, Phase

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

    @property
    def fetches(self) -> int:
        return self.demand_fetches + self.prefetches


def simulate(
    policy: PlacementPolicy,
    specs: Sequence[ChunkSpec],
    trace: ComputeTrace,
    iterations: int = 1,
    working_sets: Sequence[WorkingSet] = (),
) -> SimulationResult:
    """Run ``iterations`` iterations of ``trace`` through ``policy`` (whose layout is decided here),
    applying each plan the way the runtime does: evict and flush, fetch what the op needs, start
    prefetches, then release what ``after_op`` returns. A chunk's gradient buffer lives from its
    first backward use until its last one in the iteration (when its gradients are complete), or
    until flushed. Everything is released between iterations, as after an optimizer step."""
    specs = tuple(specs)
    layout = policy.layout(specs, working_sets or [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    at_rest = layout.at_rest_bytes(specs)
    last_backward: dict[int, int] = {}
    for index, step in enumerate(trace.steps):
        if step.phase is Phase.BACKWARD:
            for c in step.chunks:
                last_backward[c] = index

    demand = prefetches = flushes = fetched = 0
    peak = at_rest
    over = False
    budget = policy.budget
    for _ in range(iterations):
        gathered: dict[int, int] = {}  # chunk id -> last use position (-1: prefetched, unused)
        fetching: set[int] = set()
        grads: dict[int, int] = {}
        awaited: dict[int, int] = {}  # evicted chunk -> its next use in the same pass

        def device_bytes(gathered: dict[int, int] = gathered, grads: dict[int, int] = grads) -> int:
            return (
                at_rest
                + sum(layout[c].fetch_bytes(specs[c]) for c in gathered)
                + sum(layout[c].grad_buffer_bytes(specs[c]) for c in grads)
            )

        for position, step in enumerate(trace.steps):
            backward = step.phase is Phase.BACKWARD
            need = 0
            for c in step.chunks:
                if c not in gathered and not layout[c].keep_gathered:
                    need += layout[c].fetch_bytes(specs[c])
                if backward and specs[c].trainable and c not in grads:
                    need += layout[c].grad_buffer_bytes(specs[c])
            resident = [
                ResidentChunk(c, BufferKind.GATHERED, layout[c].fetch_bytes(specs[c]), False, c in fetching, last)
                for c, last in sorted(gathered.items())
            ] + [
                ResidentChunk(c, BufferKind.GRAD, layout[c].grad_buffer_bytes(specs[c]), False, False, last)
                for c, last in sorted(grads.items())
                if layout[c].grad_buffer_bytes(specs[c]) > 0
            ]
            plan = policy.before_op(
                OpSnapshot(
                    position=position,
                    phase=step.phase,
                    needed=step.chunks,
                    needed_bytes=need,
                    residency=ResidentSet(
                        tuple(resident),
                        frozenset(grads),
                        tuple(sorted((p, c) for c, p in awaited.items() if p > position and c not in gathered)),
                    ),
                    device_bytes=device_bytes(),
                    trace=trace,
                )
            )
            for c in plan.evict:
                del gathered[c]
                fetching.discard(c)
                if trace.used_again_in_pass(c, position):
                    awaited[c] = trace.next_use(c, position) or -1
            for c in plan.flush:
                del grads[c]
                flushes += 1
            for c in step.chunks:
                fetching.discard(c)
                if not layout[c].keep_gathered:
                    if c not in gathered:
                        demand += 1
                        fetched += layout[c].fetch_bytes(specs[c])
                    gathered[c] = position
                if backward and specs[c].trainable:
                    grads[c] = position
            if budget is not None and device_bytes() > budget:
                over = True
            for c in plan.prefetch:
                prefetches += 1
                fetched += layout[c].fetch_bytes(specs[c])
                gathered[c] = -1
                fetching.add(c)
            peak = max(peak, device_bytes())
            if budget is not None and device_bytes() > budget:
                over = True
            release = policy.after_op(
                ReleaseSnapshot(
                    position=position,
                    phase=step.phase,
                    finished=step.chunks,
                    in_backward=step.in_backward_pass,
                    trace=trace,
                )
            )
            for c in release:
                gathered.pop(c, None)
            if backward:
                for c in step.chunks:
                    if last_backward.get(c) == position:
                        grads.pop(c, None)
    return SimulationResult(demand, prefetches, flushes, fetched, peak, over)
