"""The longest sequence that trains under a fixed device budget, and its step time, for each way of
holding activations: plain PyTorch, plain PyTorch with Hugging Face gradient checkpointing, FSDP2
with checkpointing, chunkmem keeping, recomputing or offloading every block's saved activations,
and chunkmem placing them under its own device budget (``chunkmem-auto``: kept, offloaded or
recomputed per call; ``chunkmem-auto-outside`` also offloads what is saved outside the blocks, in
its ledger; ``benchmarks/activation_systems.py`` has the recipes).

For each model and system the sequence grows along ``--seqs`` (batch ``--batch``) until a length
does not fit; each length trains ``--warmup`` untimed steps and ``--steps`` timed ones (median
reported) on the same batches for every system, continuing the same model.

**On a GPU** (``--device cuda``) the device is the card capped at ``--cap-gib`` with
``torch.cuda.set_per_process_memory_fraction``: a length fits when its steps run without
``torch.OutOfMemoryError``. chunkmem-auto gets the cap less a quarter of it as its
``device_budget`` (``activation_runs.AUTO_GPU_HEADROOM``: what its ledger does not account is not
known before a length runs), built again at each length as on the CPU. Reported with it: the
allocator's peak (``max_memory_allocated``), the saved-activation meter below and chunkmem's
counters. bf16 compute for every system (plain:
fp32 weights under autocast; FSDP2: ``MixedPrecisionPolicy``, with ``CPUOffloadPolicy`` in
``fsdp2-offload-ckpt``, the GPU default, since its fp32 model data would not fit the cap either;
chunkmem: ``precision="bf16"``, fp32 masters).

**On a CPU** (the default) the host is the device, so the device figures are the ledger's, against
a budget of ``--budget`` bytes, fp32 everywhere. A length fits when model data + saved activations
<= the budget, where

* *model data* is, for chunkmem, ``stats().peak_device_bytes`` (accounted chunk memory on the
  device; for chunkmem-auto also the blocks' saved activations while they are on the device: kept
  calls', offloaded calls' until their copies out are done and once fetched back, and the small
  storages an offloaded call keeps); for plain PyTorch and FSDP2 (world size 1, no offload) 16 bytes a parameter (fp32
  weights, gradients and AdamW's two moments), what they hold on the device;
* *saved activations* is the peak over a step of the live bytes of the storages autograd saves
  for the backward outside the placed blocks' own hooks, each storage once, parameters and views
  of them left out (``benchmarks/saved_meter.py``), plus what the blocks hold on the device that
  such a meter cannot see: for a checkpointed or recomputed block, the bytes one block call saves
  when kept (its recomputation during its backward; measured with the same meter on the plain
  model at that length); for an offloaded block, the ``1 + max_prefetch`` block calls copied back
  for the backward (``stats().activation_h2d_bytes`` per step / blocks per step each); for
  chunkmem-auto, whose hooks sit nearer the op than the meter's (so the meter sees only what is
  saved outside the blocks) and whose ledger holds its kept and offloaded calls, one block call's
  bytes when kept where its plan recomputes a call (the recomputation, not in its ledger), else
  nothing. Saved tensors the static offload keeps inside a block because they are under
  ``min_offload_bytes`` (1 KiB), activation gradients and other transient working memory are not
  counted.

The static chunkmem rows get the least ``device_budget`` their placement accepts: their activations
are outside chunkmem's budget, in the benchmark's ledger only. chunkmem-auto needs a budget that
covers its activations: at each length it gets ``--budget`` less what the benchmark's ledger adds to
its own (the bytes the plain model saves outside the blocks at that length, measured with the same
meter), so that both ledgers answer to the same budget as every other row. Its plan is made from its
first step and a step that saves more is refused, so it is built again at each length from the
initial weights (its losses at a length are the initial model's on that length's batches). Where its
plan recomputes and the total is over ``--budget`` by no more than the recomputation (which its
budget had reserved, and the benchmark adds as for chunkmem-recompute), the length is trained once
more with that much less budget. Its step time is compared with the fastest static chunkmem choice
that fits the same length.

The ledger adds two peaks that need not coincide (gradient buffers grow in the backward as saved
activations are freed): an upper bound of what the device holds at once.

    python -m benchmarks.activations                                # CPU ledger, GPT-2 and LLaMA 4x256, minutes
    python -m benchmarks.activations --device cuda --out-dir out    # GPT-2 1.5B, 1k-8k, 20 GiB cap, ~4 min
    python -m benchmarks.activations --device cuda --models gpt2-medium   # 350M, 1k-32k: plain PyTorch fits

On a GPU every system runs in a process of its own (``--isolate``): an out-of-memory error leaves
tensors and cached blocks behind that would count against the next system's cap.

Prints each length as it finishes, then a table of every row and the longest sequence per system;
writes ``activations.json`` (rewritten after every system, so a run cut short keeps what it measured)
and ``activations.png`` to ``--out-dir``. ``--time-limit`` skips what is left once it has passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.activation_runs import RunSettings, headers, row_cells, row_line, system_process
from benchmarks.activation_systems import SYSTEMS, Recipe, parse_shape
from benchmarks.common import RESULTS, begin_run, fmt_bytes, format_table, machine, parse_bytes, write_json
from benchmarks.workers import run_in_fresh_process

CPU_SYSTEMS = (
    "chunkmem-keep,chunkmem-offload,chunkmem-recompute,chunkmem-auto,chunkmem-auto-outside,plain,plain-ckpt,fsdp2-ckpt"
)
# On a GPU, in the order a time limit should cut last: chunkmem's keep and offload and the plain
# references first (the comparison), FSDP2 last.
GPU_SYSTEMS = "chunkmem-keep,chunkmem-offload,chunkmem-auto,plain,plain-ckpt,chunkmem-recompute,fsdp2-offload-ckpt"
GPU_SEQS = {"gpt2-xl": "1024,2048,4096,8192", "gpt2-medium": "1024,2048,4096,8192,16384,32768"}
CPU_SEQS = "128,256,512,1024,2048,4096"
REFERENCE = "plain-ckpt"
STATIC_CHOICES = ("chunkmem-keep", "chunkmem-offload", "chunkmem-recompute")
"""What chunkmem-auto's step time is compared with: the fastest of these that fits the same length."""


