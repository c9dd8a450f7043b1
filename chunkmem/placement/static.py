"""The static policy: Gemini's fractions, applied in chunk-id order so every rank agrees."""

from __future__ import annotations

from collections.abc import Sequence

from .config import StaticPlacementConfig
from .places import Location
from .policy import PlacementPolicy, format_bytes
from .snapshot import BufferKind, ChunkPlacement, ChunkSpec, Layout, ReleaseSnapshot, WorkingSet
from .trace import ComputeTrace, Phase

__all__ = ["RECORDING_WINDOW", "StaticPolicy"]

RECORDING_WINDOW = 3
"""Gathered chunks the static policy without a device budget keeps after their op while it
records the trace (it cannot yet tell which will be used again): a LoRA layer's ops alternate
between its base's chunk and the adapters' chunk, and a layer's norms may sit in the chunk of the
layer before (parameters are packed in registration order, not in the order ops use them)."""


def _first_fraction(specs: Sequence[ChunkSpec], frac: float) -> set[int]:
    """Chunks taken in the order given until ``frac`` of their combined gathered size is covered."""
    total = sum(s.gathered_bytes for s in specs)
    # Tolerance for fractions such as 1 - 0.7 = 0.30000000000000004.
    target = frac * total - 1e-9 * total
    chosen: set[int] = set()
    covered = 0
    for spec in specs:
        if covered >= target:
            break
        chosen.add(spec.chunk_id)
        covered += spec.gathered_bytes
    return chosen


