"""Memory-budget experiment: GPT-2 trained under shrinking device budgets with each policy.

The model (built from a config, no download) is trained on the default device (the GPU when there
is one, else the CPU) by plain PyTorch and by chunkmem: without a budget, then once per (budget,
policy, max_prefetch). A budget is a fraction of the model data (what the static placement plans to
keep on the device with nothing offloaded). The static policy gets the smallest offload fractions
that fit the budget; the auto policy decides by itself. Every run starts from the same weights and
sees the same data, so the final loss is the same in every row, plain PyTorch's included.

Every row, plain PyTorch's too, is measured the same way: step 0 (which records chunkmem's trace)
is not timed, and the remaining steps are taken in rounds (by default one step of every row per
round) that visit the rows in an order rotated each round, so a burst of machine noise falls on all
rows alike instead of on the few that happen to run then; the table gives the median of a row's
step times and their spread (fastest to slowest), and the output says how busy the machine was
(its load average before, between the rounds and after; a warning when the 1-minute load exceeded
the cores). The data is random tokens: there is nothing to learn and the loss stays near
ln(vocabulary); the final loss shows that every row trains the same model as plain PyTorch.
A row that runs out of device memory, is refused (budget below what the placement needs), fails or
hangs is reported as such in the table; the experiment goes on.

On CUDA the model is sized from the card (GPT-2 medium or larger, batch x 1024 tokens; see
benchmarks/card.py) so that plain PyTorch does not fit; ``--device-memory 20GiB`` emulates a
smaller card. ``--world-size 2`` runs every row on two ranks (gloo on the CPU, NCCL on two GPUs)
that the script spawns; budgets are then per rank.

    python benchmarks/memory_budget.py                  # about a minute on a CPU
    python benchmarks/memory_budget.py --budgets 1,0.5,0.25,0.125 --prefetch 0,1,3 --steps 10
    python benchmarks/memory_budget.py --world-size 2   # two gloo ranks on the CPU
    python benchmarks/memory_budget.py --device-memory 20GiB   # on a GPU: emulate a 20 GiB card
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.budget_runs import (
    STATIC_LADDER,
    BudgetSetup,
    RowSpec,
    build_row,
    finish_row,
    prepare,
    row_steps,
    static_minimums,
)
from benchmarks.card import CardModel, size_for_card
from benchmarks.common import (
    DTYPES,
    RESULTS,
    GPT2Shape,
    RunRecord,
    begin_run,
    cap_device_memory,
    current_run,
    default_device,
    fmt_bytes,
    load_average,
    machine,
    median,
    parse_bytes,
    print_table,
    pyplot,
    rotated,
    write_json,
)
from benchmarks.workers import CallFailure, LocalRanks, RankPool
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

CPU_SHAPE = GPT2Shape(layers=4, width=256, vocab=8192, seq=128)
CPU_BATCH = 4


@dataclass
class Row:
    """One row of the table (and of the JSON)."""

    key: str
    policy: str
    max_prefetch: int | None
    budget_frac: float | None
    budget: int | None
    setting: str
    state: str = "pending"
    """``ok``, ``refused``, ``out of memory``, ``failed`` or ``timeout``."""
    note: str = ""
    detail: str = ""
    """The full failure report of every rank (the note is its last line)."""
    losses: list[float] = field(default_factory=list)
    step_times_ms: list[float] = field(default_factory=list)
    step_ms: float | None = None
    """The median of ``step_times_ms``."""
    step_ms_min: float | None = None
    step_ms_max: float | None = None
    step_ms_q1: float | None = None
    """The lower quartile of ``step_times_ms`` (``statistics.quantiles``, inclusive method)."""
    step_ms_q3: float | None = None
    final_loss: float | None = None
    peak_device_bytes: int | None = None
    h2d_per_step: float | None = None
    d2h_per_step: float | None = None
    fetches_per_step: float | None = None
    chunk_capacities: list[int] | None = None
    compute_itemsize: int | None = None
    device_peak_allocated: int | None = None
    built: bool = False
    steps_done: int = 0

    def summarize_times(self) -> None:
        """The median of the timed steps and their spread (fastest, slowest, quartiles)."""
        times = self.step_times_ms
        if not times:
            return
        self.step_ms = median(times)
        self.step_ms_min, self.step_ms_max = min(times), max(times)
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
        self.step_ms_q1, self.step_ms_q3 = q1, q3


class Driver:
    """Runs rows on the ranks; a failure marks its row and, when the ranks died with it, starts new
    ranks and rebuilds the rows still running (replaying their steps untimed)."""

    def __init__(self, args: argparse.Namespace, setup: BudgetSetup, open_ranks: Callable[[], Any]) -> None:
        self.args = args
        self.setup = setup
        self.open_ranks = open_ranks
        self.ranks: Any = None
        self.rows: list[Row] = []
        self.specs: dict[str, RowSpec] = {}

    def start(self) -> tuple[int, list[int]]:
        """Start the ranks; the parameter count and the static ladder's minimum budgets."""
        self.ranks = self.open_ranks()
        params = self.ranks.call(self.args.timeout, prepare, self.setup)[0]
        per_rank = self.ranks.call(self.args.timeout, static_minimums, self.setup)
        return params, [max(values) for values in zip(*per_rank, strict=True)]

    def _ensure_ranks(self) -> None:
        while not self.ranks.alive:
            print("  starting new ranks after a failure", file=sys.stderr)
            self.ranks = self.open_ranks()
            self.ranks.call(self.args.timeout, prepare, self.setup)
            current: Row | None = None
            try:
                for row in self.rows:
                    if row.built and row.state == "ok":
                        current = row
                        self.ranks.call(self.args.timeout, build_row, self.setup, self.specs[row.key])
                        if row.steps_done:
                            self.ranks.call(self.args.timeout, row_steps, row.key, 0, row.steps_done)
            except CallFailure as failure:
                assert current is not None
                self._mark(current, failure)

    def _mark(self, row: Row, failure: CallFailure) -> None:
        row.state = "out of memory" if failure.out_of_memory else ("timeout" if failure.kind == "timeout" else "failed")
        row.note = failure.summary()
        row.detail = str(failure)[-4000:]
        print(f"  {row.key}: {row.note}", file=sys.stderr)

    def _call(self, row: Row, fn: Callable[..., Any], *args: Any) -> list[Any] | None:
        self._ensure_ranks()
        try:
            return self.ranks.call(self.args.timeout, fn, *args)
        except CallFailure as failure:
            self._mark(row, failure)
            return None

    def add(self, row: Row, spec: RowSpec | None) -> None:
        self.rows.append(row)
        if spec is not None:
            self.specs[row.key] = spec

    def build(self, row: Row) -> None:
        if row.state != "pending":
            return
        answers = self._call(row, build_row, self.setup, self.specs[row.key])
        if answers is None:
            return
        bad = next((a for a in answers if a["state"] != "ok"), None)
        row.state, row.note = (bad["state"], bad["note"]) if bad else ("ok", "")
        row.built = bad is None

    def steps(self, row: Row, count: int, timed: bool) -> None:
        if row.state != "ok" or count == 0:
            return
        answers = self._call(row, row_steps, row.key, row.steps_done, count)
        if answers is None:
            return
        failed = next((a for a in answers if isinstance(a, dict)), None)
        if failed is not None:
            row.state, row.note, row.built = failed["state"], failed["note"], False
            return
        row.steps_done += count
        row.losses.extend(sum(rank[i][1] for rank in answers) / len(answers) for i in range(count))
        if timed:
            row.step_times_ms.extend(1e3 * max(rank[i][0] for rank in answers) for i in range(count))

    def finish(self, row: Row) -> None:
        if row.state != "ok":
            return
        answers = self._call(row, finish_row, row.key, row.steps_done - 1)
        row.built = False
        if answers is None:
            return
        row.summarize_times()
        row.final_loss = row.losses[-1] if row.losses else None
        first = answers[0]
        for name in ("chunk_capacities", "compute_itemsize"):
            setattr(row, name, first.get(name))
        for name in ("peak_device_bytes", "h2d_per_step", "d2h_per_step", "device_peak_allocated"):
            values = [a.get(name) for a in answers if a.get(name) is not None]
            setattr(row, name, max(values) if values else None)
        row.fetches_per_step = first.get("fetches_per_step")

    def measure(self, rounds: list[int]) -> None:
        """Warmup step, then ``rounds`` (steps per round), all rows interleaved or one at a time,
        with a progress bar (steps done of all steps) on stderr."""
        progress = _progress(len(self.rows) * (1 + sum(rounds)))

        def steps(row: Row, count: int, timed: bool) -> None:
            progress.set_postfix_str(row.key)
            self.steps(row, count, timed=timed)
            progress.update(count)

        try:
            if self.args.schedule == "sequential":
                for row in self.rows:
                    self.build(row)
                    steps(row, 1, timed=False)
                    for count in rounds:
                        steps(row, count, timed=True)
                    self.finish(row)
                    current_run().sample()
                return
            for row in self.rows:
                self.build(row)
            for row in self.rows:
                steps(row, 1, timed=False)
            by_key = {row.key: row for row in self.rows}
            for index, count in enumerate(rounds):
                for key in rotated(list(by_key), index):
                    steps(by_key[key], count, timed=True)
                current_run().sample()  # how busy the machine was during this round
            for row in self.rows:
                self.finish(row)
        finally:
            progress.close()

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()


