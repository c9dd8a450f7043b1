"""What ``chunkmem.plan`` reports: each planned step's counters, and the plan (a table for people,
a dict for JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkmem.placement import (
    ActivationChoice,
    ActivationPlan,
    BlockMeasure,
    BlockPlacement,
    CopyRates,
    choose_activations,
    disk_bytes_per_call,
)
from chunkmem.placement.policy import format_bytes

from ..activations.forecast import BlockForecast
from ..usage.stats import Stats
from .plan_fixes import PlanFix

__all__ = ["Plan", "StepCounters", "format_count"]


def format_count(n: int) -> str:
    """A count for people: 5.8M, 1.2B, 124M, 950."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


@dataclass(frozen=True)
class StepCounters:
    """What one training step did (differences of ``Stats`` over the step)."""

    gathers: int
    prefetches: int
    evictions: int
    h2d_bytes: int
    d2h_bytes: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    peak_device_bytes: int
    """Highest accounted device bytes during the step."""
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_param_read_bytes: int = 0
    """Of ``disk_read_bytes``, parameter shards read for gathers."""
    disk_param_write_bytes: int = 0
    """Of ``disk_write_bytes``, parameter shards written after the step changed them."""
    disk_param_forward_read_bytes: int = 0
    """Of ``disk_param_read_bytes``, those read while the forward passes ran (the rest were read in
    the backward passes). Set by the planner, which runs the passes; 0 from ``between``."""
    peak_host_bytes: int = 0
    """Highest accounted host bytes during the step."""

    @classmethod
    def between(cls, before: Stats, after: Stats, peak: int, peak_host: int = 0) -> StepCounters:
        return cls(
            gathers=after.gathers - before.gathers,
            prefetches=after.prefetches - before.prefetches,
            evictions=after.evictions - before.evictions,
            h2d_bytes=after.h2d_bytes - before.h2d_bytes,
            d2h_bytes=after.d2h_bytes - before.d2h_bytes,
            allgather_bytes=after.allgather_bytes - before.allgather_bytes,
            reduce_scatter_bytes=after.reduce_scatter_bytes - before.reduce_scatter_bytes,
            peak_device_bytes=peak,
            disk_read_bytes=after.disk_read_bytes - before.disk_read_bytes,
            disk_write_bytes=after.disk_write_bytes - before.disk_write_bytes,
            disk_param_read_bytes=after.disk_param_read_bytes - before.disk_param_read_bytes,
            disk_param_write_bytes=after.disk_param_write_bytes - before.disk_param_write_bytes,
            peak_host_bytes=peak_host,
        )