class StaticPolicy(PlacementPolicy):
    """ZeRO-3 by default: gather at a chunk's first use in a pass, release after its last.
    ``shard_param_frac`` keeps the first chunks gathered; ``offload_optim_frac`` and
    ``offload_param_frac`` move the next ones' optimizer side and parameter shard to the host. With
    a ``device_budget`` it evicts idle gathered chunks, furthest next use first, and prefetches
    ``max_prefetch`` chunks ahead."""

    def __init__(self, config: StaticPlacementConfig) -> None:
        super().__init__(
            config.max_prefetch,
            None if config.device_budget is None else int(config.device_budget),
            None if config.host_budget is None else int(config.host_budget),
        )
        self._config = config

    @property
    def config(self) -> StaticPlacementConfig:
        return self._config

    def _decide_layout(self, working_sets: Sequence[WorkingSet]) -> Layout:
        layout = self._layout_with_disk(self._config.offload_disk_frac)
        fix = "offload more to disk (offload_disk_frac) or to the device"
        if self._host_budget is not None and self.host_need(layout) > self._host_budget:
            fix = self._disk_fix() or fix
        self._check_host_budget(layout, fix)
        return layout

    def _layout_with_disk(self, disk_fraction: float, param_fraction: float | None = None) -> Layout:
        """The layout with ``disk_fraction`` of chunk memory's optimizer sides on disk, and
        ``param_fraction`` (default: the config's) of its parameter shards."""
        specs = self._specs
        keep = _first_fraction(specs, 1.0 - self._config.shard_param_frac)
        sharded = [s for s in specs if s.chunk_id not in keep]
        total = sum(s.gathered_bytes for s in specs)
        # Fractions are of all chunk memory; only sharded chunks can be offloaded.
        optim_frac = min(1.0, self._config.offload_optim_frac * total / max(1, sum(s.gathered_bytes for s in sharded)))
        offload_optim = _first_fraction(sharded, optim_frac)
        offload_param = _first_fraction(specs, self._config.offload_param_frac) & offload_optim
        offloaded = [s for s in sharded if s.chunk_id in offload_optim]
        disk_frac = min(1.0, disk_fraction * total / max(1, sum(s.gathered_bytes for s in offloaded)))
        on_disk = _first_fraction(offloaded, disk_frac) if disk_fraction > 0 else set()
        eligible = [s for s in offloaded if s.chunk_id in on_disk and s.chunk_id in offload_param]
        fraction = self._config.offload_param_disk_frac if param_fraction is None else param_fraction
        param_disk = self._param_disk(eligible, fraction)
        placements = []
        for spec in specs:
            chunk = spec.chunk_id
            if chunk not in offload_optim:
                optim = Location.DEVICE
            else:
                optim = Location.DISK if chunk in on_disk else Location.HOST
            if optim is Location.DEVICE or chunk not in offload_param:
                shard = Location.DEVICE
            else:
                shard = Location.DISK if chunk in param_disk else Location.HOST
            placements.append(ChunkPlacement(optim, shard, keep_gathered=chunk in keep))
        return Layout(tuple(placements))

    def _param_disk(self, eligible: Sequence[ChunkSpec], fraction: float) -> set[int]:
        """The chunks whose parameter shard goes to disk: ``fraction`` of chunk memory among
        ``eligible`` (optimizer side on disk, parameter shard offloaded), frozen ones first (never
        written back), then in chunk order."""
        if fraction == 0:
            return set()
        total = sum(s.gathered_bytes for s in self._specs)
        frac = min(1.0, fraction * total / max(1, sum(s.gathered_bytes for s in eligible)))
        return _first_fraction(sorted(eligible, key=lambda s: s.trainable), frac)

    def _disk_fix(self) -> str | None:
        """The smallest ``offload_disk_frac`` (in hundredths, up to ``offload_optim_frac``) whose
        layout fits the host budget, said as the fix; failing that, with every offloaded side on
        disk, the smallest ``offload_param_disk_frac`` (up to ``offload_param_frac``) that does;
        ``None`` when even that does not fit."""
        config = self._config
        most = config.offload_optim_frac
        for hundredths in range(int(config.offload_disk_frac * 100) + 1, int(most * 100) + 2):
            fraction = min(most, hundredths / 100)
            fix = self._fix_if_fits(self._layout_with_disk(fraction), f"offload_disk_frac={fraction:g}")
            if fix is not None:
                return fix
        most_param = min(most, config.offload_param_frac)
        for hundredths in range(int(config.offload_param_disk_frac * 100) + 1, int(most_param * 100) + 2):
            fraction = min(most_param, hundredths / 100)
            fields = f"offload_disk_frac={most:g}, offload_param_disk_frac={fraction:g}"
            fix = self._fix_if_fits(self._layout_with_disk(most, fraction), fields)
            if fix is not None:
                return fix
        return None

    def _fix_if_fits(self, layout: Layout, fields: str) -> str | None:
        """``layout`` (set by ``fields``) said as the fix when it fits the host budget."""
        budget = self._host_budget
        assert budget is not None, "only asked under a host budget"
        if self.host_need(layout) > budget:
            return None
        return (
            f"or set {fields} and ChunkPlugin(disk_dir=...) to put {format_bytes(layout.disk_bytes(self._specs))} "
            f"on disk (host memory then {format_bytes(self.host_need(layout))})"
        )

    def after_op(self, snap: ReleaseSnapshot) -> tuple[int, ...]:
        """Release a chunk once no op of the current pass uses it again (so it is gathered once
        per pass), except chunks kept gathered and those the next pass of the iteration starts
        with. While recording there is no future to consult, and gathering a chunk again costs a
        read (from disk, too) or a collective: under a device budget keep every chunk until an op
        needs its room (``before_op`` evicts the least recently used, as the auto policy does), so
        a chunk is gathered once per step while the budget holds the model; without a budget keep
        the ``RECORDING_WINDOW`` used last (``_beyond_window``). During recomputation keep
        everything: its backward comes next and needs the same chunks."""
        trace = snap.trace
        if trace is None:
            recomputing = snap.phase is Phase.FORWARD and snap.in_backward
            return () if recomputing or self._budget is not None else self._beyond_window(snap)
        layout = self.layout_decided
        finished = [c for c in snap.finished if not layout[c].keep_gathered]
        return tuple(c for c in finished if not self._needed_soon(trace, c, snap.position))

    def _beyond_window(self, snap: ReleaseSnapshot) -> tuple[int, ...]:
        """While recording without a budget: the idle gathered chunks other than the
        ``RECORDING_WINDOW`` used last (ties, the chunks of one op, by chunk id so that every rank
        agrees). Consecutive ops mostly share chunks, so a chunk is gathered (read from disk,
        all-gathered) about once per pass instead of once per op, for a few chunks' memory."""
        layout = self.layout_decided
        idle = [
            r
            for r in snap.residency.buffers()
            if r.kind is BufferKind.GATHERED and not r.held and not r.fetching and not layout[r.chunk_id].keep_gathered
        ]
        idle.sort(key=lambda r: (-r.last_use, r.chunk_id))
        return tuple(r.chunk_id for r in idle[RECORDING_WINDOW:])

    def _needed_soon(self, trace: ComputeTrace, chunk_id: int, position: int) -> bool:
        """Used again in this pass, or among the first ``1 + max_prefetch`` chunks the next pass
        of the same iteration enters: its first op and prefetches would gather those right back
        (nothing changes the parameters in between: the optimizer step ends the iteration). FSDP2
        likewise keeps the root's parameters from forward into backward."""
        nxt = trace.next_use(chunk_id, position)
        if nxt is None:
            return False
        here = trace.pass_of(position)
        if trace.pass_of(nxt) == here:
            return True
        rank = trace.entry_rank(chunk_id, nxt)
        return trace.pass_of(nxt) == here + 1 and rank is not None and rank <= self.max_prefetch
