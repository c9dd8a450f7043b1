"""DPO's two models under one device budget: a LLaMA-shaped policy trained beside its frozen reference.

    python benchmarks/dpo.py                                   # the defaults below, a few minutes on a CPU
    python benchmarks/dpo.py --size 512x8 --budget-chunks 4,8,16 --rounds 5

Each step is a DPO step: the reference's log-probabilities of a chosen and a rejected sequence (under
``no_grad``), the policy's, the sigmoid DPO loss, backward and AdamW. Systems:

- ``plain``: plain PyTorch, both models resident (what TRL's ``DPOTrainer`` holds with a
  ``ref_model``): its reference forward is the "fully resident" time.
- ``chunkmem``: the policy boosted with the reference beside it (``booster.boost(policy, optimizer,
  frozen=reference)``) under each device budget of ``--budget-chunks`` (a number of the pair's
  chunks: every parameter, master and optimizer state offloaded, the device holding the gathered
  chunks and the prefetch), and with no budget (every chunk resident).
- ``chunkmem-no-prefetch``: the same budgets with ``max_prefetch=0``: each chunk is fetched when its
  op needs it, as a reference that is always offloaded and loaded on demand is.

Per system and budget: the peak of device and host bytes (chunkmem's ledger; for ``plain`` the
model state it holds resident, counted from the parameters: both models' fp32 weights, the policy's
gradients and AdamW moments), the reference forward's time against plain's, the step time, and the
losses (chunkmem's equal plain's, bit for bit, in fp32 on one rank). Times are medians over
``--rounds`` rounds (the systems alternate, round by round) of each round's median step after the
first (which records the trace); the spread is the lowest and highest round median.

Then the largest pair that trains under ``--fit-budget``: for each size of ``--fit-sizes``, whether
plain PyTorch's resident model state fits it (counted) and whether chunkmem trains two steps under
it (run). The JSON goes to ``benchmarks/results/dpo.json``, the plot to ``dpo.png``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chunkmem import Booster, ChunkPlugin, StaticPlacementConfig
from chunkmem.errors import BudgetTooSmallError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RESULTS,
    begin_run,
    current_run,
    default_device,
    fmt_bytes,
    machine,
    parse_bytes,
    print_table,
    pyplot,
    rotated,
    synchronize,
    write_json,
)

BETA = 0.1


def llama_pair(hidden: int, layers: int, vocab: int, seq: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A LLaMA-shaped policy (seeded) and its reference: a copy taken before training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=seq,
    )
    policy = LlamaForCausalLM(config)
    return policy, copy.deepcopy(policy)


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def plain_resident_bytes(policy_parameters: int, reference_parameters: int) -> int:
    """What plain PyTorch holds resident for the pair in fp32: the policy's weights, gradients and
    two AdamW moments (16 bytes a parameter) and the reference's weights (4)."""
    return 16 * policy_parameters + 4 * reference_parameters


def preference_batches(steps: int, batch: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
        for _ in range(steps)
    ]


def sequence_logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its tokens after the first."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    chosen, rejected = (policy_logps - reference_logps).chunk(2)
    return -F.logsigmoid(BETA * (chosen - rejected)).mean()


