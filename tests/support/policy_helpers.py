"""Shared builders for the placement-policy tests (``test_policy.py`` and
``test_policy_optimality.py``): equal-size chunk specs and catalogs, traces and per-op working
sets, ``ResidentChunk`` entries for hand-made snapshots, and short constructors for the auto and
static policies, with the byte constants they default to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkmem.placement import (
    AutoPlacementConfig,
    AutoPolicy,
    BufferKind,
    ChunkSpec,
    ComputeTrace,
    Phase,
    ResidentChunk,
    StaticPlacementConfig,
    StaticPolicy,
    TraceStep,
    WorkingSet,
)

S = 1000
"""Gathered bytes of one (equal-size) chunk."""
OPTIM = 37
SHARD = 11
HUGE_CAPACITY = 1 << 50
"""A device so large that the auto policy's capacity-derived cap never binds: the budget does."""

F, B = Phase.FORWARD, Phase.BACKWARD


def spec(
    chunk_id: int, *, size: int = S, grad: int = 0, optim: int = OPTIM, shard: int = SHARD, label: str | None = None
) -> ChunkSpec:
    return ChunkSpec(
        chunk_id=chunk_id,
        label=label or f"block{chunk_id}",
        trainable=grad > 0,
        gathered_bytes=size,
        grad_bytes=grad,
        optim_side_bytes=optim,
        shard_copy_bytes=shard,
        gathered_is_shard=False,
        master_is_compute=False,
    )


def catalog(n: int, **kwargs: Any) -> tuple[ChunkSpec, ...]:
    return tuple(spec(i, **kwargs) for i in range(n))


def trace_of(steps: Sequence[tuple[Phase, Sequence[int]]]) -> ComputeTrace:
    return ComputeTrace([TraceStep(phase, tuple(chunks)) for phase, chunks in steps])


def op_working_sets(trace: ComputeTrace) -> list[WorkingSet]:
    return [WorkingSet(f"op{i}", step.chunks) for i, step in enumerate(trace.steps)]


def auto(budget: int | None, max_prefetch: int = 0, capacity: int = HUGE_CAPACITY, **kwargs: Any) -> AutoPolicy:
    return AutoPolicy(AutoPlacementConfig(device_budget=budget, max_prefetch=max_prefetch, **kwargs), capacity)


def static(budget: int | None, max_prefetch: int = 0, **kwargs: Any) -> StaticPolicy:
    return StaticPolicy(StaticPlacementConfig(device_budget=budget, max_prefetch=max_prefetch, **kwargs))


def resident(chunk_id: int, *, kind: BufferKind = BufferKind.GATHERED, nbytes: int = S, **kwargs: Any) -> ResidentChunk:
    fields: dict[str, Any] = {"held": False, "fetching": False, "last_use": -1}
    fields.update(kwargs)
    return ResidentChunk(chunk_id=chunk_id, kind=kind, release_bytes=nbytes, **fields)