class _NoBar:
    """What the progress bar does without tqdm: a line per row and round."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.label = total, 0, ""

    def set_postfix_str(self, label: str) -> None:
        self.label = label

    def update(self, count: int) -> None:
        self.done += count
        print(f"  {self.done}/{self.total} steps ({self.label})", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(total)
    return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)


def split_rounds(measured_steps: int, rounds: int) -> list[int]:
    """``measured_steps`` split into at most ``rounds`` nearly equal rounds."""
    rounds = max(1, min(rounds, measured_steps))
    return [measured_steps // rounds + (1 if i < measured_steps % rounds else 0) for i in range(rounds)]


def plan_rows(args: argparse.Namespace, model_data: int, minimums: list[int]) -> list[tuple[Row, RowSpec | None]]:
    """The reference rows and one row per (budget, policy, prefetch)."""
    reference = "ddp" if args.world_size > 1 else "plain"
    rows: list[tuple[Row, RowSpec | None]] = [
        (
            Row("plain", reference, None, None, None, "plain PyTorch" + (" DDP" if args.world_size > 1 else "")),
            RowSpec("plain", "plain", reference),
        ),
        (
            Row("unconstrained", "static", 0, None, None, "no budget, nothing offloaded"),
            RowSpec("unconstrained", "chunkmem", "static", placement=StaticPlacementConfig(), setting="no budget"),
        ),
    ]
    for frac in args.fractions:
        budget = int(frac * model_data)
        for policy in args.policy_list:
            for k in args.prefetch_list:
                key = f"{policy}-{frac:g}-p{k}"
                if policy == "static":
                    fit = next((i for i, m in enumerate(minimums) if m <= budget), None)
                    if fit is None:
                        row = Row(key, policy, k, frac, budget, "-", state="refused")
                        row.note = f"below the static minimum of {fmt_bytes(minimums[-1])} (everything offloaded)"
                        rows.append((row, None))
                        continue
                    optim, param = STATIC_LADDER[fit]
                    config: Any = StaticPlacementConfig(
                        offload_optim_frac=optim, offload_param_frac=param, device_budget=budget, max_prefetch=k
                    )
                    setting = f"optim {optim:.1f} / param {param:.1f} offloaded"
                else:
                    config = AutoPlacementConfig(device_budget=budget, max_prefetch=k)
                    setting = "auto"
                rows.append(
                    (
                        Row(key, policy, k, frac, budget, setting),
                        RowSpec(key, "chunkmem", policy, k, frac, budget, setting, config),
                    )
                )
    return rows


def loss_mismatches(rows: list[Row], precision: str) -> list[str]:
    """Rows whose final loss differs from plain PyTorch's (same weights, same data)."""
    plain = next((r for r in rows if r.key == "plain" and r.final_loss is not None), None)
    if plain is None:
        return []
    tolerance = 1e-4 if precision == "fp32" else 3e-2
    return [
        f"{r.key}: final loss {r.final_loss:.6f} vs plain {plain.final_loss:.6f}"
        for r in rows
        if r.final_loss is not None
        and abs(r.final_loss - plain.final_loss) > tolerance * max(1.0, abs(plain.final_loss))
    ]