def summarize(rows: list[dict[str, Any]], models: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model and system: the longest length that fits and its step time (``every_length_fits``
    when it is the longest tried: the limit is beyond), against plain PyTorch with HF checkpointing;
    per model, offload's step time against keep's where both fit, and auto's against the fastest
    static chunkmem choice that fits the same length."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        per_model = out.setdefault(row["model"], {"systems": {}, "offload_vs_keep": {}, "auto_vs_best_static": {}})
        entry = per_model["systems"].setdefault(
            row["system"], {"longest": 0, "step_ms": None, "complete": True, "every_length_fits": False}
        )
        if row.get("fits") and row["seq"] > entry["longest"]:
            entry.update(longest=row["seq"], step_ms=row["step_ms"])
            entry["every_length_fits"] = row["seq"] == max(models[row["model"]]["seqs"])
        if row["state"] == "skipped":
            entry["complete"] = False  # cut by the time limit: the longest may be longer
    for model, per_model in out.items():
        systems = per_model["systems"]
        reference = systems.get(REFERENCE, {}).get("longest")
        for entry in systems.values():
            entry["vs_plain_ckpt"] = None if not reference else entry["longest"] / reference
        fitting = {(r["system"], r["seq"]): r["step_ms"] for r in rows if r["model"] == model and r.get("fits")}
        for (system, seq), ms in fitting.items():
            if system == "chunkmem-offload" and ("chunkmem-keep", seq) in fitting:
                per_model["offload_vs_keep"][seq] = ms / fitting["chunkmem-keep", seq]
            statics = [(fitting[s, seq], s) for s in STATIC_CHOICES if (s, seq) in fitting]
            if system == "chunkmem-auto" and statics:
                fastest, name = min(statics)
                per_model["auto_vs_best_static"][seq] = {"ratio": ms / fastest, "best": name}
    return out


def summary_lines(summary: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[Any]], list[str]]:
    rows, notes = [], []
    for model, per_model in summary.items():
        for system, entry in per_model["systems"].items():
            longest = f">={entry['longest']}" if entry["every_length_fits"] else entry["longest"] or "none"
            cut = "" if entry["complete"] else " (time limit)"
            ratio = "-" if entry["vs_plain_ckpt"] is None else f"{entry['vs_plain_ckpt']:.1f}x"
            step = "-" if entry["step_ms"] is None else f"{entry['step_ms']:.1f}"
            rows.append([model, system, f"{longest}{cut}", step, ratio])
        reference = per_model["systems"].get(REFERENCE)
        best = max(per_model["systems"].items(), key=lambda kv: kv[1]["longest"], default=None)
        if reference is not None and best is not None and best[0].startswith("chunkmem"):
            at_least = "at least " if best[1]["every_length_fits"] else ""
            if reference["every_length_fits"]:
                notes.append(f"{model}: {best[0]} and {REFERENCE} both train every length tried")
            elif reference["longest"]:
                notes.append(
                    f"{model}: longest trainable sequence {at_least}{best[1]['longest']} ({best[0]}) vs "
                    f"{reference['longest']} ({REFERENCE}): {at_least}{best[1]['longest'] / reference['longest']:.1f}x"
                )
            else:
                notes.append(f"{model}: {best[0]} trains {best[1]['longest']}; {REFERENCE} trains no length tried")
        for seq, ratio in sorted(per_model["offload_vs_keep"].items()):
            notes.append(f"{model}: chunkmem-offload step time {ratio:.2f}x chunkmem-keep's at {seq}")
        for seq, versus in sorted(per_model["auto_vs_best_static"].items()):
            notes.append(
                f"{model}: chunkmem-auto step time {versus['ratio']:.2f}x the fastest static choice that fits at "
                f"{seq} ({versus['best']})"
            )
    return ["model", "system", "longest seq", "step ms there", f"vs {REFERENCE}"], rows, notes