def run_system(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec['steps']`` DPO steps of one system at one budget: losses, per-step times, peaks."""
    hidden, layers = spec["size"]
    policy, reference = llama_pair(hidden, layers, spec["vocab"], spec["seq"])
    data = preference_batches(spec["steps"], spec["batch"], spec["seq"], spec["vocab"])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    out: dict[str, Any] = {"system": spec["system"], "budget": spec["budget"], "budget_chunks": spec["chunks"]}
    try:
        return {**out, **_train(spec, policy, reference, optimizer, data)}
    except BudgetTooSmallError as error:
        return {**out, "state": "budget too small", "error": str(error).splitlines()[0]}
    finally:
        gc.collect()


def _train(
    spec: dict[str, Any],
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Any]:
    booster = None
    out: dict[str, Any] = {}
    device = default_device()  # where chunkmem computes: plain PyTorch holds both models there
    if spec["system"] == "plain":
        policy.to(device)  # in place: the optimizer's parameters are the moved ones
        reference.to(device)
    else:
        offload = {"offload_param_frac": 1.0, "offload_optim_frac": 1.0} if spec["budget"] is not None else {}
        placement = StaticPlacementConfig(
            device_budget=spec["budget"], max_prefetch=0 if spec["system"] == "chunkmem-no-prefetch" else 2, **offload
        )
        booster = Booster(ChunkPlugin(placement=placement, precision="fp32", chunk_size=spec["chunk_size"]))
        policy, optimizer, *_ = booster.boost(policy, optimizer, frozen=reference)
        (reference,) = policy.frozen_models
    losses, reference_s, step_s = [], [], []
    for chosen, rejected in data:
        ids = torch.cat([chosen, rejected]).to(device)
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            reference_logps = sequence_logps(reference, ids)
        synchronize(device)
        reference_s.append(time.perf_counter() - start)
        loss = dpo_loss(sequence_logps(policy, ids), reference_logps)
        if booster is not None:
            booster.backward(loss, optimizer)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    out.update(state="ok", losses=losses, reference_s=reference_s, step_s=step_s)
    if booster is not None:
        stats = policy.stats()
        out.update(peak_device_bytes=stats.peak_device_bytes, peak_host_bytes=stats.peak_host_bytes)
    else:
        out.update(peak_device_bytes=plain_resident_bytes(parameters(policy), parameters(reference)))
        out.update(peak_host_bytes=None)
    return out


def _round_median(values: list[float]) -> float:
    return statistics.median(values[1:] or values)  # the first step records the trace


def summarise(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, budget): medians and spread over rounds, and the ratio to plain's reference forward."""
    groups: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for trial in trials:
        groups.setdefault((trial["system"], trial["budget"]), []).append(trial)
    plain = [_round_median(t["reference_s"]) for t in groups.get(("plain", None), []) if t["state"] == "ok"]
    plain_reference = statistics.median(plain) if plain else None
    rows = []
    for (system, budget), runs in groups.items():
        ok = [r for r in runs if r["state"] == "ok"]
        row: dict[str, Any] = {"system": system, "budget": budget, "budget_chunks": runs[0]["budget_chunks"]}
        if not ok:
            rows.append({**row, "state": runs[0]["state"], "error": runs[0].get("error")})
            continue
        reference = [_round_median(r["reference_s"]) for r in ok]
        step = [_round_median(r["step_s"]) for r in ok]
        row.update(
            state="ok",
            rounds=len(ok),
            reference_s=statistics.median(reference),
            reference_spread=[min(reference), max(reference)],
            step_s=statistics.median(step),
            step_spread=[min(step), max(step)],
            reference_vs_resident=None if plain_reference is None else statistics.median(reference) / plain_reference,
            peak_device_bytes=max(r["peak_device_bytes"] for r in ok),
            peak_host_bytes=None if ok[0]["peak_host_bytes"] is None else max(r["peak_host_bytes"] for r in ok),
            losses=ok[0]["losses"],
        )
        rows.append(row)
    return rows


def largest_pairs(args: argparse.Namespace) -> dict[str, Any]:
    """Under ``--fit-budget``: which sizes plain PyTorch's resident pair fits (counted) and which
    chunkmem trains (two steps run under the budget)."""
    budget = parse_bytes(args.fit_budget)
    sizes = []
    for size in args.fit_sizes:
        policy, reference = llama_pair(*size, args.vocab, args.seq)
        count = parameters(policy)
        del policy, reference
        plain_fits = plain_resident_bytes(count, count) <= budget
        spec = {
            "system": "chunkmem",
            "size": size,
            "budget": budget,
            "chunks": None,
            "steps": 2,
            "batch": args.batch,
            "seq": args.seq,
            "vocab": args.vocab,
            "chunk_size": args.fit_chunk_size,
        }
        run = run_system(spec)
        fits = run["state"] == "ok" and run["peak_device_bytes"] <= budget
        sizes.append(
            {
                "size": f"{size[0]}x{size[1]}",
                "parameters_per_model": count,
                "plain_resident_bytes": plain_resident_bytes(count, count),
                "plain_fits": plain_fits,
                "chunkmem_fits": fits,
                "chunkmem_peak_device_bytes": run.get("peak_device_bytes"),
                "chunkmem_state": run["state"],
            }
        )
        print(f"fit {size[0]}x{size[1]}: plain {'fits' if plain_fits else 'does not fit'}, chunkmem {run['state']}")
    plain_best = max((s["parameters_per_model"] for s in sizes if s["plain_fits"]), default=0)
    ours_best = max((s["parameters_per_model"] for s in sizes if s["chunkmem_fits"]), default=0)
    return {
        "budget": budget,
        "sizes": sizes,
        "largest_plain_parameters": plain_best,
        "largest_chunkmem_parameters": ours_best,
        "ratio": ours_best / plain_best if plain_best else None,
    }


def summary_table(rows: list[dict[str, Any]], fit: dict[str, Any], chunk_bytes: int) -> dict[str, Any]:
    headers = ["system", "budget", "peak device", "peak host", "ref forward", "vs resident", "step", "losses"]
    plain = next((r for r in rows if r["system"] == "plain" and r["state"] == "ok"), None)
    body = []
    for row in rows:
        budget = "none" if row["budget"] is None else f"{fmt_bytes(row['budget'])} ({row['budget_chunks']} chunks)"
        if row["state"] != "ok":
            body.append([row["system"], budget, "-", "-", "-", "-", "-", row["state"]])
            continue
        same = "-" if plain is None or row is plain else ("equal" if row["losses"] == plain["losses"] else "differ")
        ratio = row["reference_vs_resident"]
        counted = " (counted)" if row["system"] == "plain" else ""
        body.append(
            [
                row["system"],
                budget,
                fmt_bytes(row["peak_device_bytes"]) + counted,
                "-" if row["peak_host_bytes"] is None else fmt_bytes(row["peak_host_bytes"]),
                f"{row['reference_s'] * 1e3:.1f} ms",
                "-" if ratio is None else f"{ratio:.2f}x",
                f"{row['step_s'] * 1e3:.1f} ms",
                same,
            ]
        )
    ratio = fit["ratio"]
    note = (
        f"Chunks of {fmt_bytes(chunk_bytes)}. plain's peak device bytes are the model state it holds resident "
        "(counted); chunkmem's are its ledger's. Under a fit budget of "
        f"{fmt_bytes(fit['budget'])}: the largest pair plain PyTorch holds has "
        f"{fit['largest_plain_parameters'] / 1e6:.2f} M parameters a model, chunkmem's "
        f"{fit['largest_chunkmem_parameters'] / 1e6:.2f} M" + ("" if ratio is None else f" ({ratio:.1f}x)") + "."
    )
    if not torch.cuda.is_available():
        note += (
            " On a CPU a chunk's copy to the compute device is a memcpy that runs when it is issued: prefetch "
            "cannot overlap it with compute, so the no-prefetch rows time what the prefetch rows do; only a GPU "
            "shows what prefetch hides."
        )
    return {"headers": headers, "rows": body, "note": note}


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in ("chunkmem", "chunkmem-no-prefetch"):
        points = sorted(
            (r["budget"], r["reference_vs_resident"])
            for r in rows
            if r["system"] == system and r["state"] == "ok" and r["budget"] is not None and r["reference_vs_resident"]
        )
        if points:
            ax.plot([p[0] / 2**20 for p in points], [p[1] for p in points], marker="o", label=system)
    ax.axhline(1.5, linestyle="--", color="grey", label="target 1.5x")
    ax.set_xlabel("device budget (MiB)")
    ax.set_ylabel("reference forward / resident")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _size(text: str) -> tuple[int, int]:
    hidden, layers = text.split("x")
    return int(hidden), int(layers)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=_size, default=(256, 4), help="HIDDENxLAYERS of the policy (and reference)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="preference pairs a step")
    parser.add_argument("--steps", type=int, default=4, help="steps a round (the first records the trace)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=1 << 18, help="elements a chunk")
    parser.add_argument("--budget-chunks", default="4,8,16", help="device budgets, in chunks of the pair")
    parser.add_argument("--fit-budget", default="32MiB", help="the budget the largest pair is looked for under")
    parser.add_argument("--fit-sizes", default="128x2,256x2,256x4,384x6,512x8", help="HIDDENxLAYERS,...")
    parser.add_argument("--fit-chunk-size", type=int, default=1 << 18)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.budget_chunks = [int(c) for c in args.budget_chunks.split(",") if c]
    args.fit_sizes = [_size(s) for s in args.fit_sizes.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    begin_run(__file__, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk_bytes = 4 * args.chunk_size
    budgets: list[tuple[int | None, int | None]] = [(None, None)] + [(c * chunk_bytes, c) for c in args.budget_chunks]
    configs = [("plain", None, None)]
    for budget, chunks in budgets:
        configs.append(("chunkmem", budget, chunks))
        if budget is not None:
            configs.append(("chunkmem-no-prefetch", budget, chunks))
    common = {"size": args.size, "steps": args.steps, "batch": args.batch, "seq": args.seq, "vocab": args.vocab}
    trials = []
    for index in range(args.rounds):
        for system, budget, chunks in rotated(configs, index):
            spec = {**common, "system": system, "budget": budget, "chunks": chunks, "chunk_size": args.chunk_size}
            trials.append(run_system(spec))
        current_run().sample()
    rows = summarise(trials)
    fit = largest_pairs(args)
    table = summary_table(rows, fit, chunk_bytes)
    print_table(table["headers"], table["rows"])
    print(table["note"])
    payload = {
        "machine": machine(),
        "size": f"{args.size[0]}x{args.size[1]}",
        "chunk_bytes": chunk_bytes,
        "rows": rows,
        "trials": trials,
        "fit": fit,
        "summary_table": table,
    }
    path = write_json("dpo", payload, args.out_dir)
    plot(rows, args.out_dir / "dpo.png")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
