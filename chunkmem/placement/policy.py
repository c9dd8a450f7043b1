"""The policy interface and the decisions both policies share: eviction by furthest next use
(Belady) and prefetch of the next chunks in the trace within the budget."""

from __future__ import annotations

import heapq
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .snapshot import (
    BufferKind,
    ChunkSpec,
    FetchPlan,
    Layout,
    OpSnapshot,
    ReleaseSnapshot,
    ResidentChunk,
    WorkingSet,
)
from .trace import ComputeTrace, Phase

log = logging.getLogger("chunkmem")

__all__ = [
    "DISK_WINDOW",
    "BudgetNeed",
    "BudgetTooSmallError",
    "HostBudgetTooSmallError",
    "PlacementPolicy",
    "format_bytes",
]


class BudgetTooSmallError(ValueError):
    """The device budget cannot hold the working set of a single op under this placement.
    ``budget`` and ``minimum`` are in bytes (``minimum`` is what this placement needs)."""

    def __init__(self, message: str, budget: int, minimum: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


class HostBudgetTooSmallError(ValueError):
    """The host budget cannot hold what the placement keeps in host memory. ``budget`` and
    ``minimum`` are in bytes (``minimum`` is what this placement needs there)."""

    def __init__(self, message: str, budget: int, minimum: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


DISK_WINDOW = 3
"""Chunks whose optimizer side is on disk are in host memory this many at a time while they are
stepped: one stepped, the next read ahead, the previous written back."""


def format_bytes(n: int) -> str:
    """Human-readable bytes for messages (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("format_bytes: unreachable")


class PlacementPolicy(ABC):
    """Decides, never acts. ``layout`` is called once with the chunk catalog; ``before_op`` and
    ``after_op`` around every hooked op."""

    def __init__(self, max_prefetch: int, budget: int | None, host_budget: int | None = None) -> None:
        self._max_prefetch = max_prefetch
        self._budget = budget
        self._host_budget = host_budget
        self._specs: tuple[ChunkSpec, ...] = ()
        self._layout: Layout | None = None
        self._fetches_cost = False
        self._working_sets: tuple[WorkingSet, ...] = ()
        self._accumulate = False
        self._covers_activations = False
        self._reserved = 0
        self._activations_planned = False

    @property
    def max_prefetch(self) -> int:
        return self._max_prefetch

    @property
    def budget(self) -> int | None:
        """The hard cap on accounted chunk bytes on the device (``None``: no hard cap)."""
        return self._budget

    def cover_activations(self) -> None:
        """The budget covers saved activations too (``ActivationPlacement(auto=...)``): called
        before ``layout``, so that a policy that fills the device with model data can leave room."""
        self._covers_activations = True

    def reserve_for_activations(self, nbytes: int) -> None:
        """Keep ``nbytes`` of the budget free of model data from now on (saved activations and the
        working set of one block, as planned from the first step): ``cap`` is lowered by it. The
        budget itself stays the hard limit of what the ledger accounts."""
        if nbytes < 0:
            raise ValueError(f"reserve_for_activations: negative byte count {nbytes}")
        self._reserved = nbytes
        self._activations_planned = True

    def reserve_for_measured_activations(self, nbytes: int) -> None:
        """While the first step measures saved activations (before any plan): keep at least
        ``nbytes`` of the budget free of model data from now on (the largest measured call's copies,
        fetched back for its backward), so that the fetch finds room that gradient buffers and
        prefetched chunks would otherwise hold. The plan's ``reserve_for_activations`` replaces it."""
        if nbytes < 0:
            raise ValueError(f"reserve_for_measured_activations: negative byte count {nbytes}")
        if not self._activations_planned:
            self._reserved = max(self._reserved, nbytes)

    def forget_measured_activations(self) -> None:
        """The measuring step was refused (its figures are dropped, the next step measures again):
        the reserve it kept goes with them. A plan's reserve stays."""
        if not self._activations_planned:
            self._reserved = 0

    @property
    def activations_planned(self) -> bool:
        """Whether the reserve is a plan's (``reserve_for_activations``), not the measuring step's."""
        return self._activations_planned

    @property
    def reserved(self) -> int:
        """Bytes of the budget kept free of model data for activations (0 unless planned)."""
        return self._reserved

    def _hard_cap(self) -> int | None:
        """The budget less what is reserved for activations (``None``: no budget)."""
        return None if self._budget is None else max(0, self._budget - self._reserved)

    @property
    def host_budget(self) -> int | None:
        """The cap on chunk bytes in host memory (``None``: no cap)."""
        return self._host_budget

    def host_need(self, layout: Layout | None = None) -> int:
        """Host bytes ``layout`` (default: the decided one) needs: what stays there between uses,
        the buffers chunks on disk are stepped in, and the one a parameter shard on disk is read
        into for a gather."""
        layout = layout if layout is not None else self.layout_decided
        specs = self._specs
        return layout.host_bytes(specs) + layout.disk_window_bytes(specs, DISK_WINDOW) + layout.param_read_bytes(specs)

    def _check_host_budget(self, layout: Layout, fix: str) -> None:
        budget = self._host_budget
        if budget is None:
            return
        need = self.host_need(layout)
        if need > budget:
            at_rest = layout.host_bytes(self._specs)
            window = need - at_rest
            raise HostBudgetTooSmallError(
                f"host_budget={budget} ({format_bytes(budget)}) is below the {need} ({format_bytes(need)}) this "
                f"placement keeps in host memory: {format_bytes(at_rest)} of {self._host_contents()} stay there "
                "between steps"
                + (f", and {format_bytes(window)} hold the chunks stepped (or gathered) from disk" if window else "")
                + f". Raise host_budget, {fix}.",
                budget,
                need,
            )

    def _host_contents(self) -> str:
        """What an offloaded chunk keeps in host memory: with 16-bit compute, the 16-bit copy
        gathers read beside the fp32 master; with fp32 compute the master is what they read."""
        if all(spec.master_is_compute for spec in self._specs):
            return "fp32 masters (what gathers read), gradient shards and optimizer states"
        return "16-bit copies (what gathers read), fp32 masters, gradient shards and optimizer states"

    @property
    def layout_decided(self) -> Layout:
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__}: call layout() before asking for decisions")
        return self._layout

    @property
    def working_sets(self) -> tuple[WorkingSet, ...]:
        """The working sets the layout was decided for."""
        return self._working_sets

    def layout(
        self, specs: Sequence[ChunkSpec], working_sets: Sequence[WorkingSet], accumulate: bool = False
    ) -> Layout:
        """Decide where every chunk lives between uses, and refuse a budget that cannot run the
        largest working set under that placement (``BudgetTooSmallError``). ``accumulate`` is a
        hint that ``no_sync`` will be used: the placement then also leaves room for every chunk's
        gradient buffer at once (the auto policy keeps optimizer sides on the host until they
        fit), so accumulation moves nothing to the host. Where no placement can, it is decided as
        without the hint (accumulation then moves gradient buffers to the host when the device
        needs their room), and an info line in the log says so."""
        self._specs = tuple(specs)
        for index, spec in enumerate(self._specs):
            if spec.chunk_id != index:
                raise ValueError(f"layout: chunk specs must be indexed by chunk id, got {spec.chunk_id} at {index}")
        self._working_sets = tuple(working_sets)
        self._accumulate = accumulate
        layout = self._decide_layout(working_sets)
        budget = self._budget
        if accumulate and budget is not None and self.minimum_budget(layout, working_sets, True).minimum > budget:
            log.info(
                "chunkmem: device_budget=%s cannot hold every chunk's gradient buffer at once (%s needed); under "
                "no_sync gradient buffers move to the host when the device needs their room",
                format_bytes(budget),
                format_bytes(self.minimum_budget(layout, working_sets, True).minimum),
            )
            self._accumulate = False
            layout = self._decide_layout(working_sets)
        if budget is not None:
            self._check_budget(layout, working_sets, budget, self._accumulate)
        self._adopt(layout)
        return layout

    def _adopt(self, layout: Layout) -> None:
        self._layout = layout
        # Nothing to prefetch when no gather allocates or moves anything (world size 1 with every
        # compute-dtype shard on the device).
        self._fetches_cost = any(p.fetch_bytes(s) > 0 for p, s in zip(layout.placements, self._specs, strict=True))

    def adopt_layout(self, layout: Layout) -> None:
        """The runtime could not realize the decided layout (no room on the device for some
        chunks, which it kept on the host); decide from what is actually there."""
        if len(layout.placements) != len(self._specs):
            raise ValueError(f"adopt_layout: {len(layout.placements)} placements for {len(self._specs)} chunks")
        self._adopt(layout)

    @abstractmethod
    def _decide_layout(self, working_sets: Sequence[WorkingSet]) -> Layout: ...

    def needs_profile(self, trace: ComputeTrace | None) -> bool:
        """Whether the runtime should measure non-model memory at each op of the next iteration
        (whose trace is ``trace``, ``None`` while none is recorded) and report it to
        ``observe_profile``. Policies that do not use it never ask."""
        return False

    def observe_profile(self, trace: ComputeTrace, non_model_bytes: Sequence[int]) -> None:
        """Non-model bytes measured at each position of ``trace`` (agreed over ranks)."""
        raise NotImplementedError(f"{type(self).__name__} does not use a non-model memory profile")

    def cap(self, position: int, trace: ComputeTrace | None) -> int | None:
        """Model-data cap at a position of ``trace``: the hard budget (less what is reserved for
        activations) unless a policy knows better."""
        return self._hard_cap()

    def before_op(self, snap: OpSnapshot) -> FetchPlan:
        """Evict (furthest next use first) until the op fits under the cap, then choose
        prefetches. The list of device buffers is only read when room must be made."""
        cap = self.cap(snap.position, snap.trace)
        taken: list[ResidentChunk] = []
        used = snap.device_bytes + snap.needed_bytes
        examined = 0
        if cap is not None and used > cap:
            candidates = _evictable(snap)
            examined += len(candidates)
            for victim in _victims(candidates, snap.trace, snap.position):
                if used <= cap:
                    break
                taken.append(victim)
                used -= victim.release_bytes
        prefetch, looked = self._prefetch(snap, cap, used, taken)
        return FetchPlan(
            evict=tuple(v.chunk_id for v in taken if v.kind is BufferKind.GATHERED),
            flush=tuple(v.chunk_id for v in taken if v.kind is not BufferKind.GATHERED),
            prefetch=prefetch,
            examined=examined + looked,
        )

    @abstractmethod
    def after_op(self, snap: ReleaseSnapshot) -> tuple[int, ...]:
        """Which of the chunks an op just finished with to release now."""

    def fetch_cost(self, chunk_id: int) -> int:
        """Device bytes that gathering ``chunk_id`` allocates under the decided layout."""
        return self.layout_decided[chunk_id].fetch_bytes(self._specs[chunk_id])

    def _prefetch(
        self, snap: OpSnapshot, cap: int | None, used: int, taken: list[ResidentChunk]
    ) -> tuple[tuple[int, ...], int]:
        """Gather the chunks of the next ``max_prefetch`` entries of the trace (first uses in a
        pass, and uses in this pass of chunks evicted before them) that are not on the device,
        into free budget or into room made by evicting gathered chunks needed later than them.
        Room for the gradient buffers that backward ops before the prefetched chunk's use will
        allocate is kept free: those ops could not evict a gather still in flight. Returns the
        chunks and how many entries and buffers were looked at."""
        if self._max_prefetch == 0 or snap.trace is None or not self._fetches_cost:
            return (), 0
        layout = self.layout_decided
        trace = snap.trace
        residency = snap.residency
        gone = {v.chunk_id for v in taken if v.kind is BufferKind.GATHERED}
        flushed = {v.chunk_id for v in taken if v.kind is not BufferKind.GATHERED}
        needed = set(snap.needed)
        grads_now = needed if snap.phase is Phase.BACKWARD else set()
        counted: set[int] = set()
        reserve, scanned, examined = 0, snap.position, 0
        evictable: list[ResidentChunk] | None = None
        chosen: list[int] = []
        entries = trace.entries_after(snap.position)
        entry = next(entries, None)
        # Chunks evicted earlier (or by this plan) that an op of this pass needs again come in
        # order with the entries: prefetching past them would pin room they need.
        reuses = [*residency.awaited(), *_reuses(trace, taken, snap.position)]
        heapq.heapify(reuses)
        for _ in range(self._max_prefetch):
            if reuses and (entry is None or reuses[0] < entry):
                position, chunk_id = heapq.heappop(reuses)
            elif entry is not None:
                position, chunk_id = entry
                entry = next(entries, None)
            else:
                break
            examined += 1
            # The reserve only limits what fits under a cap: without one, skip the scan.
            for _, c in trace.grad_entries_in(scanned, position) if cap is not None else ():
                examined += 1
                if c in counted or c in grads_now or not self._specs[c].trainable:
                    continue
                if residency.has_grad_buffer(c) and c not in flushed:
                    continue
                counted.add(c)
                reserve += layout[c].grad_buffer_bytes(self._specs[c])
            scanned = position
            if chunk_id in needed or chunk_id in chosen or layout[chunk_id].keep_gathered:
                continue
            if residency.is_gathered(chunk_id) and chunk_id not in gone:
                continue
            cost = self.fetch_cost(chunk_id)
            if cost == 0:
                continue
            if cap is not None and used + cost + reserve > cap:
                if evictable is None:
                    evictable = [c for c in _evictable(snap) if c.kind is BufferKind.GATHERED and c not in taken]
                    examined += len(evictable)
                room = [
                    v
                    for v in _victims(evictable, trace, snap.position)
                    if _next_use(trace, v, snap.position) > position
                ]
                freed = 0
                victims: list[ResidentChunk] = []
                for victim in room:
                    if used - freed + cost + reserve <= cap:
                        break
                    victims.append(victim)
                    freed += victim.release_bytes
                if used - freed + cost + reserve > cap:
                    break
                for victim in victims:
                    taken.append(victim)
                    evictable.remove(victim)
                    gone.add(victim.chunk_id)
                for reuse in _reuses(trace, victims, snap.position):
                    heapq.heappush(reuses, reuse)
                used -= freed
            chosen.append(chunk_id)
            used += cost
        return tuple(chosen), examined

    def minimum_budget(
        self, layout: Layout, working_sets: Sequence[WorkingSet], accumulate: bool = False
    ) -> BudgetNeed:
        """What ``layout`` needs on the device: what stays between uses, plus the largest
        single-op working set (gathered parameters and gradient buffers of one module's chunks);
        with ``accumulate``, every trainable chunk's gradient buffer at once instead of the
        working set's own."""
        at_rest = layout.at_rest_bytes(self._specs)
        grads = sum(layout[s.chunk_id].grad_buffer_bytes(s) for s in self._specs if s.trainable) if accumulate else 0
        worst, worst_need = None, 0
        for ws in working_sets:
            need = sum(
                layout[c].fetch_bytes(self._specs[c])
                + (0 if accumulate else layout[c].grad_buffer_bytes(self._specs[c]))
                for c in ws.chunks
            )
            if need > worst_need:
                worst, worst_need = ws, need
        return BudgetNeed(at_rest, grads, worst_need, worst)

    def inference_need(self, chunks: Collection[int]) -> BudgetNeed:
        """What an inference forward of the model on ``chunks`` needs on the device under the
        decided layout: what every chunk holds there between uses, and the largest single-op
        working set among that model's (those on ``chunks`` alone), of gathered parameters only: an
        inference forward allocates no gradient buffer."""
        layout = self.layout_decided
        worst, worst_need = None, 0
        for ws in self._working_sets:
            if not set(ws.chunks) <= set(chunks):
                continue
            need = sum(layout[c].fetch_bytes(self._specs[c]) for c in ws.chunks)
            if need > worst_need:
                worst, worst_need = ws, need
        return BudgetNeed(layout.at_rest_bytes(self._specs), 0, worst_need, worst, gradients=False)

    def placement_need(self) -> BudgetNeed:
        """What the decided layout needs on the device (with the gradient accumulation it was
        decided for)."""
        return self.minimum_budget(self.layout_decided, self._working_sets, self._accumulate)

    def _check_budget(self, layout: Layout, working_sets: Sequence[WorkingSet], budget: int, accumulate: bool) -> None:
        need = self.minimum_budget(layout, working_sets, accumulate)
        if need.minimum > budget:
            raise BudgetTooSmallError(
                f"device_budget={budget} ({format_bytes(budget)}) is below the minimum of {need.minimum} "
                f"({format_bytes(need.minimum)}) this placement needs: {need.describe()}. Raise device_budget, "
                "offload more to the host, or use a smaller chunk_size.",
                budget,
                need.minimum,
            )


@dataclass(frozen=True, slots=True)
class BudgetNeed:
    """Device bytes a layout needs, by cause."""

    at_rest: int
    """What stays on the device between uses."""
    grad_buffers: int
    """Every trainable chunk's gradient buffer at once (gradient accumulation under ``no_sync``);
    0 when gradient buffers come and go with the working set."""
    working_set: int
    """The largest single-op working set."""
    worst: WorkingSet | None
    gradients: bool = True
    """Whether the working set holds gradient buffers (a training step's; not an inference forward's)."""

    @property
    def minimum(self) -> int:
        return self.at_rest + self.grad_buffers + self.working_set

    def describe(self) -> str:
        """The causes that apply, for messages."""
        parts = [f"{format_bytes(self.at_rest)} stay on the device between uses"]
        if self.grad_buffers:
            parts.append(
                f"{format_bytes(self.grad_buffers)} of gradient buffers accumulate under no_sync until the "
                "synchronised backward"
            )
        if self.worst is not None:
            both = self.gradients and not self.grad_buffers
            what = "gathered parameters and gradient buffers" if both else "gathered parameters"
            parts.append(
                f"the largest single-op working set, module '{self.worst.label}' on chunks {self.worst.chunks}, "
                f"needs {format_bytes(self.working_set)} for its {what}"
            )
        return ", ".join(parts[:-1]) + (", and " if len(parts) > 1 else "") + parts[-1]


def _reuses(trace: ComputeTrace, taken: Sequence[ResidentChunk], position: int) -> list[tuple[int, int]]:
    """Where the gathered buffers evicted by this plan are needed again in the same pass."""
    out = []
    for victim in taken:
        if victim.kind is BufferKind.GATHERED and trace.used_again_in_pass(victim.chunk_id, position):
            nxt = trace.next_use(victim.chunk_id, position)
            assert nxt is not None, "used again in the pass but no next use"
            out.append((nxt, victim.chunk_id))
    return out


def _evictable(snap: OpSnapshot) -> list[ResidentChunk]:
    """Buffers that can be given back now: not used by a running op, not still arriving, not
    needed by this op, and actually holding bytes."""
    needed = set(snap.needed)
    return [
        r
        for r in snap.residency.buffers()
        if not r.held and not r.fetching and r.release_bytes > 0 and r.chunk_id not in needed
    ]


def _next_use(trace: ComputeTrace | None, buffer: ResidentChunk, position: int) -> float:
    """When the buffer is needed again: any use for a gathered buffer, a backward use for a
    gradient buffer, never for one whose reduction is in flight. Never again is infinitely far."""
    if trace is None or buffer.kind is BufferKind.REDUCING:
        return float("inf")
    phase = Phase.BACKWARD if buffer.kind in (BufferKind.GRAD, BufferKind.SPILL) else None
    nxt = trace.next_use(buffer.chunk_id, position, phase)
    return float("inf") if nxt is None else float(nxt)


def _victims(candidates: Sequence[ResidentChunk], trace: ComputeTrace | None, position: int) -> list[ResidentChunk]:
    """Eviction order: with a trace, furthest next use first (never again first: Belady), gathered
    buffers before gradient buffers at equal distance (re-gathering is cheaper than reducing
    twice; finishing a reduction in flight costs only the wait); while recording, least recently
    used first. Gradient buffers that would move to the host (inside ``no_sync``) come after every
    other buffer. Ties break on chunk id so every rank agrees."""
    kind_order = {BufferKind.GATHERED: 0, BufferKind.REDUCING: 1, BufferKind.GRAD: 2, BufferKind.SPILL: 3}
    if trace is None:
        return sorted(
            candidates, key=lambda r: (r.kind is BufferKind.SPILL, r.last_use, kind_order[r.kind], r.chunk_id)
        )
    return sorted(
        candidates,
        key=lambda r: (r.kind is BufferKind.SPILL, -_next_use(trace, r, position), kind_order[r.kind], r.chunk_id),
    )
