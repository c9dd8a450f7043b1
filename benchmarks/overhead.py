"""Step-time overhead of chunkmem against plain PyTorch in one process, world size 1, everything resident.

GPT-2 (4 layers, width 256, batch 4 x 128 by default) trained with the same ``torch.optim.AdamW``
(same hyperparameters, the default kernel on both sides) from the same weights on the same data.
The two alternate step by step, and which of them goes first alternates too, so both see the same
machine state; the medians are compared and the losses must agree. Target: chunkmem <= 1.15x plain.
For the same comparison in separate processes (and against other systems) see ``peers.py
--world-size 1``.

    python benchmarks/overhead.py [--steps 20] [--precision fp32]
    python benchmarks/overhead.py --layers 24 --width 128 --chunk-size 20000 \\
        --variants static,static-prefetch2,auto-prefetch2   # bookkeeping of prefetch and auto
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DTYPES,
    RESULTS,
    begin_run,
    default_device,
    gpt2_model,
    machine,
    median,
    print_table,
    timed,
    token_batches,
    write_json,
)
from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

WARMUP = 3


VARIANTS = {
    "static": lambda: StaticPlacementConfig(),
    "static-prefetch1": lambda: StaticPlacementConfig(max_prefetch=1),
    "static-prefetch2": lambda: StaticPlacementConfig(max_prefetch=2),
    "auto": lambda: AutoPlacementConfig(),
    "auto-prefetch2": lambda: AutoPlacementConfig(max_prefetch=2),
}


def main(argv: list[str] | None = None) -> None:
    begin_run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help=f"measured steps per side (after {WARMUP} warmup steps)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    parser.add_argument(
        "--variants",
        default="static",
        help=f"comma separated chunkmem placements, each against plain PyTorch ({', '.join(VARIANTS)})",
    )
    parser.add_argument("--name", default="overhead", help="file name for the JSON")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")

    device = default_device()
    dtype = DTYPES[args.precision]
    base = gpt2_model(args.layers, args.width, args.vocab, args.seq)
    plain = copy.deepcopy(base).to(device)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    data = [b.to(device) for b in token_batches(args.steps + WARMUP, args.batch, args.seq, args.vocab)]
    losses: dict[str, list[float]] = {"plain": []}

    def plain_step(ids: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
        losses["plain"].append(loss.item())

    steps = {"plain": plain_step}
    chunk_counts: dict[str, int] = {}
    for variant in variants:
        model = copy.deepcopy(base)
        booster = Booster(
            ChunkPlugin(placement=VARIANTS[variant](), precision=args.precision, chunk_size=args.chunk_size)
        )
        chunked, optim, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        chunk_counts[variant] = len(chunked.manager.chunks)
        losses[variant] = []

        def chunk_step(ids: torch.Tensor, chunked=chunked, optim=optim, booster=booster, variant=variant) -> None:
            loss = chunked(input_ids=ids, labels=ids).loss
            booster.backward(loss, optim)
            optim.step()
            optim.zero_grad()
            losses[variant].append(loss.item())

        steps[variant] = chunk_step

    sides = list(steps)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for index, ids in enumerate(data):
        order = sides[index % len(sides) :] + sides[: index % len(sides)]  # rotate who goes first
        for side in order:
            elapsed = timed(lambda ids=ids, side=side: steps[side](ids), device)
            if index >= WARMUP:
                times[side].append(elapsed)
    medians = {side: median(times[side]) for side in sides}
    p = medians["plain"]
    print(
        f"GPT-2 {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq}, {args.precision}, "
        f"{device}, {max(chunk_counts.values())} chunks, {args.steps} steps (median)"
    )
    static = medians.get("static")
    rows = [["plain PyTorch", f"{p * 1e3:.1f}", "1.00", "", f"{losses['plain'][-1]:.6f}"]]
    for variant in variants:
        c = medians[variant]
        versus_static = f"{c / static:.3f}" if static is not None else ""
        rows.append(
            [f"chunkmem {variant}", f"{c * 1e3:.1f}", f"{c / p:.3f}", versus_static, f"{losses[variant][-1]:.6f}"]
        )
    print_table(["", "step time (ms)", "x plain", "x static", "final loss"], rows)
    tolerance = 1e-4 if args.precision == "fp32" else 3e-2
    for variant in variants:
        gap = max(abs(a - b) for a, b in zip(losses["plain"], losses[variant], strict=True))
        print(
            f"{variant}: largest loss difference over {len(data)} steps: {gap:.2e}"
            + ("" if gap <= tolerance * max(1.0, abs(losses["plain"][0])) else "  WARNING: the two do not train alike")
        )
    path = write_json(
        args.name,
        {
            "config": vars(args),
            "device": str(device),
            "machine": machine(),
            "chunks": chunk_counts,
            "step_ms": {side: [t * 1e3 for t in times[side]] for side in sides},
            "median_ms": {side: medians[side] * 1e3 for side in sides},
            "ratio_to_plain": {v: medians[v] / p for v in variants},
            "losses": losses,
        },
        args.out_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