def plot(rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Per model: the longest length per system (left), step time against length (right)."""
    from benchmarks.common import pyplot

    plt = pyplot()
    if plt is None or not summary:
        return None
    fig, axes = plt.subplots(len(summary), 2, figsize=(12, 3.6 * len(summary)), squeeze=False)
    for (model, per_model), (left, right) in zip(summary.items(), axes, strict=True):
        names = list(per_model["systems"])
        bars = left.barh(names, [per_model["systems"][n]["longest"] for n in names])
        for bar, name in zip(bars, names, strict=True):
            entry = per_model["systems"][name]
            label = f">={entry['longest']}" if entry["every_length_fits"] else str(entry["longest"] or "none")
            left.annotate(
                label + ("" if entry["complete"] else " (time limit)"),
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        left.set_xlabel("longest sequence that fits")
        left.set_title(model)
        left.invert_yaxis()
        for name in names:
            points = [
                (r["seq"], r["step_ms"]) for r in rows if r["model"] == model and r["system"] == name and r.get("fits")
            ]
            if points:
                right.plot(*zip(*points, strict=True), marker="o", label=name)
        right.set_xscale("log", base=2)
        right.set_xlabel("sequence length")
        right.set_ylabel("step ms (median)")
        if right.get_lines():
            right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", default=None, help="presets or family:LxW (CPU: gpt2-cpu,llama-cpu; CUDA: gpt2-xl)")
    parser.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size for every model (default: the preset's)"
    )
    parser.add_argument("--systems", default=None, help=f"CPU: {CPU_SYSTEMS}; CUDA: {GPU_SYSTEMS}")
    parser.add_argument("--seqs", default=None, help=f"lengths to try, ascending (CPU: {CPU_SEQS}; CUDA: per model)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", default="160MiB", help="CPU: the device budget of the ledger")
    parser.add_argument("--cap-gib", type=float, default=20.0, help="CUDA: the card's memory for this process")
    parser.add_argument(
        "--chunkmem-budget",
        default="min",
        help="chunkmem's device_budget for model data: min (the least its placement accepts), none, or bytes",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at each length")
    parser.add_argument("--steps", type=int, default=None, help="timed steps at each length (default: CPU 2, CUDA 3)")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1)")
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each system in a process of its own (default on CUDA, where an out-of-memory error leaves the card "
        "dirty for the next system; on the CPU nothing runs out, the ledger decides)",
    )
    parser.add_argument("--time-limit", type=float, default=None, help="seconds (default: CPU 900, CUDA 210)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    args.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    names = (args.models or ("gpt2-xl" if cuda else "gpt2-cpu,llama-cpu")).split(",")
    try:
        shapes = [parse_shape(n, args.vocab) for n in names]
    except ValueError as error:
        parser.error(str(error))
    args.shapes = shapes
    args.preset_of = dict(zip(shapes, names, strict=True))
    given, args.seqs = args.seqs, {}
    for shape, name in zip(shapes, names, strict=True):
        text = given or (GPU_SEQS.get(name, "1024,2048,4096,8192") if cuda else CPU_SEQS)
        args.seqs[shape] = sorted(int(x) for x in text.split(","))
    args.max_seq = {shape: max(seqs) for shape, seqs in args.seqs.items()}
    args.system_names = (args.systems or (GPU_SYSTEMS if cuda else CPU_SYSTEMS)).split(",")
    for name in args.system_names:
        if name not in SYSTEMS:
            parser.error(f"--systems: unknown system {name!r} ({', '.join(SYSTEMS)})")
    args.steps = args.steps or (3 if cuda else 2)
    args.isolate = cuda if args.isolate is None else args.isolate
    args.time_limit = args.time_limit or (210.0 if cuda else 900.0)
    args.budget = None if cuda else parse_bytes(args.budget)
    chunk_budget = {"min": "min", "none": None}.get(args.chunkmem_budget)
    if chunk_budget is None and args.chunkmem_budget != "none":
        chunk_budget = parse_bytes(args.chunkmem_budget)
    args.recipe = Recipe(args.device, "bf16" if cuda else "fp32", chunkmem_budget=chunk_budget)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    begin_run(__file__, argv)
    args = parse_args(argv)
    started = time.time()
    cuda = args.device.type == "cuda"
    settings = RunSettings(
        args.recipe,
        args.batch,
        args.warmup,
        args.steps,
        deadline=started + args.time_limit,
        budget=args.budget,
        cap_bytes=int(args.cap_gib * 2**30) if cuda else None,
        threads=args.threads or 1,
    )
    if cuda:
        where = f"{torch.cuda.get_device_name(args.device)} capped at {fmt_bytes(settings.cap_bytes)}"
    else:
        where = f"CPU ledger, budget {fmt_bytes(args.budget)}, {settings.threads} thread(s)"
    print(
        f"activations: {where}; batch {args.batch}; {args.warmup} warmup + {args.steps} timed steps a length",
        flush=True,
    )
    payload: dict[str, Any] = {"machine": machine(), "where": where}
    payload["settings"] = {
        **{k: getattr(args, k) for k in ("batch", "warmup", "steps", "cap_gib", "budget", "time_limit")},
        "precision": args.recipe.precision,
        "chunkmem_budget": args.recipe.chunkmem_budget,
        "systems": args.system_names,
    }
    payload["models"] = {
        s.name: {"preset": args.preset_of[s], **dataclasses.asdict(s), "seqs": args.seqs[s]} for s in args.shapes
    }
    rows: list[dict[str, Any]] = []
    # FSDP2 last, after every model's other systems: the peer a time limit should cut first.
    late = [n for n in args.system_names if n.startswith("fsdp2")]
    for names in ([n for n in args.system_names if n not in late], late):
        for shape in args.shapes:
            for name in names:
                spec = {
                    "shape": shape,
                    "preset": args.preset_of[shape],
                    "system": name,
                    "seqs": args.seqs[shape],
                    "settings": settings,
                    "started": started,
                }
                if args.isolate:  # what an out-of-memory error leaves on the card goes with the process
                    state, value = run_in_fresh_process(system_process, spec, max(30.0, settings.left() + 60.0))
                else:
                    state, value = "ok", system_process(spec)
                if state == "ok":
                    rows += value
                else:
                    row = {"model": shape.name, "preset": spec["preset"], "system": name, "seq": spec["seqs"][0]}
                    rows.append({**row, "state": "failed", "note": str(value)[:300], "fits": False})
                    print(row_line(rows[-1], cuda, started), flush=True)
                write_json("activations", {**payload, "rows": rows}, args.out_dir)
    summary = summarize(rows, payload["models"])
    print()
    print(format_table(headers(cuda), [row_cells(r, cuda) for r in rows]))
    print()
    heads, body, notes = summary_lines(summary)
    print(format_table(heads, body))
    for note in notes:
        print(note)
    result = {**payload, "rows": rows, "summary": summary, "notes": notes}
    write_json("activations", result, args.out_dir)
    picture = plot(rows, summary, args.out_dir / "activations.png")
    if picture is not None:
        print(f"plot: {picture}")
    return result


if __name__ == "__main__":
    main()
