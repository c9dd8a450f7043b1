"""chunkmem against its peers: the same model and data on DDP, FSDP2, DeepSpeed ZeRO-3 and chunkmem.

GPT-2 from a ``transformers`` config (default 4 layers x 256 wide, vocab 2048; batch 4 x 128 tokens
per rank), fp32 ``torch.optim.AdamW``, the same seed and the same tokens on every system. Each system
runs in its own rank processes (started by this script: gloo on the CPU, NCCL on GPUs), so its peak
RSS is its own and a failing system cannot take the others down. Systems alternate round by round
(the order rotates every round) and each reports the median over rounds of its per-round median
step time, the ratio of that to FSDP2's and DDP's medians from the same run, peak RSS per rank and,
on CUDA, peak device memory. The loss of the first step must be the same on every system (same
weights, same data); the script warns when it is not. Prints a table, writes JSON and a plot.

    python benchmarks/peers.py                        # W=2, CPU gloo: all systems
    python benchmarks/peers.py --world-size 1         # chunkmem vs plain PyTorch overhead
    python benchmarks/peers.py --systems ddp,fsdp2,chunkmem --rounds 7 --steps 5
    python benchmarks/peers.py --layers 24 --width 1024 --seq 1024 --batch 8 --schedule sequential  # GPU

Systems: plain (W=1 only), ddp, fsdp2, fsdp2-offload (CPUOffloadPolicy), chunkmem (default static
ZeRO-3 placement, prefetching 2 chunks), chunkmem-prefetch0 and -prefetch1 (the same with max_prefetch 0 or 1),
chunkmem-offload (StaticPlacementConfig(offload_optim_frac=1.0)), chunkmem-auto
(AutoPlacementConfig()), deepspeed-z3 and deepspeed-z3-offload (optimizer and parameters on the CPU).

DeepSpeed is optional (``pip install -e ".[peers]"``); without it its systems are skipped with a
note. On a CPU-only machine it needs its CPU accelerator and torch's AdamW (this script sets both:
``DS_ACCELERATOR=cpu`` and ``"torch_adam": true``). A separate environment keeps it away from the
project's own:

    python -m venv /work/venv-peers
    /work/venv-peers/bin/pip install torch==2.13.0            # the CPU build; your platform's elsewhere
    DS_BUILD_OPS=0 /work/venv-peers/bin/pip install deepspeed transformers pydantic psutil pyyaml \\
        nvidia-ml-py matplotlib
    /work/venv-peers/bin/pip install -e . --no-deps
    /work/venv-peers/bin/python benchmarks/peers.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RESULTS,
    GPT2Shape,
    begin_run,
    fmt_bytes,
    machine,
    median,
    parse_bytes,
    print_table,
    pyplot,
    rotated,
    write_json,
)
from benchmarks.peer_systems import (
    DDP,
    FSDP2,
    Chunkmem,
    DeepSpeedZero3,
    PeerSetup,
    Plain,
    System,
    build_system,
    memory_report,
    train_steps,
)
from benchmarks.workers import CallFailure, RankPool


def systems(chunk_size: int | None = None) -> dict[str, System]:
    from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

    return {
        s.name: s
        for s in (
            Plain(),
            DDP(),
            FSDP2(),
            FSDP2("fsdp2-offload", offload=True),
            Chunkmem("chunkmem", StaticPlacementConfig(), chunk_size),
            # The static policy's prefetch depth, measured against the default (2).
            Chunkmem("chunkmem-prefetch0", StaticPlacementConfig(max_prefetch=0), chunk_size),
            Chunkmem("chunkmem-prefetch1", StaticPlacementConfig(max_prefetch=1), chunk_size),
            Chunkmem("chunkmem-offload", StaticPlacementConfig(offload_optim_frac=1.0), chunk_size),
            Chunkmem("chunkmem-auto", AutoPlacementConfig(), chunk_size),
            DeepSpeedZero3(),
            DeepSpeedZero3("deepspeed-z3-offload", offload=True),
        )
    }


# At W=1 on the CPU: chunkmem's overhead over plain PyTorch. On a GPU the offloading peers join (a
# one-rank process group for FSDP2 and DeepSpeed), as in the single-GPU comparison of issue 13.
CUDA_W1_PEERS = ["fsdp2", "fsdp2-offload", "deepspeed-z3-offload"]
DEFAULTS = {
    1: ["plain", "chunkmem", "chunkmem-offload", "chunkmem-auto"],
    2: [
        "ddp",
        "fsdp2",
        "fsdp2-offload",
        "chunkmem",
        "chunkmem-offload",
        "chunkmem-auto",
        "deepspeed-z3",
        "deepspeed-z3-offload",
    ],
}


@dataclass
class Result:
    """One system's measurements (step times are the slowest rank's, losses the mean over ranks)."""

    system: str
    state: str = "ok"
    """``ok``, ``skipped``, ``out of memory`` or ``failed``."""
    note: str = ""
    detail: str = ""
    """The full failure report of every rank (the note is its last line)."""
    losses: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    step_times: list[list[float]] = field(default_factory=list)
    median_s: float | None = None
    vs: dict[str, float] = field(default_factory=dict)
    """Median step time over another system's, measured in the same run, by that system's name."""
    rss_after_build: int | None = None
    peak_rss: int | None = None
    device_peak: int | None = None


class Runner:
    """One system's rank processes and what they measured."""

    def __init__(self, system: System, args: argparse.Namespace, setup: PeerSetup) -> None:
        self.system = system
        self.args = args
        self.setup = setup
        self.result = Result(system.name)
        self.pool: RankPool | None = None
        self.steps_done = 0

    @property
    def ok(self) -> bool:
        return self.result.state == "ok"

    def fail(self, failure: CallFailure) -> None:
        self.result.state = "out of memory" if failure.out_of_memory else "failed"
        self.result.note = failure.summary()
        self.result.detail = str(failure)[-4000:]
        print(f"  {self.system.name}: {self.result.note}", file=sys.stderr)
        self.pool = None

    def launch(self) -> None:
        """Start the rank processes (without waiting for them)."""
        args = self.args
        try:
            self.pool = RankPool(
                args.world_size,
                backend=args.backend,
                threads=args.threads,
                init=self.system.group_init(args.world_size),
                env={
                    "TRANSFORMERS_VERBOSITY": "error",
                    "BENCH_PG_TIMEOUT": str(args.collective_timeout),
                    **self.system.env(),
                },
                device_memory=args.device_memory,
                wait=False,
            )
        except CallFailure as failure:
            self.fail(failure)

    def start(self) -> None:
        """Build the system in its ranks and run the warmup steps."""
        if not self.ok:
            return
        if self.pool is None:
            self.launch()
        if self.pool is None:
            return
        try:
            built = self.pool.call(self.args.timeout, build_system, self.system, self.setup)
            self.result.rss_after_build = max(b["rss_after_build"] for b in built)
        except CallFailure as failure:
            self.fail(failure)
            return
        self.run(self.args.warmup, timed=False)

    def run(self, count: int, timed: bool = True) -> None:
        if not self.ok or self.pool is None or count == 0:
            return
        try:
            per_rank = self.pool.call(self.args.timeout, train_steps, self.setup, self.steps_done, count)
        except CallFailure as failure:
            self.fail(failure)
            return
        self.steps_done += count
        times = [max(rank[i][0] for rank in per_rank) for i in range(count)]
        self.result.losses.extend(sum(rank[i][1] for rank in per_rank) / len(per_rank) for i in range(count))
        if timed:
            self.result.step_times.append(times)
            self.result.round_medians.append(median(times))

    def finish(self) -> None:
        if self.pool is None:
            return
        if self.ok:
            try:
                reports = self.pool.call(self.args.timeout, memory_report)
            except CallFailure as failure:
                self.fail(failure)
                return
            self.result.peak_rss = max(r["peak_rss"] for r in reports)
            peaks = [r["device_peak"] for r in reports if r["device_peak"] is not None]
            self.result.device_peak = max(peaks) if peaks else None
            self.result.median_s = median(self.result.round_medians) if self.result.round_medians else None
        self.pool.close()
        self.pool = None


