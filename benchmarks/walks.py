"""How far a forward op's gather and a gradient travel through chunkmem: the chunkmem files and
calls on the stack when the op's all-gather is issued, and, for a gradient, when its reduction
is issued (in the backward) and when the user's optimizer steps it (in ``optimizer.step``). And
the trip of a sharded optimizer checkpoint's load (``booster.load_optimizer`` of a directory): the
chunkmem calls the checkpoint code makes and those into it, traced, counted as the rooms they visit
(files), the climbs back up (a call into a file already further out on the stack: a callback), and
the ways into the optimizer state's checks (``optim/state_dict.py``: the functions called there).

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
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, gpt2_model, print_table, token_batches, write_json
from benchmarks.workers import RankContext, RankPool

TARGETS = {"op to its all-gather": 8, "gradient to the step": 11}
_STATE_CHECKS = "optim/state_dict.py"
LOAD_WALK = "a sharded optimizer load"
_VOCAB, _SEQ = 256, 32


def _chain() -> list[str]:
    """``file:function`` of each chunkmem frame on the caller's stack, outermost first."""
    frames = traceback.extract_stack()[:-2]
    return [f"{f.filename.split('/chunkmem/')[1]}:{f.name}" for f in frames if "/chunkmem/" in f.filename]


class _Trip:
    """The chunkmem calls the checkpoint code makes, and those into it, while it is installed
    (``sys.setprofile``, this thread): the files they visit (a room each), the climbs back up (a
    call into a file already further out on the stack: a callback) and the entries into each file
    (a call into it from another). What the rooms do inside (a shard's reads, a piece's fields) is
    theirs, not the trip's. A way in or a climb is counted once however many times it is taken (a
    reader's call per tensor is one way into the layout code)."""

    _TRIP = ("booster.py", "checkpoint/")

    def __init__(self) -> None:
        self.calls = 0
        self.files: list[str] = []
        self.climbs: list[str] = []
        self.entries: dict[str, list[str]] = {}  # a file's ways in: the functions called from another file
        self._stack: list[str] = []  # the file of each chunkmem frame on the stack, outermost first

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return") or "/chunkmem/" not in frame.f_code.co_filename:
            return
        path = frame.f_code.co_filename.split("/chunkmem/")[1]
        if event == "return":
            if self._stack:
                self._stack.pop()
            return
        caller = self._stack[-1] if self._stack else None
        self._stack.append(path)
        if path == caller or not (path.startswith(self._TRIP) or (caller or "").startswith(self._TRIP)):
            return
        self.calls += 1
        way = f"{caller} -> {path}:{frame.f_code.co_name}"
        ways = self.entries.setdefault(path, [])
        if frame.f_code.co_name not in ways:
            ways.append(frame.f_code.co_name)
        if path in self._stack[:-1] and way not in self.climbs:
            self.climbs.append(way)
        if path not in self.files:
            self.files.append(path)


def _record(ctx: RankContext, directory: str) -> dict[str, Any]:
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
    walks: dict[str, Any] = dict(seen)
    booster.save_optimizer(optimizer, directory, shard=True)
    trip = _Trip()
    sys.setprofile(trip)
    try:
        booster.load_optimizer(optimizer, directory)
    finally:
        sys.setprofile(None)
    walks["load"] = {"files": trip.files, "climbs": trip.climbs, "entries": trip.entries, "calls": trip.calls}
    return walks


def _climbs(chain: list[str]) -> list[str]:
    """The calls of a stack (outermost first) into a file already further out on it."""
    climbs = []
    for depth in range(1, len(chain)):
        path, caller = chain[depth].split(":")[0], chain[depth - 1].split(":")[0]
        if path != caller and path in (frame.split(":")[0] for frame in chain[:depth]):
            climbs.append(f"{caller} -> {chain[depth]}")
    return climbs


def _ways_into(chain: list[str], path: str) -> set[str]:
    """The functions of ``path`` that a stack (outermost first) enters from another file."""
    return {
        frame.split(":")[1]
        for depth, frame in enumerate(chain)
        if frame.split(":")[0] == path and (depth == 0 or chain[depth - 1].split(":")[0] != path)
    }


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
        with tempfile.TemporaryDirectory(prefix="chunkmem-walks-") as scratch:
            stacks = pool.call(300.0, _record, str(Path(scratch) / "optimizer"))[0]
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
        climbs = [climb for chain in chains for climb in _climbs(chain)]
        into_checks = len(set().union(*(_ways_into(chain, _STATE_CHECKS) for chain in chains)))
        rows.append(
            [walk, calls, len(files), TARGETS[walk], "yes" if met else "no", len(climbs), into_checks, ", ".join(files)]
        )
        entries.append(
            {
                "walk": walk,
                "calls": calls,
                "files": files,
                "target_files": TARGETS[walk],
                "met": met,
                "climbs": climbs,
                "stacks": chains,
            }
        )
    load = stacks["load"]
    into_checks = len(load["entries"].get(_STATE_CHECKS, []))
    files = ", ".join(load["files"])
    rows.append([LOAD_WALK, load["calls"], len(load["files"]), "-", "-", len(load["climbs"]), into_checks, files])
    entries.append({"walk": LOAD_WALK, **load})
    headers = [
        "walk",
        "calls",
        "files",
        "target",
        "met",
        "climbs back up",
        f"ways into {_STATE_CHECKS}",
        "the files, in the order first visited",
    ]
    print_table(headers, rows)
    note = (
        "chunkmem frames on the stack when the second step's first all-gather, gradient reduction and inner "
        "optimizer step are issued, two ranks (gloo), a GPT-2 of 2 layers sharded with the static placement; a "
        "gradient's files are those of its reduction's stack and its step's together. The load is the chunkmem "
        "calls from and into the checkpoint code in booster.load_optimizer of that optimizer's sharded directory on "
        "rank 0, on the calling thread, traced with sys.setprofile. A climb back up is a call into a file already "
        "further out on the stack (a callback); a way in is a function called from another file."
    )
    summary = {"headers": headers, "rows": rows, "note": note}
    write_json("walks", {"walks": entries, "summary_table": summary}, args.out_dir)
    return 0 if all(entry.get("met", True) for entry in entries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