@dataclass(frozen=True)
class Plan:
    """The prediction for one rank (every rank makes the same decisions). Per-step figures are
    those of the last planned step, after the trace is recorded and the policy has settled."""

    fits: bool
    """Training runs within ``device_budget`` (and within ``device_capacity``)."""
    why_not: str
    """When it does not fit, the refusal chunkmem would raise."""
    world_size: int
    device_budget: int | None
    device_capacity: int
    min_device_budget: int
    """The smallest budget a real run accepts for this placement (placement and one op's
    working set, raised where ops overlap, e.g. activation-checkpointing recomputation)."""
    peak_device_bytes: int
    """Highest accounted chunk bytes on the device in a step (the budget's measure)."""
    non_model_bytes: int
    """Peak activations saved for backward, as measured in the first step."""
    host_bytes_per_rank: int
    """Chunk bytes in host memory on each rank between steps (fp32 masters, gradient shards,
    optimizer states kept there, and with 16-bit compute the 16-bit copies gathers read)."""
    peak_host_bytes: int
    """Highest accounted chunk bytes in host memory in a step (the host budget's measure)."""
    min_host_budget: int
    """The host budget this placement needs (what stays in host memory, and the buffers chunks on
    disk are stepped in)."""
    disk_bytes_per_rank: int
    """Bytes each rank keeps on disk (optimizer sides of the disk tier)."""
    disk_read_bytes_per_step: int
    disk_write_bytes_per_step: int
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    allgather_bytes_per_step: int
    reduce_scatter_bytes_per_step: int
    gathers_per_step: int
    prefetches_per_step: int
    chunks: int
    chunk_size: int
    parameters: int
    grad_accum: int
    """Micro-batches per optimizer step (all but the last under ``no_sync``)."""
    bandwidth: float
    """Host-device bytes per second assumed for ``transfer_seconds_per_step``."""
    disk_bandwidth: float
    """Disk bytes per second (reads and writes alike) assumed for ``disk_seconds_per_step``."""
    steps: tuple[StepCounters, ...]
    """Every planned step, the recording one first."""
    activation_calls: tuple[BlockForecast, ...] = ()
    """Each call of the blocks ``ActivationPlacement`` names in one forward (one micro-batch), in
    forward order: how it is placed and the bytes autograd saves in it (``chunkmem.activations.forecast``)."""
    repeated_block: str | None = None
    """The block class ``RepeatedBlocks()`` found (its instances and share of the parameters), which
    ``activation_calls`` are the calls of; ``None`` when every block is named."""
    fixes: tuple[PlanFix, ...] = ()
    """When it does not fit, what would make it fit, the first first (``why_not`` says them too)."""
    activation_min_device_budget: int | None = None
    """With ``auto`` blocks, the smallest ``device_budget`` their plan accepts at this budget's layout:
    what the placement of model data needs plus the largest ``auto`` call's saved bytes (below it a run
    raises ``BudgetTooSmallError`` with this ``minimum`` at its second training forward)."""
    model_need_bytes: int = 0
    """What the placement of model data needs on the device at least (``placement_need().minimum``):
    the ``model_bytes`` the ``auto`` choice is made with."""
    activation_max_prefetch: int = 0
    """``ActivationPlacement.max_prefetch``: the most offloaded calls the ``auto`` choice fetches ahead."""
    activation_host_budget: int | None = None
    """``ActivationPlacement.host_budget``: the host memory offloaded calls' copies take at most."""

    def _calls(self, how: BlockPlacement) -> list[BlockForecast]:
        return [c for c in self.activation_calls if c.how is how]

    @property
    def activation_d2h_bytes_per_step(self) -> int:
        """What the ``offload`` blocks and the stretches outside the blocks (``offload_outside``)
        copy to the host per step (``Stats.activation_d2h_bytes``); ``auto`` calls add their
        ``offload_bytes`` in the first step (all offloaded while measured), afterwards as their
        choice says (``auto_choice``)."""
        offloaded = (*self._calls(BlockPlacement.OFFLOAD), *self._calls(BlockPlacement.OUTSIDE))
        return self.grad_accum * sum(c.offload_bytes for c in offloaded)

    @property
    def activation_h2d_bytes_per_step(self) -> int:
        """What the ``offload`` blocks copy back to the device per step (``Stats.activation_h2d_bytes``:
        every copy out comes back before its backward)."""
        return self.activation_d2h_bytes_per_step

    @property
    def activation_disk_write_bytes_per_step(self) -> int:
        """Of those copies, what goes on to the disk tier per step, beyond ``ActivationPlacement.host_budget``
        (``Stats.activation_disk_write_bytes``); read back the same (``activation_disk_read_bytes``). With
        ``auto`` blocks, a step whose forwards are like the first (every ``auto`` call offloaded); a
        forward under the ``auto`` choice: ``activation_disk_bytes_per_forward(choice)``."""
        return self.grad_accum * self.activation_disk_bytes_per_forward()

    def activation_disk_bytes_per_forward(self, choice: ActivationPlan | None = None) -> int:
        """What one training forward writes to the disk tier (and its backward reads back), beyond
        ``ActivationPlacement.host_budget``: the ``offload`` blocks' copies and those of the ``auto``
        calls ``choice`` offloads (``None``: every ``auto`` call, as in the first training forward),
        by the runtime's rule (``placement.disk_bytes_per_call``, in the order saved)."""
        if self.activation_host_budget is None:
            return 0
        offloaded, held, auto = [], [], 0
        for call in self.activation_calls:
            if call.how is BlockPlacement.AUTO:
                chosen = choice.choice(auto) if choice is not None else ActivationChoice.OFFLOAD
                auto += 1
                if chosen is ActivationChoice.OFFLOAD:
                    offloaded.append(call.copied)
                    held.append(call.held or call.copied)
            elif call.how in (BlockPlacement.OFFLOAD, BlockPlacement.OUTSIDE):
                offloaded.append(call.copied)
                held.append(call.held or call.copied)
        return sum(disk_bytes_per_call(offloaded, self.activation_host_budget, held))

    @property
    def activation_disk_read_bytes_per_step(self) -> int:
        """What the ``offload`` blocks read back from the disk tier per step (``Stats.activation_disk_read_bytes``)."""
        return self.activation_disk_write_bytes_per_step

    @property
    def recomputed_blocks_per_step(self) -> int:
        """Calls of ``recompute`` blocks recomputed per step (``Stats.recomputed_blocks``)."""
        return self.grad_accum * len(self._calls(BlockPlacement.RECOMPUTE))

    @property
    def auto_saved_bytes(self) -> int:
        """The ``auto`` calls' saved bytes of one forward, all kept (what the budget would need beyond
        model data and one call's reserve to keep every call)."""
        return sum(c.saved_bytes for c in self._calls(BlockPlacement.AUTO))

    def auto_choice(self, forward_seconds: Sequence[float], rates: CopyRates) -> ActivationPlan:
        """The choice ``choose_activations`` makes for the ``auto`` calls at ``device_budget``, from
        their planned saved bytes and the timings a meta run cannot know: each call's forward time
        (in forward order) and the copy rates, as measured on the device (the first step of a run
        measures them, and the offloads' own host time, taken as 0 here), with how many offloaded
        calls it fetches ahead (up to ``activation_max_prefetch``) and the room that takes
        (``ActivationPlan.prefetch`` and ``reserve``). ``BudgetTooSmallError`` below
        ``activation_min_device_budget``."""
        calls = self._calls(BlockPlacement.AUTO)
        if len(forward_seconds) != len(calls):
            raise ValueError(f"auto_choice: {len(calls)} auto calls are planned, got {len(forward_seconds)} times")
        if self.device_budget is None:
            raise ValueError("auto_choice: auto blocks are placed under a device_budget; the plan has none")
        times = iter(forward_seconds)
        # With offload_outside the stretches outside the blocks are calls of the plan, always offloaded.
        measures = [
            BlockMeasure(
                c.name,
                c.saved_bytes,
                0.0 if c.how is BlockPlacement.OUTSIDE else next(times),
                small_bytes=c.small_bytes,
                outside=c.how is BlockPlacement.OUTSIDE,
            )
            for c in self.activation_calls
            if c.how in (BlockPlacement.AUTO, BlockPlacement.OUTSIDE)
        ]
        return choose_activations(
            measures, rates, self.device_budget, self.model_need_bytes, self.activation_max_prefetch
        )

    @property
    def transfer_seconds_per_step(self) -> float:
        """Host-device transfer time per step at ``bandwidth`` (both directions serialised)."""
        return (self.h2d_bytes_per_step + self.d2h_bytes_per_step) / self.bandwidth

    @property
    def disk_seconds_per_step(self) -> float:
        """Disk time per step at ``disk_bandwidth`` (reads and writes serialised)."""
        return (self.disk_read_bytes_per_step + self.disk_write_bytes_per_step) / self.disk_bandwidth

    @property
    def disk_param_read_bytes_per_step(self) -> int:
        """Of ``disk_read_bytes_per_step``, the parameter shards gathers read from disk."""
        return self.steps[-1].disk_param_read_bytes if self.steps else 0

    @property
    def disk_param_forward_read_bytes_per_step(self) -> int:
        """Of ``disk_param_read_bytes_per_step``, those read in the forward (the rest in the backward)."""
        return self.steps[-1].disk_param_forward_read_bytes if self.steps else 0

    @property
    def disk_param_write_bytes_per_step(self) -> int:
        """Of ``disk_write_bytes_per_step``, the parameter shards the step wrote."""
        return self.steps[-1].disk_param_write_bytes if self.steps else 0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for call in out["activation_calls"]:
            call["how"] = call["how"].value
        for fix in out["fixes"]:
            fix["kind"] = fix["kind"].value
        out["transfer_seconds_per_step"] = self.transfer_seconds_per_step
        out["disk_seconds_per_step"] = self.disk_seconds_per_step
        for name in (
            "disk_param_read_bytes_per_step",
            "disk_param_forward_read_bytes_per_step",
            "disk_param_write_bytes_per_step",
            "activation_d2h_bytes_per_step",
            "activation_h2d_bytes_per_step",
            "activation_disk_write_bytes_per_step",
            "activation_disk_read_bytes_per_step",
            "recomputed_blocks_per_step",
            "auto_saved_bytes",
        ):
            out[name] = getattr(self, name)
        return out

    def table(self) -> str:
        """A table for people."""
        rows = [
            ("fits", "yes" if self.fits else f"no: {self.why_not}"),
            ("world size", str(self.world_size)),
            (
                "parameters",
                f"{format_count(self.parameters)} ({self.parameters:,}) in {self.chunks} chunks of "
                f"{self.chunk_size:,} elements",
            ),
            (
                "micro-batches per step",
                f"{self.grad_accum}" + (" (no_sync for all but the last)" * (self.grad_accum > 1)),
            ),
            ("device budget", "none" if self.device_budget is None else format_bytes(self.device_budget)),
            ("device capacity", format_bytes(self.device_capacity)),
            ("minimum device budget", format_bytes(self.min_device_budget)),
            ("peak device bytes (chunks)", format_bytes(self.peak_device_bytes)),
            ("activations (non-model) peak", format_bytes(self.non_model_bytes)),
            ("host bytes per rank", format_bytes(self.host_bytes_per_rank)),
            ("peak host bytes (chunks)", format_bytes(self.peak_host_bytes)),
            ("minimum host budget", format_bytes(self.min_host_budget)),
            ("disk bytes per rank", format_bytes(self.disk_bytes_per_rank)),
            (
                "disk read + write per step",
                f"{format_bytes(self.disk_read_bytes_per_step)} + {format_bytes(self.disk_write_bytes_per_step)}",
            ),
            (
                "of which parameter shards",
                f"{format_bytes(self.disk_param_read_bytes_per_step)} (forward "
                f"{format_bytes(self.disk_param_forward_read_bytes_per_step)}) + "
                f"{format_bytes(self.disk_param_write_bytes_per_step)}",
            ),
            ("host-to-device per step", format_bytes(self.h2d_bytes_per_step)),
            ("device-to-host per step", format_bytes(self.d2h_bytes_per_step)),
            ("all-gather per step", format_bytes(self.allgather_bytes_per_step)),
            ("reduce-scatter per step", format_bytes(self.reduce_scatter_bytes_per_step)),
            ("gathers + prefetches per step", f"{self.gathers_per_step} + {self.prefetches_per_step}"),
            (
                "transfer time per step",
                f"{self.transfer_seconds_per_step:.3f} s at {self.bandwidth / 1e9:.0f} GB/s host-device",
            ),
            (
                "disk time per step",
                f"{self.disk_seconds_per_step:.3f} s at {self.disk_bandwidth / 1e9:.1f} GB/s",
            ),
        ]
        rows += self._activation_rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _activation_rows(self) -> list[tuple[str, str]]:
        """Per named block call, its placement and saved bytes; the static placements' per-step
        figures; the ``auto`` minimum."""
        rows = []
        if self.repeated_block is not None:
            rows.append(("repeated block (RepeatedBlocks)", self.repeated_block))
        for group in _runs(self.activation_calls):
            first, n = group[0], len(group)
            name = f"block {first.name}" if n == 1 else f"blocks {first.name} .. {group[-1].name} ({n} calls)"
            if first.how is BlockPlacement.OUTSIDE:
                name = first.name if n == 1 else f"{first.name} .. {group[-1].name}"
            copies = f", copies {format_bytes(first.offload_bytes)}" * (first.how is not BlockPlacement.RECOMPUTE)
            rows.append(
                (f"{name}, {first.how.value}", f"{'each ' * (n > 1)}saves {format_bytes(first.saved_bytes)}{copies}")
            )
        if self._calls(BlockPlacement.OFFLOAD) or self._calls(BlockPlacement.OUTSIDE):
            rows.append(
                (
                    "activations d2h + h2d per step",
                    f"{format_bytes(self.activation_d2h_bytes_per_step)} + "
                    f"{format_bytes(self.activation_h2d_bytes_per_step)}",
                )
            )
            if self.activation_disk_write_bytes_per_step:
                rows.append(
                    ("activations to disk and back per step", format_bytes(self.activation_disk_write_bytes_per_step))
                )
        if self._calls(BlockPlacement.RECOMPUTE):
            rows.append(("recomputed blocks per step", str(self.recomputed_blocks_per_step)))
        if self.activation_min_device_budget is not None:
            rows.append(("minimum budget with auto blocks", format_bytes(self.activation_min_device_budget)))
        return rows


def _runs(calls: Sequence[BlockForecast]) -> list[list[BlockForecast]]:
    """Consecutive calls placed alike that save alike (a model's repeated layers: one row)."""
    runs: list[list[BlockForecast]] = []
    for call in calls:
        last = runs[-1][-1] if runs else None
        if last is not None and (last.how, last.saved_bytes, last.offload_bytes) == (
            call.how,
            call.saved_bytes,
            call.offload_bytes,
        ):
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs
