"""torch.compile per block: chunkmem with its blocks compiled (``ChunkPlugin(compile=CompileBlocks())``)
against chunkmem eager, plain PyTorch eager and plain PyTorch with the same blocks compiled, and at
two ranks FSDP2 (``fully_shard`` per block) eager and with each block compiled.

GPT-2 and LLaMA from ``transformers`` configs (``activation_systems.ModelShape``; no download), fp32
``torch.optim.AdamW``, the same seed and the same tokens on every system, ``use_cache=False`` (a KV
cache passed through the blocks makes each layer compile on its own). Plain PyTorch and FSDP2
compile the block class's ``forward`` once (``torch.compile(Block.forward)``, called for every block:
PyTorch's regional compilation recipe, and torchtitan's per-block compile with FSDP2's hooks outside
the compiled code); chunkmem compiles the same function. Each system runs in its own processes
(``peers.py``'s rank pools); the systems alternate round by round (the order rotating) and each
reports the median over rounds of its per-round median step time, the spread of its round medians,
the first step's time (it traces and compiles forward and backward) and the graphs Dynamo compiled.

    python benchmarks/compile.py                          # W=1: GPT-2 and LLaMA, Inductor, no budget and a budget
    python benchmarks/compile.py --world-size 2           # W=2 gloo: FSDP2 and chunkmem, eager and compiled
    python benchmarks/compile.py --arch llama --layers 8 --width 512 --seq 256 --rounds 7

Systems at W=1: ``plain``, ``plain-compiled``, ``chunkmem`` (the default static placement: nothing
moves), ``chunkmem-compiled``, ``chunkmem-budget`` and ``chunkmem-budget-compiled`` (an
``AutoPlacementConfig(device_budget=...)`` of ``--budget-frac`` of the model's fp32 training state:
chunks are gathered, released and prefetched around every block). At W=2: ``fsdp2``,
``fsdp2-compiled``, ``chunkmem``, ``chunkmem-compiled``.

The targets (issue 46), printed and written to the JSON under ``targets``: at W=1 without a budget
chunkmem compiled at most 1.05x plain per-block compiled, keeping at least 80% of the speedup compile
gives plain PyTorch (``kept``: chunkmem's speedup over its eager run, less one, over plain's); under a
budget the same ratio of speedups against chunkmem eager; at W=2 no slower than FSDP2 compiled.
Losses are checked: at W=1 chunkmem's against plain PyTorch computing the same way (eager, or the
same blocks compiled), bit for bit in fp32 on the CPU (the same kernels on the same shapes); the
largest relative gap is reported between a compiled system and its eager twin (Inductor's fused
kernels round otherwise) and between chunkmem and FSDP2 at two ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.activation_systems import ModelShape
from benchmarks.common import (
    RESULTS,
    GPT2Shape,
    begin_run,
    current_run,
    fmt_bytes,
    machine,
    median,
    print_table,
    rotated,
    write_json,
)
from benchmarks.peer_systems import (
    PeerSetup,
    System,
    build_system,
    chunkmem_step,
    memory_report,
    plain_step,
    train_steps,
)
from benchmarks.workers import CallFailure, GroupInit, RankContext, RankPool, init_torch_group

ARCHS = ("gpt2", "llama")


# --- the models ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompileSetup(PeerSetup):
    """``PeerSetup`` (the model, data and optimizer every system shares) for either architecture
    (``activation_systems.ModelShape``'s GPT-2 or LLaMA), and how blocks are compiled."""

    arch: str = "gpt2"
    backend: str = "inductor"
    dynamic: bool | None = None

    @property
    def model_shape(self) -> ModelShape:
        return ModelShape(self.arch, self.shape.layers, self.shape.width, self.shape.vocab)  # type: ignore[arg-type]

    def model(self) -> torch.nn.Module:
        model = self.model_shape.build(self.shape.seq, torch.device("cpu"), self.seed)
        model.config.use_cache = False
        return model

    def params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.model_shape.build(self.shape.seq, torch.device("meta")).parameters())

    def describe(self) -> str:
        return f"{self.model_shape.name} (vocab {self.shape.vocab}, {self.params() / 1e6:.1f}M params)"


def blocks_of(model: torch.nn.Module, setup: CompileSetup) -> list[torch.nn.Module]:
    return setup.model_shape.blocks(model)


def compile_blocks(model: torch.nn.Module, setup: CompileSetup) -> None:
    """Plain per-block compile: one ``torch.compile`` of the block class's forward, each block's
    ``forward`` calling it (module hooks, FSDP2's included, stay outside the compiled code)."""
    blocks = blocks_of(model, setup)
    compiled = torch.compile(type(blocks[0]).forward, backend=setup.backend, dynamic=setup.dynamic)
    for block in blocks:
        block.forward = functools.partial(compiled, block)


# --- the systems -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plain(System):
    """Plain PyTorch in one process, eager or with its blocks compiled."""

    name: str
    compiled: bool = False

    def group_init(self, world_size: int) -> GroupInit | None:
        return None

    def check(self, world_size: int) -> str | None:
        return None if world_size == 1 else "plain PyTorch is one process; at W>1 compare with fsdp2"

    def build(self, ctx: RankContext, setup: PeerSetup) -> Any:
        assert isinstance(setup, CompileSetup)
        model = setup.model().to(ctx.device)
        if self.compiled:
            compile_blocks(model, setup)
        return plain_step(model, setup.optimizer(model.parameters()), setup, ctx.device)


@dataclass(frozen=True)
class FSDP2(System):
    """``fully_shard`` on every block, then on the root; ``compiled``: each block's forward compiled
    inside FSDP2's hooks (torchtitan's order: the hooks gather around the compiled code)."""

    name: str
    compiled: bool = False

    def check(self, world_size: int) -> str | None:
        return None if world_size > 1 else "FSDP2 is compared at W>1 (at W=1 compare plain)"

    def build(self, ctx: RankContext, setup: PeerSetup) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        assert isinstance(setup, CompileSetup)
        model = setup.model().to(ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        if self.compiled:
            compile_blocks(model, setup)
        for block in blocks_of(model, setup):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return plain_step(model, setup.optimizer(model.parameters()), setup, ctx.device)


@dataclass(frozen=True)
class Chunkmem(System):
    """chunkmem through its public API, eager or with ``ChunkPlugin(compile=CompileBlocks(...))``."""

    name: str
    compiled: bool = False
    budget_frac: float | None = None
    """An ``AutoPlacementConfig(device_budget=...)`` of this fraction of the model's fp32 training
    state (parameters, gradients, AdamW's two states: 16 bytes a parameter); ``None``: the static
    placement (nothing moves at W=1)."""

    def group_init(self, world_size: int) -> GroupInit | None:
        return init_torch_group if world_size > 1 else None

    def build(self, ctx: RankContext, setup: PeerSetup) -> Any:
        from chunkmem import Booster, ChunkPlugin, CompileBlocks
        from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

        assert isinstance(setup, CompileSetup)
        model = setup.model()
        placement: Any = StaticPlacementConfig()
        if self.budget_frac is not None:
            placement = AutoPlacementConfig(device_budget=int(self.budget_frac * 16 * setup.params()))
        compile = (
            CompileBlocks(blocks=[setup.model_shape.block_class], backend=setup.backend, dynamic=setup.dynamic)
            if self.compiled
            else None
        )
        booster = Booster(ChunkPlugin(placement=placement, precision=setup.precision, compile=compile))
        return chunkmem_step(ctx, booster, model, setup)


def systems(budget_frac: float) -> dict[str, System]:
    return {
        s.name: s
        for s in (
            Plain("plain"),
            Plain("plain-compiled", compiled=True),
            FSDP2("fsdp2"),
            FSDP2("fsdp2-compiled", compiled=True),
            Chunkmem("chunkmem"),
            Chunkmem("chunkmem-compiled", compiled=True),
            Chunkmem("chunkmem-budget", budget_frac=budget_frac),
            Chunkmem("chunkmem-budget-compiled", compiled=True, budget_frac=budget_frac),
        )
    }


DEFAULTS = {
    1: ["plain", "plain-compiled", "chunkmem", "chunkmem-compiled", "chunkmem-budget", "chunkmem-budget-compiled"],
    2: ["fsdp2", "fsdp2-compiled", "chunkmem", "chunkmem-compiled"],
}
# (compiled, its eager twin) pairs whose losses must be equal, and the speedup each compile gives.
TWINS = {
    "plain-compiled": "plain",
    "fsdp2-compiled": "fsdp2",
    "chunkmem-compiled": "chunkmem",
    "chunkmem-budget-compiled": "chunkmem-budget",
}


def compile_report(ctx: RankContext) -> dict[str, int]:
    """What Dynamo compiled in this rank: distinct graphs, and recompiles of a function."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "recompiles": int(sum(counters["recompiles"].values()))}


# --- running them --------------------------------------------------------------------------------------
@dataclass
class Result:
    """One system's measurements on one architecture (step times are the slowest rank's, losses the
    mean over ranks)."""

    system: str
    arch: str
    state: str = "ok"
    note: str = ""
    losses: list[float] = field(default_factory=list)
    warmup_s: list[float] = field(default_factory=list)
    """The untimed first steps (the compile happens in the first)."""
    round_medians: list[float] = field(default_factory=list)
    median_s: float | None = None
    graphs: int | None = None
    recompiles: int | None = None
    peak_rss: int | None = None


class Runner:
    """One system's rank processes on one architecture."""

    def __init__(self, system: System, args: argparse.Namespace, setup: CompileSetup) -> None:
        self.system = system
        self.args = args
        self.setup = setup
        self.result = Result(system.name, setup.arch)
        self.pool: RankPool | None = None
        self.done = 0

    def _call(self, fn: Any, *args: Any) -> list[Any] | None:
        if self.pool is None or self.result.state != "ok":
            return None
        try:
            return self.pool.call(self.args.timeout, fn, *args)
        except CallFailure as failure:
            self.result.state = "out of memory" if failure.out_of_memory else "failed"
            self.result.note = failure.summary()
            print(f"  {self.system.name} ({self.setup.arch}): {failure}", file=sys.stderr)
            self.pool = None
            return None

    def launch(self) -> None:
        try:
            self.pool = RankPool(
                self.args.world_size,
                backend=self.args.group_backend,
                threads=self.args.threads,
                init=self.system.group_init(self.args.world_size),
                env={"TRANSFORMERS_VERBOSITY": "error", "TORCHINDUCTOR_COMPILE_THREADS": "1"},
                wait=False,
            )
        except CallFailure as failure:
            self.result.state, self.result.note = "failed", failure.summary()

    def steps(self, count: int) -> list[float] | None:
        per_rank = self._call(train_steps, self.setup, self.done, count)
        if per_rank is None:
            return None
        self.done += count
        self.result.losses.extend(sum(rank[i][1] for rank in per_rank) / len(per_rank) for i in range(count))
        return [max(rank[i][0] for rank in per_rank) for i in range(count)]

    def start(self) -> None:
        if self._call(build_system, self.system, self.setup) is not None:
            self.result.warmup_s = self.steps(self.args.warmup) or []

    def round(self) -> None:
        times = self.steps(self.args.steps)
        if times:
            self.result.round_medians.append(median(times))

    def finish(self) -> None:
        compiled = self._call(compile_report)
        memory = self._call(memory_report)
        if compiled is not None and memory is not None:
            self.result.graphs = max(c["graphs"] for c in compiled)
            self.result.recompiles = max(c["recompiles"] for c in compiled)
            self.result.peak_rss = max(m["peak_rss"] for m in memory)
            self.result.median_s = median(self.result.round_medians) if self.result.round_medians else None
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def measure(runners: list[Runner], rounds: int) -> None:
    """Build every system, then alternate: each round runs every system once, the order rotating."""
    for runner in runners:
        runner.launch()
    for runner in runners:
        runner.start()
    for index in range(rounds):
        for runner in rotated(runners, index):
            runner.round()
        current_run().sample()
        print(f"  round {index + 1}/{rounds} done", file=sys.stderr)
    for runner in runners:
        runner.finish()


# --- what the numbers say ----------------------------------------------------------------------------
def targets(results: list[Result], world_size: int) -> dict[str, Any]:
    """The issue's targets, from the medians of one run (``None`` where a system did not run)."""
    t = {r.system: r.median_s for r in results}

    def ratio(a: str, b: str) -> float | None:
        return t[a] / t[b] if t.get(a) and t.get(b) else None

    def kept(compiled: str, eager: str, plain_compiled: str, plain: str) -> float | None:
        mine, theirs = ratio(eager, compiled), ratio(plain, plain_compiled)
        if mine is None or theirs is None or theirs <= 1.0:
            return None
        return (mine - 1.0) / (theirs - 1.0)

    out: dict[str, Any] = {}
    if world_size == 1:
        out["compiled_vs_plain_compiled"] = ratio("chunkmem-compiled", "plain-compiled")
        out["speedup_plain"] = ratio("plain", "plain-compiled")
        out["speedup_chunkmem"] = ratio("chunkmem", "chunkmem-compiled")
        out["kept"] = kept("chunkmem-compiled", "chunkmem", "plain-compiled", "plain")
        out["speedup_budget"] = ratio("chunkmem-budget", "chunkmem-budget-compiled")
        out["kept_budget"] = kept("chunkmem-budget-compiled", "chunkmem-budget", "plain-compiled", "plain")
        out["met"] = {
            "at most 1.05x plain per-block compiled": _at_most(out["compiled_vs_plain_compiled"], 1.05),
            "keeps 80% of compile's speedup": _at_least(out["kept"], 0.8),
            "under a budget, keeps 80% of compile's speedup": _at_least(out["kept_budget"], 0.8),
        }
    else:
        out["compiled_vs_fsdp2_compiled"] = ratio("chunkmem-compiled", "fsdp2-compiled")
        out["speedup_fsdp2"] = ratio("fsdp2", "fsdp2-compiled")
        out["speedup_chunkmem"] = ratio("chunkmem", "chunkmem-compiled")
        out["met"] = {"no slower than FSDP2 compiled": _at_most(out["compiled_vs_fsdp2_compiled"], 1.0)}
    return out


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _at_least(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def loss_checks(results: list[Result], world_size: int) -> dict[str, bool]:
    """At W=1 (fp32, the CPU): whether chunkmem trained to the same losses as plain PyTorch computing
    the same way (eager, or with the same blocks compiled), bit for bit."""
    losses = {r.system: r.losses for r in results if r.state == "ok" and r.losses}
    pairs = (
        [
            ("chunkmem", "plain"),
            ("chunkmem-compiled", "plain-compiled"),
            ("chunkmem-budget", "plain"),
            ("chunkmem-budget-compiled", "plain-compiled"),
        ]
        if world_size == 1
        else []
    )
    return {f"{a} == {b}": losses[a] == losses[b] for a, b in pairs if a in losses and b in losses}


def loss_gaps(results: list[Result]) -> dict[str, float]:
    """The largest relative difference of the losses of pairs that compute differently: a compiled
    system and its eager twin (Inductor fuses and rounds otherwise), chunkmem and FSDP2 at two
    ranks (other reduction orders)."""
    losses = {r.system: r.losses for r in results if r.state == "ok" and r.losses}
    pairs = [*TWINS.items(), ("chunkmem", "fsdp2"), ("chunkmem-compiled", "fsdp2-compiled")]
    return {
        f"{a} vs {b}": max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b], strict=True))
        for a, b in pairs
        if a in losses and b in losses
    }


