"""The auto policy: chunks stay gathered on the device while model data fits under the cap at the
current trace position; when it does not, the chunk needed furthest in the future goes first."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from .config import AutoPlacementConfig
from .places import Location
from .policy import PlacementPolicy, format_bytes
from .snapshot import ChunkPlacement, ChunkSpec, Layout, ReleaseSnapshot, WorkingSet
from .trace import ComputeTrace

__all__ = ["AutoPolicy"]

log = logging.getLogger("chunkmem")


class AutoPolicy(PlacementPolicy):
    """Caps model data at ``min(device_budget, capacity * steady_device_cap_ratio - non-model data
    at that position)`` once warmup has measured non-model data (before that, at
    ``capacity * (1 - warmup_non_model_data_ratio)``); the budget part is a guarantee, the capacity
    part a best effort. Optimizer sides go to the device, in chunk order, while what stays there
    between uses leaves room for the largest working set and ``max_prefetch`` chunks."""

    def __init__(self, config: AutoPlacementConfig, device_capacity: int | None) -> None:
        if device_capacity is None or device_capacity <= 0:
            raise ValueError(
                f"AutoPolicy: device_capacity must be a positive byte count, got {device_capacity}; "
                "pass what the process may use of the compute device (chunkmem.usage.memory.process_capacity())"
            )
        super().__init__(
            config.max_prefetch,
            None if config.device_budget is None else int(config.device_budget),
            None if config.host_budget is None else int(config.host_budget),
        )
        self._config = config
        limit = config.total_limit
        self._capacity = device_capacity if limit is None else min(device_capacity, int(limit))
        self._profile_digest: int | None = None
        self._non_model: tuple[int, ...] = ()
        self._warned = False

    @property
    def capacity(self) -> int:
        """Device bytes the caps are derived from (what the process may use, within total_limit)."""
        return self._capacity

    @property
    def config(self) -> AutoPlacementConfig:
        return self._config

    def _warmup_cap(self) -> int:
        ratio = 1.0 - self._config.warmup_non_model_data_ratio
        cap = int(self._capacity * ratio)
        budget = self._hard_cap()
        if budget is not None and self._covers_activations and not self.activations_planned:
            # Activations are under the budget too, and not planned yet: leave them the share of
            # the budget the ratio says (the layout's optimizer sides stay on the host until then),
            # and at least what the measuring step reserved for its fetches.
            assert self._budget is not None, "a hard cap comes from a budget"
            budget = min(budget, int(self._budget * ratio))
        return cap if budget is None else min(cap, budget)

    def needs_profile(self, trace: ComputeTrace | None) -> bool:
        """Until non-model memory has been measured for the frozen trace."""
        return not self.profiled(trace)

    def observe_profile(self, trace: ComputeTrace, non_model_bytes: Sequence[int]) -> None:
        """Non-model bytes measured at each position of ``trace`` (see ``observe_warmup``)."""
        self.observe_warmup(trace, non_model_bytes)

    def observe_warmup(self, trace: ComputeTrace, non_model_bytes: Sequence[int]) -> None:
        """Non-model bytes measured at each position of ``trace`` (the maximum over ranks)."""
        if len(non_model_bytes) != len(trace):
            raise ValueError(f"observe_warmup: {len(non_model_bytes)} samples for a trace of {len(trace)} positions")
        self._profile_digest = trace.digest
        self._non_model = tuple(int(b) for b in non_model_bytes)
        steady = int(self._capacity * self._config.steady_device_cap_ratio)
        peak = max(self._non_model, default=0)
        if self._budget is not None and self._budget + peak > steady and not self._warned:
            self._warned = True
            log.warning(
                "chunkmem: device_budget=%s plus the %s of non-model data (activations, temporaries) measured at "
                "the peak is more than the %s this process may use (steady_device_cap_ratio of %s capacity): model "
                "data is kept under %s where non-model data peaks, below the budget",
                format_bytes(self._budget),
                format_bytes(peak),
                format_bytes(steady),
                format_bytes(self._capacity),
                format_bytes(max(0, steady - peak)),
            )

    @property
    def non_model_profile(self) -> tuple[int, ...]:
        """Non-model bytes per trace position, as measured in warmup (empty before)."""
        return self._non_model

    def profiled(self, trace: ComputeTrace | None) -> bool:
        """Whether non-model data has been measured for ``trace``."""
        return trace is not None and trace.digest == self._profile_digest

    def cap(self, position: int, trace: ComputeTrace | None) -> int | None:
        """The hard budget, lowered by measured non-model data once warmup has profiled ``trace``."""
        if trace is None or trace.digest != self._profile_digest or not 0 <= position < len(self._non_model):
            return self._warmup_cap()
        # This position's non-model data and the next one's: an allocation made now must still fit
        # while the next op runs.
        nxt = min(position + 1, len(self._non_model) - 1)
        non_model = max(self._non_model[position], self._non_model[nxt])
        cap = max(0, int(self._capacity * self._config.steady_device_cap_ratio) - non_model)
        budget = self._hard_cap()
        return cap if budget is None else min(cap, budget)

    def _decide_layout(self, working_sets: Sequence[WorkingSet]) -> Layout:
        """The device layout (``_device_layout``), then, under a host budget, optimizer sides left
        on the host go to disk while the host holds too much: frozen chunks first (the optimizer
        never reads them), then trainable ones from the last (every trainable chunk is read once a
        step). When every such side is on disk and the host still holds too much, their parameter
        shards follow, in the same order. Everything on disk that still does not fit is refused with
        the minimum."""
        layout = self._device_layout(working_sets)
        if self._host_budget is None or self.host_need(layout) <= self._host_budget:
            return layout
        placements = list(layout.placements)
        order = [s for s in self._specs if not s.trainable] + [s for s in reversed(self._specs) if s.trainable]
        fits = self._spill(placements, order, sides=True)
        if not fits:
            self._spill(placements, order, sides=False)
        layout = Layout(tuple(placements))
        self._check_host_budget(layout, "or give the device more of the model (device_budget)")
        return layout

    def _spill(self, placements: list[ChunkPlacement], order: Sequence[ChunkSpec], sides: bool) -> bool:
        """Move to disk, in ``order``, optimizer sides left on the host (``sides``), or the parameter
        shards of chunks whose side is on disk, until the host budget holds the layout. Returns
        whether it does."""
        budget = self._host_budget
        assert budget is not None, "only spilled under a host budget"
        for spec in order:
            place = placements[spec.chunk_id]
            if sides:
                if place.optim is not Location.HOST or spec.disk_side_bytes == 0:
                    continue
                moved = dataclasses.replace(place, optim=Location.DISK)
            else:
                if place.optim is not Location.DISK or place.shard is not Location.HOST:
                    continue
                moved = dataclasses.replace(place, shard=Location.DISK)
            placements[spec.chunk_id] = moved
            if self.host_need(Layout(tuple(placements))) <= budget:
                return True
        return False

    def _device_layout(self, working_sets: Sequence[WorkingSet]) -> Layout:
        """Everything on the device when it fits. Otherwise greedy, in chunk order: a chunk's
        optimizer side goes to the device when the whole layout still fits the warmup cap with room
        for ``max_prefetch`` of the largest chunks.
        Chunks not decided yet count as on the host, the costlier case for working sets, so each
        check is an upper bound of the final need."""
        specs = self._specs
        host = ChunkPlacement(Location.HOST, Location.HOST)
        device = ChunkPlacement(Location.DEVICE, Location.DEVICE)
        everything = Layout(tuple(device for _ in specs))
        # Prefetch needs room for what a gather allocates: nothing when every chunk's device master
        # is the gathered chunk itself (world size 1, fp32).
        fetched = max((device.fetch_bytes(s) for s in specs), default=0)
        accumulate = self._accumulate
        if self.minimum_budget(everything, working_sets, accumulate).minimum + self._max_prefetch * fetched <= (
            self._warmup_cap()
        ):
            return everything
        headroom = self._max_prefetch * max((s.gathered_bytes for s in specs), default=0)
        cap = self._warmup_cap() - headroom
        placements = [host] * len(specs)
        for spec in specs:
            placements[spec.chunk_id] = device
            if self.minimum_budget(Layout(tuple(placements)), working_sets, accumulate).minimum > cap:
                placements[spec.chunk_id] = host
        return Layout(tuple(placements))

    def after_op(self, snap: ReleaseSnapshot) -> tuple[int, ...]:
        """Nothing: gathered chunks stay as a cache until ``before_op`` needs their room."""
        # Gathered chunks stay as a cache; before_op evicts them when the cap requires it.
        return ()
