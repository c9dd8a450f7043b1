"""The training runs of the memory-budget experiment, as commands for its rank processes.

Each row of the experiment is one run: plain PyTorch (DDP at world size > 1) or chunkmem with a
placement config. Every run starts from the same base model (built once per process from a seed) and
trains on the same tokens, so every row's loss must equal plain PyTorch's. The commands run in this
process at world size 1 (``LocalRanks``) or in forked ranks (``RankPool``); a run keeps its model
in the rank's ``state`` between commands, so runs can be interleaved step by step.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from benchmarks.common import (
    DTYPES,
    GPT2Shape,
    gpt2_model,
    is_out_of_memory,
    rank_batch,
    release_memory,
    synchronize,
)
from benchmarks.workers import RankContext

__all__ = [
    "STATIC_LADDER",
    "BudgetSetup",
    "RowSpec",
    "build_row",
    "finish_row",
    "prepare",
    "row_steps",
    "static_minimums",
]

# Offload settings the static policy tries, least offloaded first: (offload_optim_frac, offload_param_frac).
STATIC_LADDER: tuple[tuple[float, float], ...] = (*((optim / 10, 0.0) for optim in range(11)), (1.0, 0.5), (1.0, 1.0))


@dataclass(frozen=True)
class BudgetSetup:
    """The model, data and optimizer every row shares."""

    shape: GPT2Shape
    batch: int
    """Sequences per rank per step."""
    precision: str
    chunk_size: int | None
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    data_seed: int = 1

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def plugin(self, placement: Any) -> Any:
        from chunkmem import ChunkPlugin

        return ChunkPlugin(placement=placement, precision=self.precision, chunk_size=self.chunk_size)


RowKind = Literal["plain", "chunkmem"]


@dataclass(frozen=True)
class RowSpec:
    """One row: what runs, under which budget."""

    key: str
    kind: RowKind
    policy: str
    """``plain`` / ``ddp`` for the reference, else the placement policy's name."""
    max_prefetch: int = 0
    budget_frac: float | None = None
    budget: int | None = None
    setting: str = ""
    """How the placement was chosen (the static offload fractions that fit, or ``auto``)."""
    placement: Any = None


# --- commands -------------------------------------------------------------------------------------
def prepare(ctx: RankContext, setup: BudgetSetup) -> int:
    """Build the base model this process copies for every run; its parameter count."""
    ctx.state["base"] = gpt2_model(
        setup.shape.layers, setup.shape.width, setup.shape.vocab, setup.shape.seq, setup.seed
    )
    ctx.state.setdefault("runs", {})
    return sum(p.numel() for p in ctx.state["base"].parameters())


def static_minimums(ctx: RankContext, setup: BudgetSetup) -> list[int]:
    """The smallest device budget the static placement accepts for each ``STATIC_LADDER`` setting.

    Asked by offering one byte: chunkmem refuses before it touches the model, and the refusal
    carries the minimum, so the base model is used as it is (no copy per question)."""
    from chunkmem import Booster, BudgetTooSmallError
    from chunkmem.placement import StaticPlacementConfig

    base = ctx.state["base"]
    minimums = []
    for optim_frac, param_frac in STATIC_LADDER:
        config = StaticPlacementConfig(offload_optim_frac=optim_frac, offload_param_frac=param_frac, device_budget=1)
        try:
            Booster(setup.plugin(config)).boost(base, setup.optimizer(base.parameters()))
        except BudgetTooSmallError as error:
            minimums.append(int(error.minimum))
        else:
            raise AssertionError("chunkmem accepted a one-byte device budget")
    return minimums


class TrainingRun:
    """One row's model, optimizer and counters in this rank."""

    def __init__(self, ctx: RankContext, setup: BudgetSetup, spec: RowSpec) -> None:
        self.ctx = ctx
        self.setup = setup
        self.spec = spec
        self.before: Any = None
        model = copy.deepcopy(ctx.state["base"])
        if spec.kind == "plain":
            model = model.to(ctx.device)
            if ctx.world_size > 1:
                from torch.nn.parallel import DistributedDataParallel

                ids = [ctx.device.index] if ctx.device.type == "cuda" else None
                model = DistributedDataParallel(model, device_ids=ids)
            self.model = model
            self.optimizer = setup.optimizer(model.parameters())
            self.booster = None
        else:
            from chunkmem import Booster

            self.booster = Booster(setup.plugin(spec.placement))
            self.model, self.optimizer, *_ = self.booster.boost(model, setup.optimizer(model.parameters()))

    def step(self, ids: torch.Tensor) -> float:
        if self.booster is None:
            dtype = DTYPES[self.setup.precision]
            with torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            loss = self.model(input_ids=ids, labels=ids).loss
            self.booster.backward(loss, self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach().float().item())

    def stats(self) -> Any:
        return None if self.booster is None else self.model.stats()