HEADERS = [
    "arch",
    "system",
    "state",
    "median step s",
    "round medians s",
    "vs eager",
    "first step s",
    "graphs",
    "peak RSS/rank",
    "last loss",
    "note",
]


def table_rows(results: list[Result]) -> list[list[str]]:
    """One row per system and architecture, the columns ``HEADERS`` names."""
    rows = []
    for r in results:
        spread = f"{min(r.round_medians):.3f}-{max(r.round_medians):.3f}" if r.round_medians else "-"
        eager = next((x for x in results if x.arch == r.arch and x.system == TWINS.get(r.system)), None)
        speedup = f"{eager.median_s / r.median_s:.2f}x" if eager and eager.median_s and r.median_s else "-"
        rows.append(
            [
                r.arch,
                r.system,
                r.state,
                f"{r.median_s:.3f}" if r.median_s is not None else "-",
                spread,
                speedup,
                f"{r.warmup_s[0]:.1f}" if r.warmup_s else "-",
                "-" if r.graphs is None else f"{r.graphs} ({r.recompiles} recompiles)",
                fmt_bytes(r.peak_rss),
                f"{r.losses[-1]:.6f}" if r.losses else "-",
                r.note[:60],
            ]
        )
    return rows


def report(results: list[Result], title: str) -> None:
    print(title)
    print_table(HEADERS, table_rows(results), align=["<", "<", "<", ">", ">", ">", ">", ">", ">", ">", "<"])