def table(rows: list[Row]) -> tuple[list[str], list[list[Any]]]:
    """Headers and cells; the allocator's peak appears only where it was measured (CUDA)."""
    plain = next((r.step_ms for r in rows if r.key == "plain" and r.step_ms is not None), None)
    allocator = any(r.device_peak_allocated is not None for r in rows)
    body = []
    for r in rows:
        ok = r.state == "ok"
        cells = [
            "-" if r.budget_frac is None else f"{r.budget_frac:.1%}".replace(".0%", "%"),
            fmt_bytes(r.budget),
            r.policy,
            "-" if r.max_prefetch is None else r.max_prefetch,
            r.state,
            fmt_bytes(r.peak_device_bytes) if ok else "-",
            *([fmt_bytes(r.device_peak_allocated) if ok else "-"] if allocator else []),
            fmt_bytes(r.h2d_per_step) if ok else "-",
            fmt_bytes(r.d2h_per_step) if ok else "-",
            f"{r.fetches_per_step:.1f}" if ok and r.fetches_per_step is not None else "-",
            f"{r.step_ms:.1f}" if ok and r.step_ms is not None else "-",
            f"{r.step_ms_min:.1f}-{r.step_ms_max:.1f}" if ok and r.step_ms_min is not None else "-",
            f"{r.step_ms / plain:.2f}x" if ok and r.step_ms is not None and plain else "-",
            f"{r.final_loss:.6f}" if ok and r.final_loss is not None else "-",
            r.setting if ok else r.note[:90],
        ]
        body.append(cells)
    headers = [
        "budget",
        "bytes",
        "policy",
        "prefetch",
        "state",
        "peak device",
        *(["allocator peak"] if allocator else []),
        "H2D/step",
        "D2H/step",
        "fetches/step",
        "step ms",
        "min-max ms",
        "vs plain",
        "final loss",
        "placement / note",
    ]
    return headers, body