def build_row(ctx: RankContext, setup: BudgetSetup, spec: RowSpec) -> dict[str, Any]:
    """Build ``spec``'s run in this rank: ``{"state": "ok"}``, or ``refused`` (the budget is below
    what the placement needs) / ``out of memory`` with a note."""
    from chunkmem import BudgetTooSmallError

    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)  # per run when runs go one at a time
    note = None
    try:
        ctx.state["runs"][spec.key] = TrainingRun(ctx, setup, spec)
    except BudgetTooSmallError as error:
        return {"state": "refused", "note": str(error).split(":")[0]}
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        note = f"building: {str(error).splitlines()[0][:120]}"
    if note is not None:
        # Outside the handler: the traceback no longer holds the frames that hold the tensors.
        release_memory(ctx.device)
        return {"state": "out of memory", "note": note}
    return {"state": "ok", "note": ""}


def row_steps(ctx: RankContext, key: str, start: int, count: int) -> list[tuple[float, float]] | dict[str, str]:
    """Steps ``start .. start+count-1`` of run ``key``: (seconds, loss) each, or
    ``{"state": "out of memory"}`` (the run is dropped). Counters for the per-step figures are
    taken after step 0 (the step that records the trace)."""
    run: TrainingRun = ctx.state["runs"][key]
    setup = run.setup
    out = []
    note = None
    try:
        for index in range(start, start + count):
            ids = rank_batch(
                index, ctx.rank, ctx.world_size, setup.batch, setup.shape.seq, setup.shape.vocab, setup.data_seed
            )
            ids = ids.to(ctx.device)
            synchronize(ctx.device)
            began = time.perf_counter()
            loss = run.step(ids)
            synchronize(ctx.device)
            out.append((time.perf_counter() - began, loss))
            if index == 0:
                stats = run.stats()
                run.before = None if stats is None else stats.snapshot()
    except Exception as error:
        del ctx.state["runs"][key]
        if not is_out_of_memory(error):
            raise
        note = f"step {start + len(out)}: {str(error).splitlines()[0][:120]}"
    if note is not None:
        # Outside the handler: the traceback no longer holds the frames that hold the activations.
        del run
        release_memory(ctx.device)
        return {"state": "out of memory", "note": note}
    return out


def chunk_capacities(model: Any) -> list[int]:
    """Elements per chunk of a boosted model (padding included)."""
    return [chunk.layout.capacity for chunk in model.manager.chunks]


def finish_row(ctx: RankContext, key: str, steps_after_warmup: int) -> dict[str, Any]:
    """Per-step byte and fetch counts of run ``key`` since its warmup step, and the chunk layout
    they come from; the run is dropped."""
    run: TrainingRun = ctx.state["runs"].pop(key)
    out: dict[str, Any] = {"device_peak_allocated": None}
    if ctx.device.type == "cuda":
        out["device_peak_allocated"] = int(torch.cuda.max_memory_allocated(ctx.device))
    stats = run.stats()
    if stats is not None and run.before is not None and steps_after_warmup > 0:
        before, n = run.before, steps_after_warmup
        out.update(
            peak_device_bytes=stats.peak_device_bytes,
            h2d_per_step=(stats.h2d_bytes - before.h2d_bytes) / n,
            d2h_per_step=(stats.d2h_bytes - before.d2h_bytes) / n,
            fetches_per_step=(stats.gathers + stats.prefetches - before.gathers - before.prefetches) / n,
            chunk_capacities=chunk_capacities(run.model),
            compute_itemsize=DTYPES[run.setup.precision].itemsize,
            stats=stats.as_dict(),
        )
    del run
    release_memory(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    return out