def _ratio_line(arch: str, goals: dict[str, Any]) -> str:
    shown = ", ".join(f"{k} {v:.2f}" for k, v in goals.items() if k != "met" and v is not None)
    met = ", ".join(f"{k}: {_verdict(v)}" for k, v in goals["met"].items())
    return f"{arch}: {shown}; targets: {met}."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=1, choices=[1, 2])
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma separated: gpt2, llama (default both)")
    parser.add_argument("--systems", default=None, help="comma separated (default: every system for the world size)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--dynamic", choices=["none", "true", "false"], default="none")
    parser.add_argument("--budget-frac", type=float, default=0.5, help="chunkmem-budget: of 16 bytes a parameter")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one command may take on a system")
    parser.add_argument("--name", default=None, help="file name for the JSON (default compile_w<W>)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.archs = [a for a in args.arch.split(",") if a]
    unknown = sorted(set(args.archs) - set(ARCHS))
    if unknown:
        parser.error(f"unknown --arch {unknown}; choose from {', '.join(ARCHS)}")
    if torch.cuda.is_available():
        parser.error("this benchmark runs on the CPU (gloo); on a GPU machine hide the GPUs: CUDA_VISIBLE_DEVICES=")
    args.group_backend = "gloo"
    args.dynamic = {"none": None, "true": True, "false": False}[args.dynamic]
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    args.name = args.name or f"compile_w{args.world_size}"
    return args


def main(argv: list[str] | None = None) -> None:
    begin_run(__file__, argv)
    args = parse_args(argv)
    known = systems(args.budget_frac)
    names = args.systems.split(",") if args.systems else DEFAULTS[args.world_size]
    chosen = [known[n] for n in names if known[n].check(args.world_size) is None]
    skipped = [n for n in names if known[n].check(args.world_size) is not None]
    for name in skipped:
        print(f"note: skipping {name}: {known[name].check(args.world_size)}")
    results: list[Result] = []
    titles = []
    for arch in args.archs:
        setup = CompileSetup(GPT2Shape(args.layers, args.width, args.vocab, args.seq), args.batch, "fp32", arch=arch)
        setup = dataclasses.replace(setup, backend=args.backend, dynamic=args.dynamic)
        title = (
            f"{setup.describe()}, batch {args.batch}x{args.seq} per rank, fp32 AdamW, W={args.world_size} on cpu, "
            f"{args.threads} thread(s)/rank, backend {args.backend}; {args.rounds} rounds x {args.steps} steps"
        )
        print(title, file=sys.stderr)
        titles.append(title)
        runners = [Runner(system, args, setup) for system in chosen]
        measure(runners, args.rounds)
        results += [r.result for r in runners]
    by_arch = {arch: [r for r in results if r.arch == arch] for arch in args.archs}
    checks = {arch: loss_checks(rs, args.world_size) for arch, rs in by_arch.items()}
    gaps = {arch: loss_gaps(rs) for arch, rs in by_arch.items()}
    goals = {arch: targets(rs, args.world_size) for arch, rs in by_arch.items()}
    report(results, "; ".join(titles))
    for arch in args.archs:
        shown = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks[arch].items())
        if shown:
            print(f"{arch}: losses equal: {shown}")
        print(f"{arch}: largest relative loss gap: " + ", ".join(f"{k}: {v:.1e}" for k, v in gaps[arch].items()))
        met = ", ".join(
            f"{k}: {'-' if v is None else ('met' if v else 'MISSED')}" for k, v in goals[arch]["met"].items()
        )
        print(f"{arch}: targets: {met}")
    load = current_run()
    if load.busy():
        print(f"note: the machine was busy (1-minute load up to {load.peak_load():.1f} on {os.cpu_count()} cores)")
    payload = {
        "titles": titles,
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": machine(),
        "loss_checks": checks,
        "loss_gaps": gaps,
        "targets": goals,
        "results": [asdict(r) for r in results],
        "summary_table": {
            "headers": HEADERS,
            "rows": table_rows(results),
            "note": " ".join(
                [
                    *(t + "." for t in titles),
                    "Medians over rounds of each round's median step; 'vs eager': the speedup over the same "
                    "system uncompiled; 'first step': the step that traces and compiles.",
                    *(_ratio_line(arch, goals[arch]) for arch in args.archs),
                    *(
                        f"{arch}: losses bit for bit: "
                        + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks[arch].items())
                        + "."
                        for arch in args.archs
                        if checks[arch]
                    ),
                ]
            ),
        },
    }
    print(f"wrote {write_json(args.name, payload, args.out_dir)}")


if __name__ == "__main__":
    main()