def data_note(vocab: int) -> str:
    """What the data is, and so why the loss does not fall."""
    return (
        f"data: random tokens (uniform over the {vocab:,}-token vocabulary), so there is nothing to learn: the loss "
        f"stays near ln({vocab:,}) = {math.log(vocab):.3f}; the final loss shows each row trains the same model as "
        "plain PyTorch, not learning"
    )


def load_note(run: RunRecord, after: list[float]) -> str:
    """The machine's load average (1/5/15 minutes) before and after the run, and its peak during it."""
    before = "/".join(f"{v:.2f}" for v in run.load_before)
    end = "/".join(f"{v:.2f}" for v in after)
    return (
        f"load average (1/5/15 min): before {before}, after {end}; the 1-minute load peaked at "
        f"{run.peak_load(after):.2f} on {os.cpu_count()} cores"
    )


def busy_warning(run: RunRecord, after: list[float]) -> str:
    """A warning when other work competed for the CPUs during the run (empty when it did not)."""
    if not run.busy(after):
        return ""
    return (
        f"WARNING: the machine was busy: the 1-minute load reached {run.peak_load(after):.2f}, more than its "
        f"{os.cpu_count()} cores, during the run; the step times are slower and noisier than this machine's own"
    )


def plot(rows: list[Row], path: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig = draw(plt, rows, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(plt: Any, rows: list[Row], title: str) -> Any:
    """The figure: peak device bytes against the budget, host-to-device bytes, and the step time
    (median, with the fastest and slowest step as error bars), each against the budget fraction."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series: dict[str, list[Row]] = {}
    for row in rows:
        if row.state == "ok" and row.budget_frac is not None:
            series.setdefault(f"{row.policy}, prefetch {row.max_prefetch}", []).append(row)
    plain = next((r for r in rows if r.key == "plain"), None)
    baseline = plain.step_ms if plain is not None and plain.step_ms else None
    scale = 1.0 / baseline if baseline is not None else 1.0
    # Series often coincide (equal bytes under both policies): distinct markers and dashes, hollow
    # markers and a slight width difference keep every one visible where they overlap.
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (1, 1)))]
    for index, (label, points) in enumerate(series.items()):
        points = sorted(points, key=lambda r: r.budget_frac or 0.0)
        xs = [100 * (r.budget_frac or 0.0) for r in points]
        marker, dashes = styles[index % len(styles)]
        style = {
            "marker": marker,
            "linestyle": dashes,
            "fillstyle": "none",
            "markersize": 9 - index % 4,
            "linewidth": 2.2 - 0.3 * (index % 4),
            "label": label,
        }
        axes[0].plot(xs, [(r.peak_device_bytes or 0) / 2**20 for r in points], **style)
        axes[1].plot(xs, [(r.h2d_per_step or 0) / 2**20 for r in points], **style)
        timed = [r for r in points if r.step_ms is not None and r.step_ms_min is not None and r.step_ms_max is not None]
        # Each series a little apart on x, so that error bars at the same budget do not hide each other.
        shift = 0.8 * (index - (len(series) - 1) / 2)
        medians = [r.step_ms * scale for r in timed]
        spread = [
            [(r.step_ms - r.step_ms_min) * scale for r in timed],
            [(r.step_ms_max - r.step_ms) * scale for r in timed],
        ]
        axes[2].errorbar(
            [100 * (r.budget_frac or 0.0) + shift for r in timed], medians, yerr=spread, capsize=3, **style
        )
    budgets = sorted({(r.budget_frac, r.budget) for r in rows if r.budget is not None and r.budget_frac is not None})
    budget_xs, budget_ys = [100 * f for f, _ in budgets], [b / 2**20 for _, b in budgets]
    # Drawn over the series (a peak at the budget would hide a line under it), dashed so both show.
    axes[0].plot(budget_xs, budget_ys, color="crimson", linestyle=(0, (4, 3)), linewidth=1.6, label="budget", zorder=10)
    if baseline is not None:
        axes[2].axhline(1.0, color="k", linestyle=":", label=f"plain PyTorch ({plain.policy}) = 1")
        if plain.step_ms_min is not None and plain.step_ms_max is not None:
            low, high = plain.step_ms_min * scale, plain.step_ms_max * scale
            axes[2].axhspan(low, high, color="0.85", zorder=0, label="plain PyTorch, min-max")
    elif plain is not None:
        axes[2].text(0.02, 0.95, f"plain PyTorch: {plain.state}", transform=axes[2].transAxes, va="top")
    what = "step time / plain PyTorch's median" if baseline is not None else "step time ms"
    time_label = f"{what}\n(median; bars: fastest to slowest step)"
    for ax, ylabel in zip(axes, ["peak device MiB", "H2D MiB per step", time_label], strict=True):
        ax.set_xlabel("device budget, % of model data")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # from zero: noise between rows does not read as a trend
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, choices=[1, 2], default=1, help="ranks per run (2: rank processes)")
    parser.add_argument(
        "--budgets", default=None, help="fractions of model data (default 1,0.5,0.25; CUDA 0.5,0.25,0.125)"
    )
    parser.add_argument("--policies", default="static,auto")
    parser.add_argument("--prefetch", default=None, help="max_prefetch values (default 0,2; CUDA 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, the first untimed (default 10; CUDA 6)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds the timed steps are split into (default: one step per row per round, so a burst of "
        "machine noise falls on every row alike)",
    )
    parser.add_argument("--layers", type=int, default=None, help="default 4 on the CPU; sized from the card on CUDA")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: bf16 on a GPU, fp32 on a CPU"
    )
    parser.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    parser.add_argument("--device-memory", default=None, help="CUDA only: cap this process's device memory, e.g. 20GiB")
    parser.add_argument(
        "--schedule",
        choices=["alternate", "sequential"],
        default=None,
        help="alternate: every run resident, steps interleaved (CPU default); sequential: one run at a time "
        "(CUDA default, where runs would share the card)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (W=2 default: cores / 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one command may take at W=2")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        help="W=2: seconds one collective may wait before the process group gives up (a rank that departed "
        "from the others then fails the row instead of hanging it)",
    )
    parser.add_argument("--name", default=None, help="file name for the JSON and the plot")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON and the plot go")
    args = parser.parse_args(argv)
    args.cuda = cuda
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.fractions = [float(x) for x in (args.budgets or ("0.5,0.25,0.125" if cuda else "1,0.5,0.25")).split(",")]
    args.policy_list = args.policies.split(",")
    for policy in args.policy_list:
        if policy not in ("static", "auto"):
            parser.error(f"--policies: unknown policy {policy!r} (static, auto)")
    args.prefetch_list = [int(x) for x in (args.prefetch or ("2" if cuda else "0,2")).split(",")]
    args.steps = args.steps or (6 if cuda else 10)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is untimed warmup")
    args.schedule = args.schedule or ("sequential" if cuda else "alternate")
    args.rounds = args.rounds or args.steps - 1
    args.device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    if args.device_memory is not None and not cuda:
        parser.error("--device-memory caps CUDA memory; there is no CUDA device (on the CPU the host is the device)")
    if cuda and args.world_size > torch.cuda.device_count():
        parser.error(f"--world-size {args.world_size} needs {args.world_size} GPUs; found {torch.cuda.device_count()}")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    args.name = args.name or ("memory_budget" if args.world_size == 1 else f"memory_budget_w{args.world_size}")
    return args


def resolve_model(args: argparse.Namespace) -> tuple[GPT2Shape, int, CardModel | None]:
    """The shape and batch: the CPU defaults, or sized from the card on CUDA; flags override."""
    card = None
    shape, batch = CPU_SHAPE, CPU_BATCH
    if args.cuda:
        device = default_device()
        free, _ = torch.cuda.mem_get_info(device)
        capacity = min(free, args.device_memory) if args.device_memory else free
        card = size_for_card(capacity, psutil.virtual_memory().available, DTYPES[args.precision].itemsize)
        shape, batch = card.shape, card.batch
    shape = GPT2Shape(
        args.layers or shape.layers, args.width or shape.width, args.vocab or shape.vocab, args.seq or shape.seq
    )
    return shape, args.batch or batch, card


def main(argv: list[str] | None = None) -> None:
    begin_run(__file__, argv)
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = default_device()
    if args.device_memory is not None and args.world_size == 1:
        cap_device_memory(device, args.device_memory)
    shape, batch, card = resolve_model(args)
    if card is not None:
        print(f"sized from the card: {card.reason}; batch {batch} x {shape.seq}", file=sys.stderr)
    setup = BudgetSetup(shape, batch, args.precision, args.chunk_size)

    def open_ranks() -> Any:
        if args.world_size == 1:
            return LocalRanks(device)
        return RankPool(
            args.world_size,
            backend="nccl" if args.cuda else "gloo",
            threads=args.threads,
            env={"TRANSFORMERS_VERBOSITY": "error", "BENCH_PG_TIMEOUT": str(args.collective_timeout)},
            device_memory=args.device_memory,
        )

    driver = Driver(args, setup, open_ranks)
    try:
        params, minimums = driver.start()
        model_data = minimums[0]
        for row, spec in plan_rows(args, model_data, minimums):
            driver.add(row, spec)
        print(f"{len(driver.rows)} rows, {args.steps} steps each ({args.schedule})", file=sys.stderr)
        driver.measure(split_rounds(args.steps - 1, args.rounds))
    finally:
        driver.close()
    rows = driver.rows

    where = f"{device}" + (f" capped at {fmt_bytes(args.device_memory)}" if args.device_memory else "")
    title = f"{shape.describe()}, batch {batch}x{shape.seq} per rank, {args.precision}, W={args.world_size} on {where}"
    print(title)
    if card is not None:
        print(f"model sized from the card: {card.reason}")
    timing = (
        f"step 0 untimed, {args.steps - 1} timed steps per row in {len(split_rounds(args.steps - 1, args.rounds))} "
        f"rounds ({args.schedule}): the median step and the fastest-slowest (min-max)"
    )
    print(f"model data with nothing offloaded (100%): {fmt_bytes(model_data)} per rank; {timing}")
    headers, body = table(rows)
    print_table(headers, body)
    data = data_note(shape.vocab)
    print(data)
    run = current_run()
    after = load_average()
    load = load_note(run, after)
    print(load)
    busy = busy_warning(run, after)
    if busy:
        print(busy)
    over = [
        r.key
        for r in rows
        if r.peak_device_bytes is not None and r.budget is not None and r.peak_device_bytes > r.budget
    ]
    print("peak device bytes within budget in every row" if not over else f"OVER BUDGET: {', '.join(over)}")
    mismatched = loss_mismatches(rows, args.precision)
    for line in mismatched:
        print(f"WARNING: {line}")
    if not mismatched and any(r.key == "plain" and r.final_loss is not None for r in rows):
        print("final loss equal to plain PyTorch's in every row that trained")
    payload = {
        "title": title,
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "device": str(device),
        "machine": machine(),
        "shape": asdict(shape),
        "batch": batch,
        "params": params,
        "param_bytes": params * DTYPES[args.precision].itemsize,
        "model_data_bytes": model_data,
        "static_minimums": dict(zip([f"optim {o} / param {p}" for o, p in STATIC_LADDER], minimums, strict=True)),
        "card": None if card is None else {**asdict(card), "shape": asdict(card.shape)},
        "loss_mismatches": mismatched,
        "data": data,
        "rows": [asdict(r) for r in rows],
        "summary_table": {
            "headers": headers,
            "rows": [[str(cell) for cell in row] for row in body],
            "note": " ".join(line for line in (title + ".", timing + ".", data, load, busy) if line),
        },
    }
    path = write_json(args.name, payload, args.out_dir)
    image = plot(rows, args.out_dir / f"{args.name}.png", title)
    print(f"wrote {path}" + (f" and {image}" if image else ""))
    if not math.isfinite(sum(r.final_loss or 0.0 for r in rows)):
        print("WARNING: a row's loss is not finite")


if __name__ == "__main__":
    main()
