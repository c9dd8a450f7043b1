"""How far a forward op's gather and a gradient travel through chunkmem: the chunkmem files and
calls on the stack when the op's all-gather is issued, and, for a gradient, when its reduction
is issued (in the backward) and when the user's optimizer steps it (in ``optimizer.step``).

Two ranks (gloo) train a small GPT-2 sharded, with the default static placement; the second step's
first all-gather, gradient reduction and inner optimizer step are recorded (the first step records
the trace). A gradient's walk is the files of both stacks together. Counts, not times: they are the
same on every machine, and issue 47 sets the targets: an op reaches its all-gather through at most
8 files, a gradient reaches the step through at most 11.

    python benchmarks/walks.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, gpt2_model, print_table, token_batches, write_json
from benchmarks.workers import RankContext, RankPool

TARGETS = {"op to its all-gather": 8, "gradient to the step": 11}
_VOCAB, _SEQ = 256, 32


def _chain() -> list[str]:
    """``file:function`` of each chunkmem frame on the caller's stack, outermost first."""
    frames = traceback.extract_stack()[:-2]
    return [f"{f.filename.split('/chunkmem/')[1]}:{f.name}" for f in frames if "/chunkmem/" in f.filename]


def _record(ctx: RankContext) -> dict[str, list[str]]:
    import torch
    import torch.distributed as dist

    from chunkmem import Booster, ChunkPlugin
    from chunkmem.placement import StaticPlacementConfig

    seen: dict[str, list[str]] = {}

    def spy(name: str, real: Any, large_only: bool = False) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not large_only or args[0].numel() > 1024:  # a gradient's, not a check's few numbers
                seen.setdefault(name, _chain())
            return real(*args, **kwargs)

        return wrapped

    # Installed before boosting: the communicator takes its collectives when it is made.
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, spy("all-gather", getattr(dist, name)))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, spy("reduction", getattr(dist, name)))
    dist.all_reduce = spy("reduction", dist.all_reduce, large_only=True)  # gloo reduces by all-reduce
    torch.manual_seed(0)
    model = gpt2_model(2, 64, _VOCAB, _SEQ)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inner.step = spy("step", inner.step)  # type: ignore[method-assign]
    booster = Booster(ChunkPlugin(placement=StaticPlacementConfig(), precision="fp32", chunk_size=16_384))
    chunked, optimizer, *_ = booster.boost(model, inner)
    for ids in token_batches(2, 2 * ctx.world_size, _SEQ, _VOCAB):
        seen.clear()
        local = ids.chunk(ctx.world_size)[ctx.rank]
        loss = chunked(input_ids=local, labels=local).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return seen


def _files(*chains: list[str]) -> list[str]:
    files: list[str] = []
    for chain in chains:
        for frame in chain:
            path = frame.split(":")[0]
            if path not in files:
                files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where walks.json goes")
    args = parser.parse_args(argv)
    begin_run(__file__, argv)
    pool = RankPool(2)
    try:
        stacks = pool.call(300.0, _record)[0]
    finally:
        pool.close()
    walks = {
        "op to its all-gather": (stacks["all-gather"],),
        "gradient to the step": (stacks["reduction"], stacks["step"]),
    }
    rows, entries = [], []
    for walk, chains in walks.items():
        files = _files(*chains)
        calls = sum(len(chain) for chain in chains)
        met = len(files) <= TARGETS[walk]
        rows.append([walk, calls, len(files), TARGETS[walk], "yes" if met else "no", ", ".join(files)])
        entries.append(
            {"walk": walk, "calls": calls, "files": files, "target_files": TARGETS[walk], "met": met, "stacks": chains}
        )
    headers = ["walk", "calls", "files", "target", "met", "the files, outermost first"]
    print_table(headers, rows)
    note = (
        "chunkmem frames on the stack when the second step's first all-gather, gradient reduction and inner "
        "optimizer step are issued, two ranks (gloo), a GPT-2 of 2 layers sharded with the static placement; a "
        "gradient's files are those of its reduction's stack and its step's together."
    )
    summary = {"headers": headers, "rows": rows, "note": note}
    write_json("walks", {"walks": entries, "summary_table": summary}, args.out_dir)
    return 0 if all(entry["met"] for entry in entries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
