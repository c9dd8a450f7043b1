"""One system of the activations benchmark on one model, in a process of its own
(``system_process``): build it, then train each length in turn until one does not fit, measuring
every length the same way. A process a system: what an out-of-memory error leaves behind on the
card (a half-run step's tensors, the allocator's cache) goes with the process, not into the next
system's budget. See ``benchmarks/activations.py`` for what the figures mean.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.activation_systems import SYSTEMS, ModelShape, Recipe, Trainer
from benchmarks.common import fmt_bytes, is_out_of_memory, median, rank_batch, release_memory, synchronize
from benchmarks.saved_meter import SavedMeter, block_saved_bytes

__all__ = ["RunSettings", "headers", "row_cells", "run_system", "system_process"]

STAT_KEYS = (
    "activation_d2h_bytes",
    "activation_h2d_bytes",
    "activation_d2h_seconds",
    "activation_h2d_seconds",
    "recomputed_blocks",
    "h2d_bytes",
    "d2h_bytes",
    "grad_flushes",
    "host_step_seconds",
    "activation_kept_bytes",
    "activation_recomputed_bytes",
)

AUTO_GPU_HEADROOM = 0.25
"""On a GPU, chunkmem-auto's ``device_budget`` is the cap less this share of it: what its ledger
does not account (saved activations outside the blocks, temporaries, the allocator's cache) is not
known before a length runs there."""


MIN_START_S = 25.0
"""On a GPU, a system is not built with fewer seconds than this left before the deadline."""


@dataclass(frozen=True)
class RunSettings:
    """What every system of a run shares."""

    recipe: Recipe
    batch: int
    warmup: int
    steps: int
    deadline: float
    """``time.time()`` after which what is left is skipped."""
    budget: int | None = None
    """CPU: the ledger's device budget in bytes."""
    cap_bytes: int | None = None
    """CUDA: the memory this process may allocate on the card."""
    threads: int | None = None
    """CPU: torch threads."""

    @property
    def cuda(self) -> bool:
        return self.recipe.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.time()


class BlockProbe:
    """Bytes one block call saves when kept, and bytes saved outside the blocks, per length: a
    forward of the plain fp32 model on the CPU (built once) under a block-tagged ``SavedMeter``."""

    def __init__(self, shape: ModelShape, max_seq: int) -> None:
        self._shape = shape
        self._max_seq = max_seq
        self._model: torch.nn.Module | None = None
        self._bytes: dict[tuple[int, int], tuple[int, int]] = {}

    def __call__(self, seq: int, batch: int) -> int:
        """What one block call saves when kept."""
        return self._measure(seq, batch)[0]

    def outside(self, seq: int, batch: int) -> int:
        """What the forward saves outside every block call."""
        return self._measure(seq, batch)[1]

    def _measure(self, seq: int, batch: int) -> tuple[int, int]:
        if (seq, batch) not in self._bytes:
            if self._model is None:
                self._model = self._shape.build(self._max_seq, torch.device("cpu"))
            model = self._model
            ids = rank_batch(0, 0, 1, batch, seq, self._shape.vocab)
            run = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
            self._bytes[seq, batch] = block_saved_bytes(model, self._shape.blocks(model), run)
        return self._bytes[seq, batch]


def measure(trainer: Trainer, shape: ModelShape, seq: int, settings: RunSettings, step_base: int) -> dict[str, Any]:
    """Train ``warmup + steps`` steps at ``seq``: times, losses, the meter's peak, and chunkmem's
    counters per timed step. Raises what the steps raise (out of memory included)."""
    device = settings.recipe.device
    meter = SavedMeter(trainer.meter_parameters)
    if settings.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, peaks = [], [], []
    before = None
    for index in range(settings.warmup + settings.steps):
        if index == settings.warmup and trainer.stats_fn is not None:
            before = trainer.stats_fn()
        ids = rank_batch(step_base + index, 0, 1, settings.batch, seq, shape.vocab).to(device)
        meter.reset_peak()
        synchronize(device)
        began = time.perf_counter()
        with meter.hooks():
            losses.append(trainer.step(ids))
        synchronize(device)
        times.append(time.perf_counter() - began)
        peaks.append(meter.peak)
    timed = times[settings.warmup :]
    out: dict[str, Any] = {
        "step_times_ms": [t * 1e3 for t in timed],
        "step_ms": median(timed) * 1e3,
        "losses": losses,
        "saved_meter_bytes": max(peaks),
        "model_bytes": trainer.model_bytes_fn(),
        "device_peak_allocated": int(torch.cuda.max_memory_allocated(device)) if settings.cuda else None,
    }
    if trainer.stats_fn is not None and before is not None:
        after = trainer.stats_fn()
        per_step = {k: (getattr(after, k) - getattr(before, k)) / settings.steps for k in STAT_KEYS}
        out["chunkmem"] = {**per_step, "peak_device_bytes": after.peak_device_bytes}
    plan = trainer.plan_fn() if trainer.plan_fn is not None else None
    if plan is not None:
        out["activation_plan"] = [choice.value for choice in plan.choices]
        out["activation_reserve"] = plan.reserve
    return out


def ledger(row: dict[str, Any], trainer: Trainer, shape: ModelShape, settings: RunSettings, probe: BlockProbe) -> None:
    """The device bytes the blocks hold beyond the meter, the ledger's total, and whether it is
    within the budget (CPU)."""
    if trainer.activations == "keep":
        extra = 0
    elif trainer.activations == "auto":
        # Kept and offloaded calls are in chunkmem's ledger (its peak, the model data column); a
        # recomputed call's recomputation is not.
        extra = probe(row["seq"], settings.batch) if "recompute" in row.get("activation_plan", ()) else 0
    elif trainer.activations == "offload":
        per_call = row["chunkmem"]["activation_h2d_bytes"] / shape.layers  # one call a block a step
        extra = int((1 + trainer.max_prefetch) * per_call)
    else:
        extra = probe(row["seq"], settings.batch)
    row["blocks_extra_bytes"] = extra
    row["saved_bytes"] = row["saved_meter_bytes"] + extra
    model_bytes = row["model_bytes"]
    row["ledger_bytes"] = None if model_bytes is None else model_bytes + row["saved_bytes"]
    row["fits"] = (
        row["ledger_bytes"] is not None and settings.budget is not None and row["ledger_bytes"] <= settings.budget
    )


def auto_budget(settings: RunSettings, probe: BlockProbe, seq: int, outside_in_ledger: bool = False) -> int:
    """chunkmem-auto's ``device_budget`` at ``seq``: on the CPU the ledger's budget less what the
    benchmark's ledger adds to chunkmem's (the bytes saved outside the blocks, as the probe measures
    them on the plain model; nothing where chunkmem's ledger holds them: ``outside_in_ledger``); on
    a GPU the cap less ``AUTO_GPU_HEADROOM`` of it."""
    if settings.cuda:
        assert settings.cap_bytes is not None
        return int(settings.cap_bytes * (1 - AUTO_GPU_HEADROOM))
    assert settings.budget is not None
    return settings.budget - (0 if outside_in_ledger else probe.outside(seq, settings.batch))


def train_length(
    trainer: Trainer,
    shape: ModelShape,
    seq: int,
    settings: RunSettings,
    step_base: int,
    probe: BlockProbe,
    row: dict[str, Any],
) -> dict[str, Any]:
    """``row`` with the figures of ``seq`` and its state: ok, over budget or out of memory.

    A trainer built again at each length (chunkmem-auto) gets ``auto_budget``; where its plan
    recomputes a call and the ledger is over the budget by no more than that recomputation (which
    the benchmark adds to chunkmem's ledger, whose budget had reserved it), the length is trained
    once more from the initial weights with that much less budget."""
    from chunkmem import BudgetExceededError, BudgetTooSmallError

    budget = auto_budget(settings, probe, seq, trainer.outside_in_ledger) if trainer.rebuild is not None else None
    for attempt in range(2):
        out = dict(row)
        if budget is not None:
            out["chunkmem_device_budget"] = budget
            if budget <= 0:
                note = "what is saved outside the blocks alone exceeds the budget"
                return {**out, "state": "over budget", "note": note, "fits": False}
        try:
            if trainer.rebuild is not None and budget is not None:
                trainer.rebuild(budget)
            out.update(measure(trainer, shape, seq, settings, step_base))
        except (BudgetTooSmallError, BudgetExceededError) as error:  # chunkmem-auto's own budget refused it
            return {**out, "state": "over budget", "note": str(error).splitlines()[0][:100], "fits": False}
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            return {**out, "state": "out of memory", "note": str(error).splitlines()[0][:100], "fits": False}
        out["state"] = "ok"
        if settings.cuda:
            out["fits"] = True  # it ran under the cap
            return out
        ledger(out, trainer, shape, settings, probe)
        if out["fits"]:
            return out
        out["state"] = "over budget"
        extra = out["blocks_extra_bytes"]
        if budget is None or attempt or not extra or out["ledger_bytes"] - extra > settings.budget:
            return out
        budget -= extra
    return out


Emit = Callable[[dict[str, Any]], None]


def run_system(shape: ModelShape, preset: str, name: str, seqs: list[int], settings: RunSettings, emit: Emit) -> None:
    """``name`` on ``shape``: build it, then lengths until one does not fit (``emit`` each row)."""
    device = settings.recipe.device
    base = {"model": shape.name, "preset": preset, "system": name, "batch": settings.batch}
    # On a GPU building a large model and its first length take tens of seconds: not started near the end.
    if settings.left() <= (MIN_START_S if settings.cuda else 0):
        emit({**base, "seq": seqs[0], "state": "skipped", "note": "time limit", "fits": False})
        return
    trainer: Trainer | None = None
    note = None
    began = time.monotonic()
    try:
        trainer = SYSTEMS[name].build(shape, max(seqs), settings.recipe)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        note = f"building: {str(error).splitlines()[0][:100]}"
    build_s = time.monotonic() - began
    if trainer is None:
        release_memory(device)
        emit({**base, "seq": seqs[0], "state": "out of memory", "note": note, "fits": False, "build_s": build_s})
        return
    probe = BlockProbe(shape, max(seqs))
    step_base = 0
    last_s = 0.0
    try:
        for seq in seqs:
            row: dict[str, Any] = {**base, "seq": seq, "params": trainer.params, "build_s": build_s}
            # A length's steps take about twice the last one's on a GPU: skip it when that overruns.
            if settings.left() <= 0 or (settings.cuda and settings.left() < 2 * last_s):
                emit({**row, "state": "skipped", "note": "time limit", "fits": False})
                return
            began = time.monotonic()
            row = train_length(trainer, shape, seq, settings, step_base, probe, row)
            last_s = time.monotonic() - began
            step_base += settings.warmup + settings.steps
            emit(row)
            if not row["fits"]:
                return
    finally:
        trainer.close()
        del trainer
        release_memory(device)


def system_process(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``run_system`` in this (fresh) process, under the run's device cap; prints each row as it
    finishes and returns them."""
    settings: RunSettings = spec["settings"]
    if settings.cuda:
        from benchmarks.common import cap_device_memory

        assert settings.cap_bytes is not None
        cap_device_memory(settings.recipe.device, settings.cap_bytes)
    elif settings.threads:
        torch.set_num_threads(settings.threads)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(row_line(row, settings.cuda, spec["started"]), flush=True)

    try:
        run_system(spec["shape"], spec["preset"], spec["system"], spec["seqs"], settings, emit)
    except Exception as error:  # a row says so, after the lengths this system did train
        traceback.print_exc()
        done = {r["seq"] for r in rows}
        seq = next((n for n in spec["seqs"] if n not in done), spec["seqs"][-1])
        base = {"model": spec["shape"].name, "preset": spec["preset"], "system": spec["system"], "seq": seq}
        emit({**base, "state": "failed", "note": f"{type(error).__name__}: {error}"[:300], "fits": False})
    return rows


# --- how a row reads -----------------------------------------------------------------------------
def headers(cuda: bool) -> list[str]:
    device = "alloc peak" if cuda else "ledger total"
    saved = "saved (meter)" if cuda else "saved act"
    return ["model", "system", "seq", "state", "step ms", "model data", saved, device, "act d2h", "copy ms", "recomp"]


def _bytes(n: float | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def row_cells(row: dict[str, Any], cuda: bool) -> list[Any]:
    stats = row.get("chunkmem") or {}
    d2h = stats.get("activation_d2h_bytes")
    copy_s = stats.get("activation_d2h_seconds", 0) + stats.get("activation_h2d_seconds", 0)
    return [
        row["model"],
        row["system"],
        row["seq"],
        row["state"],
        "-" if "step_ms" not in row else f"{row['step_ms']:.1f}",
        _bytes(row.get("model_bytes")),
        _bytes(row.get("saved_bytes", row.get("saved_meter_bytes"))),
        _bytes(row.get("device_peak_allocated") if cuda else row.get("ledger_bytes")),
        _bytes(d2h) if d2h else "-",
        f"{copy_s * 1e3:.1f}" if copy_s else "-",
        f"{stats['recomputed_blocks']:.0f}" if stats.get("recomputed_blocks") else "-",
    ]


def row_line(row: dict[str, Any], cuda: bool, started: float) -> str:
    """One row as a line of ``header=cell`` pairs, for progress."""
    cells = "  ".join(f"{h}={c}" for h, c in zip(headers(cuda), row_cells(row, cuda), strict=True))
    note = f"  ({row['note']})" if row.get("note") else ""
    built = f"  [built in {row['build_s']:.1f} s]" if row.get("build_s") is not None else ""
    return f"[{time.time() - started:.0f} s] {cells}{note}{built}"