def resolve_systems(args: argparse.Namespace) -> tuple[list[System], list[Result]]:
    """The systems to run, and the ones skipped (with why)."""
    known = systems(args.chunk_size)
    names = args.systems.split(",") if args.systems else list(DEFAULTS.get(args.world_size, DEFAULTS[2]))
    if not args.systems and args.world_size == 1 and args.backend == "nccl":
        names[1:1] = CUDA_W1_PEERS
    chosen, skipped = [], []
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown system {name!r}; choose from {', '.join(known)}")
        system = known[name]
        reason = system.check(args.world_size)
        if reason is None and isinstance(system, DeepSpeedZero3) and importlib.util.find_spec("deepspeed") is None:
            reason = "deepspeed is not installed in this Python (pip install -e '.[peers]'; see this script's help)"
        if reason is not None:
            print(f"note: skipping {name}: {reason}")
            skipped.append(Result(name, state="skipped", note=reason))
        else:
            chosen.append(system)
    return chosen, skipped


def measure(runners: list[Runner], args: argparse.Namespace) -> None:
    if args.schedule == "sequential":
        for runner in runners:
            runner.start()
            for _ in range(args.rounds):
                runner.run(args.steps)
            runner.finish()
        return
    for runner in runners:
        runner.launch()  # all ranks import their frameworks at once
    for runner in runners:
        runner.start()
    by_name = {r.system.name: r for r in runners}
    for round_index in range(args.rounds):
        for name in rotated(list(by_name), round_index):
            by_name[name].run(args.steps)
        print(f"  round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    for runner in runners:
        runner.finish()


REFERENCES = ("fsdp2", "ddp", "plain")


def compare(results: list[Result]) -> None:
    medians = {r.system: r.median_s for r in results if r.median_s is not None}
    for result in results:
        if result.median_s is None:
            continue
        for ref in REFERENCES:
            if ref in medians:
                result.vs[ref] = result.median_s / medians[ref]


def check_losses(results: list[Result], precision: str) -> list[str]:
    """Systems whose first-step loss differs from the first system's (same weights, same data:
    it must not, beyond rounding)."""
    ran = [r for r in results if r.losses]
    if len(ran) < 2:
        return []
    reference = ran[0]
    tolerance = 1e-5 if precision == "fp32" else 2e-2
    bad = []
    for result in ran[1:]:
        first, expected = result.losses[0], reference.losses[0]
        if abs(first - expected) > tolerance * max(1.0, abs(expected)):
            bad.append(f"{result.system} first-step loss {first:.6f} != {reference.system}'s {expected:.6f}")
    return bad


def report(results: list[Result], args: argparse.Namespace, title: str) -> None:
    print(title)
    rows = []
    for r in results:
        spread = (
            f"{min(r.round_medians):.3f}-{max(r.round_medians):.3f}" if r.round_medians and r.state == "ok" else "-"
        )
        rows.append(
            [
                r.system,
                r.state,
                f"{r.median_s:.3f}" if r.median_s is not None else "-",
                spread,
                *[f"{r.vs[ref]:.2f}x" if ref in r.vs else "-" for ref in REFERENCES if ref in args.references],
                fmt_bytes(r.peak_rss),
                fmt_bytes(r.device_peak),
                f"{r.losses[0]:.6f}" if r.losses else "-",
                f"{r.losses[-1]:.6f}" if r.losses else "-",
                r.note[:70],
            ]
        )
    print_table(
        [
            "system",
            "state",
            "median step s",
            "round medians s",
            *[f"vs {ref}" for ref in REFERENCES if ref in args.references],
            "peak RSS/rank",
            "device peak",
            "loss step 0",
            f"loss step {args.warmup + args.rounds * args.steps - 1}",
            "note",
        ],
        rows,
        align=["<", "<", ">", ">", *[">" for ref in REFERENCES if ref in args.references], ">", ">", ">", ">", "<"],
    )


def plot(results: list[Result], path: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    ran = [r for r in results if r.median_s is not None]
    if not ran:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r.system for r in ran]
    xs = range(len(ran))
    meds = [r.median_s for r in ran]
    low = [r.median_s - min(r.round_medians) for r in ran]
    high = [max(r.round_medians) - r.median_s for r in ran]
    colors = ["tab:orange" if r.system.startswith("chunkmem") else "tab:blue" for r in ran]
    axes[0].bar(xs, meds, yerr=[low, high], capsize=4, color=colors)
    for x, r in zip(xs, ran, strict=True):
        ref = next((k for k in REFERENCES if k in r.vs), None)
        if ref is not None:
            axes[0].annotate(f"{r.vs[ref]:.2f}x {ref}", (x, r.median_s), ha="center", va="bottom", fontsize=7)
    axes[0].set_ylabel("median step time, s (bars: min-max of round medians)")
    axes[1].bar(xs, [(r.peak_rss or 0) / 2**20 for r in ran], color=colors)
    axes[1].set_ylabel("peak RSS per rank, MiB")
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--world-size", type=int, default=None, help="ranks (default 2; on CUDA the GPUs available, at most 2)"
    )
    parser.add_argument("--systems", default=None, help="comma separated (default: every system for the world size)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default fp32 (bf16 on CUDA)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds; every system runs --steps steps per round")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system before the first round")
    parser.add_argument(
        "--schedule",
        choices=["alternate", "sequential"],
        default="sequential" if cuda else "alternate",
        help="alternate: every system resident, rounds interleaved (default on the CPU); sequential: one "
        "system at a time (default on CUDA, where systems would share the card's memory)",
    )
    parser.add_argument("--chunk-size", type=int, default=None, help="chunkmem: elements per chunk (default searched)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--device-memory", default=None, help="cap each rank's CUDA memory, e.g. 20GiB")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one command may take on a system")
    parser.add_argument(
        "--collective-timeout", type=float, default=120.0, help="seconds one collective may wait (process group)"
    )
    parser.add_argument("--name", default=None, help="file name for the JSON and the plot (default peers_w<W>)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = max(1, min(2, torch.cuda.device_count())) if cuda else 2
    if cuda and args.world_size > torch.cuda.device_count():
        parser.error(f"--world-size {args.world_size} needs {args.world_size} GPUs; found {torch.cuda.device_count()}")
    args.backend = "nccl" if cuda else "gloo"
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    args.device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    if args.device_memory is not None and not cuda:
        parser.error("--device-memory caps CUDA memory; there is no CUDA device")
    args.name = args.name or f"peers_w{args.world_size}"
    return args


def main(argv: list[str] | None = None) -> None:
    begin_run(__file__, argv)
    args = parse_args(argv)
    shape = GPT2Shape(args.layers, args.width, args.vocab, args.seq)
    setup = PeerSetup(shape, args.batch, args.precision, activation_checkpointing=args.activation_checkpointing)
    chosen, skipped = resolve_systems(args)
    args.references = [ref for ref in REFERENCES if ref in {s.name for s in chosen}]
    device = "cuda" if args.backend == "nccl" else "cpu"
    group = f" {args.backend}" if args.world_size > 1 else ""
    title = (
        f"{shape.describe()}, batch {args.batch}x{args.seq} per rank, {args.precision} AdamW, W={args.world_size}"
        f"{group} on {device}, {args.threads} thread(s)/rank; {args.rounds} rounds x {args.steps} steps "
        f"({args.schedule})"
    )
    print(title, file=sys.stderr)
    runners = [Runner(system, args, setup) for system in chosen]
    measure(runners, args)
    results = [r.result for r in runners]
    compare(results)
    results += skipped
    report(results, args, title)
    mismatched = check_losses(results, args.precision)
    for line in mismatched:
        print(f"WARNING: {line}: the systems are not training the same model on the same data")
    if not mismatched:
        print("first-step loss equal on every system that ran (same weights, same data)")
    payload = {
        "title": title,
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": machine(),
        "params": shape.params(),
        "loss_mismatches": mismatched,
        "results": [asdict(r) for r in results],
    }
    path = write_json(args.name, payload, args.out_dir)
    image = plot(results, args.out_dir / f"{args.name}.png", title)
    print(f"wrote {path}" + (f" and {image}" if image else ""))


if __name__ == "__main__":
    main()
