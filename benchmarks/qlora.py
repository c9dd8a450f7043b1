"""How large a 4-bit base a QLoRA fine-tune trains on this host: chunkmem with the NF4 base's packed
bytes and scales on disk, beside chunkmem with the 16-bit base on disk (``lora.py``'s) and plain PEFT
QLoRA (bitsandbytes' ``Linear4bit`` layers in memory).

Each system fine-tunes ``lora.py``'s LLaMA shape with the same PEFT LoRA adapter (``--rank``, on
``q_proj`` and ``v_proj``; AdamW over the adapter) for a few steps at each ``--sizes`` point, in a fresh
process whose peak resident set is read from the kernel:

* ``chunkmem-nf4-disk``: the model built on the meta device, its linear layers (all but the head)
  replaced by transformers' ``replace_with_bnb_linear`` (NF4, blocks of 64, fp32 scales, compute in
  bf16), ``get_peft_model`` inside the meta block; the boost quantizes each rank's pieces of every
  weight from the model's initialisation replayed (no checkpoint: a base larger than memory and than
  its 16-bit form on disk), the packed bytes and scales go to quantized chunks on disk (``--disk-dir``),
  each gather reads its shard and each op dequantizes;
* ``chunkmem-disk``: the 16-bit base on disk, as ``lora.py`` runs it;
* ``peft-qlora``: ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``
  from a 16-bit checkpoint of the same shape (saved first by another process, in ``--disk-dir``),
  trained in memory.

The two smallest points (same width, more layers) give each system's host bytes per base parameter
(the slope of peak RSS, and of the ledger's host bytes), its disk bytes per base parameter (the
slope of the ledger's disk bytes) and its working set (the intercept); the largest base on the
scratch disk is its free bytes at that slope. Per step: wall time, tokens per second, the disk bytes
read and written, and what the reads cost at the disk's sequential read bandwidth measured by ``dd``
(direct I/O) in the same run. With ``--verify HIDDENxLAYERS`` chunkmem trains that size with the NF4
base on disk, reporting the same, its peak resident set against the host budget. Prints tables,
writes JSON to ``--out-dir``; the scratch files are removed after each run.

    python benchmarks/qlora.py                                 # two small sizes a system
    python benchmarks/qlora.py --sizes 1024x4,1024x8 --verify 4096x32 --host-budget 4GiB \\
        --device-budget 4GiB --disk-dir /work/qlora_scratch --timeout 36000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import lora
from benchmarks.common import begin_run, current_run, fmt_bytes, machine, parse_bytes, peak_rss, print_table, write_json
from benchmarks.disk_tier import _dd, _size, add_run_arguments
from benchmarks.workers import run_in_fresh_process

SYSTEMS = ("chunkmem-nf4-disk", "chunkmem-disk", "peft-qlora")
_COUNTERS = (
    "disk_read_bytes",
    "disk_write_bytes",
    "disk_param_read_bytes",
    "disk_param_write_bytes",
    "disk_read_seconds",
)


def _nf4() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def _meta_qlora(cfg: Any, rank: int) -> Any:
    """The 4-bit model on the meta device, its layers in bf16 (what they are quantized from)."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.integrations import replace_with_bnb_linear

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # replace_with_bnb_linear makes its layers in the default dtype
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
            replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=_nf4())
            model.is_loaded_in_4bit = True  # as from_pretrained marks it: PEFT's 4-bit LoRA layers
            return lora._lora(model, rank)
    finally:
        torch.set_default_dtype(default)


def _quantized_parameters(model: Any) -> int:
    """Weights of the 4-bit layers (what the NF4 format stores at half a byte each, plus a 4-byte
    scale per 64)."""
    return sum(
        m.in_features * m.out_features
        for m in model.modules()
        if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")  # not PEFT's wrapper
    )


def _save_checkpoint(spec: dict[str, Any]) -> str:
    """The 16-bit base plain PEFT QLoRA loads, saved in this (fresh) process."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = lora.config(spec["hidden"], spec["layers"], spec["vocab"])
    LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(spec["checkpoint"])
    return spec["checkpoint"]


def _steps(spec: dict[str, Any], chunked: Any, optimizer: Any, booster: Any, ids: Any) -> list[dict[str, Any]]:
    steps = []
    for _ in range(spec["train_steps"]):
        before = chunked.stats()
        begin = time.perf_counter()
        booster.backward(chunked(input_ids=ids, labels=ids).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        after = chunked.stats()
        steps.append(
            {
                "seconds": time.perf_counter() - begin,
                **{name: getattr(after, name) - getattr(before, name) for name in _COUNTERS},
                "peak_host_bytes": after.peak_host_bytes,
                "disk_bytes": after.disk_bytes,
                "quantized_bytes": after.quantized_bytes,
            }
        )
    return steps


def _on_disk(spec: dict[str, Any]) -> Any:
    """Everything on disk between uses (the base's chunks and the adapter's optimizer side), under
    ``spec``'s budgets: ``lora.py``'s placement of its base on disk."""
    from chunkmem.placement import StaticPlacementConfig

    return StaticPlacementConfig(
        offload_optim_frac=1.0,
        offload_param_frac=1.0,
        offload_disk_frac=1.0,
        offload_param_disk_frac=1.0,
        device_budget=spec["device_budget"],
        host_budget=spec["host_budget"],
        max_prefetch=1,
    )


def _planned(spec: dict[str, Any]) -> dict[str, Any]:
    """``chunkmem.plan`` of one disk system at one size (its model on the meta device; nothing is
    allocated), in this (fresh) process: whether a LoRA step fits the host budget, and the bytes the
    base takes on disk."""
    import torch
    from transformers import LlamaForCausalLM

    from chunkmem import ChunkPlugin, plan

    cfg = lora.config(spec["hidden"], spec["layers"], spec["vocab"])
    if spec["system"] == "chunkmem-nf4-disk":
        model = _meta_qlora(cfg, spec["rank"])
    else:
        with torch.device("meta"):
            model = lora._lora(LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16), spec["rank"])
    ids = torch.zeros(spec["batch"], spec["seq"], dtype=torch.long)
    began = time.perf_counter()
    planned = plan(
        model,
        ChunkPlugin(placement=_on_disk(spec), precision="bf16", chunk_size=spec["chunk_size"]),
        {"input_ids": ids, "labels": ids},
        optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4),
        steps=2,
        device="cpu",
    )
    return {
        **spec,
        "base_parameters": lora._base_parameters(model),
        "quantized_parameters": _quantized_parameters(model),
        "plan_seconds": time.perf_counter() - began,
        "fits": planned.fits,
        "why_not": planned.why_not,
        "disk_bytes": planned.disk_bytes_per_rank,
        "host_bytes": planned.host_bytes_per_rank,
        "peak_host_bytes": planned.peak_host_bytes,
        "min_host_budget": planned.min_host_budget,
        "disk_read_bytes_per_step": planned.disk_read_bytes_per_step,
    }


def _layers_for(parameters: int, hidden: int, vocab: int) -> int:
    """The most layers of ``lora.config``'s shape at width ``hidden`` whose base has at most
    ``parameters`` parameters (embeddings and head untied; per layer q, k, v, o, the MLP, two norms)."""
    cfg = lora.config(hidden, 1, vocab)
    kv = hidden // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * cfg.intermediate_size + 2 * hidden
    return max(1, (parameters - 2 * vocab * hidden - hidden) // per_layer)


def _trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One system at one size, in this (fresh) process."""
    if spec["system"] == "chunkmem-disk":
        return lora._trial(spec)
    import torch

    torch.set_num_threads(spec["threads"])
    cfg = lora.config(spec["hidden"], spec["layers"], spec["vocab"])
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))
    counted = _meta_qlora(cfg, spec["rank"])
    base = lora._base_parameters(counted)  # weights counted before packing
    spec = {**spec, "quantized_parameters": _quantized_parameters(counted)}
    baseline = peak_rss()
    torch.manual_seed(0)
    began = time.perf_counter()
    if spec["system"] == "peft-qlora":
        from transformers import LlamaForCausalLM

        model = lora._lora(
            LlamaForCausalLM.from_pretrained(
                spec["checkpoint"], quantization_config=_nf4(), device_map="cpu", dtype=torch.bfloat16
            ),
            spec["rank"],
        )
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        built = time.perf_counter() - began
        steps = []
        for _ in range(spec["train_steps"]):
            begin = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"seconds": time.perf_counter() - begin})
        return lora._result(spec, base, baseline, built, steps)
    from chunkmem import Booster, ChunkPlugin

    model = _meta_qlora(cfg, spec["rank"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    plugin = ChunkPlugin(
        placement=_on_disk(spec), precision="bf16", chunk_size=spec["chunk_size"], disk_dir=spec["disk_dir"]
    )
    booster = Booster(plugin)
    chunked, optimizer, *_ = booster.boost(model, optimizer)
    built = time.perf_counter() - began
    return lora._result(spec, base, baseline, built, _steps(spec, chunked, optimizer, booster, ids))


def _run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    scratch = Path(spec["disk_dir"]) / f"{spec['system']}-{spec['hidden']}x{spec['layers']}"
    scratch.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "disk_dir": str(scratch), "checkpoint": str(scratch / "checkpoint")}
    try:
        if spec["system"] == "peft-qlora":
            state, value = run_in_fresh_process(_save_checkpoint, spec, timeout)
            if state != "ok":
                return {**spec, "state": f"failed saving its checkpoint: {value[:200]}"}
        state, value = run_in_fresh_process(_trial, spec, timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if state != "ok":
        return {**spec, "state": f"failed: {value[:200]}"}
    return {**value, "state": "ok"}


def _summary(system: str, runs: list[dict[str, Any]], ram: int, usable_disk: int) -> dict[str, Any]:
    fit = lora._fit_base(runs)
    entry: dict[str, Any] = {
        "host_bytes_per_base_parameter": None if fit is None else fit[0],
        "working_set_bytes": None if fit is None else fit[1],
        "largest_base_parameters_in_ram": None if fit is None or fit[0] <= 0 else int((ram - fit[1]) / fit[0]),
    }
    accounted = lora._fit_accounted(runs, "peak_host_bytes")
    if accounted is not None:
        entry["accounted_host_bytes_per_base_parameter"] = accounted[0]
    on_disk = lora._fit_accounted(runs, "disk_bytes")
    if on_disk is not None and on_disk[0] > 0:
        entry["disk_bytes_per_base_parameter"] = on_disk[0]
        entry["host_and_disk_bytes_per_base_parameter"] = on_disk[0] + max(0.0, accounted[0] if accounted else 0.0)
        entry["largest_base_parameters_on_disk"] = int((usable_disk - on_disk[1]) / on_disk[0])
    quantized = lora._fit_accounted(runs, "quantized_bytes")
    if quantized is not None:
        entry["quantized_bytes_per_base_parameter"] = quantized[0]
    ok = [r for r in runs if r["state"] == "ok" and r["steps"] and "quantized_bytes" in r["steps"][-1]]  # chunkmem's
    if ok:  # the 4-bit layers' bytes in chunks (padding included) per weight they store, at the largest size
        largest = max(ok, key=lambda r: r["base_parameters"])
        entry["quantized_bytes_per_quantized_parameter"] = (
            largest["steps"][-1]["quantized_bytes"] / largest["quantized_parameters"]
        )
    return entry


def _with_plan(entry: dict[str, Any], planned: dict[str, Any], usable_disk: int) -> None:
    """The planner's bytes per base parameter at the planned size (where the embeddings and the
    head, left in 16 bits, are a small share, and each tensor group's chunk padding is what a run
    of that size pads), and the largest base on this disk at that rate."""
    if "fits" not in planned:
        return
    per = (planned["disk_bytes"] + planned["host_bytes"]) / planned["base_parameters"]
    entry["planned_host_and_disk_bytes_per_base_parameter"] = per
    entry["largest_base_parameters_on_disk_planned"] = int(usable_disk / per)


def _step_figures(run: dict[str, Any], read_bps: float | None) -> list[str]:
    """A run's steady step (its last): seconds, tokens per second, disk bytes read, what ``dd``
    reads that in."""
    steps = run.get("steps") or []
    last = steps[-1] if steps else {}
    read = last.get("disk_read_bytes")
    return [
        f"{last['seconds']:.2f} s" if last else "-",
        f"{last['tokens_per_second']:.1f}" if last else "-",
        fmt_bytes(read) if read is not None else "-",
        f"{read / read_bps:.2f} s" if read is not None and read_bps else "-",
    ]


def _summary_table(
    trials: dict[str, list[dict[str, Any]]],
    summary: dict[str, Any],
    planned: dict[str, dict[str, Any]],
    verify: dict[str, Any] | None,
    read_bps: float | None,
    host_budget: int | None,
) -> dict[str, Any]:
    """The benchmarks page's table: per system, bytes per base parameter (measured slopes), the
    largest base on this disk (analytic, from the slope) and the planner's verdict on it, and the
    largest trial's step; then the verify run."""

    def per_parameter(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = []
    for system, runs in trials.items():
        entry, plan_of = summary.get(system, {}), planned.get(system)
        largest = entry.get("largest_base_parameters_on_disk_planned", entry.get("largest_base_parameters_on_disk"))
        verdict = "-"
        if plan_of is not None:
            verdict = (
                f"{plan_of['base_parameters'] / 1e9:.1f} B ({plan_of['hidden']}x{plan_of['layers']}): "
                f"{'fits' if plan_of.get('fits') else 'does not fit'}, "
                f"host peak {fmt_bytes(plan_of.get('peak_host_bytes'))}, disk {fmt_bytes(plan_of.get('disk_bytes'))}"
            )
        biggest = max((r for r in runs if r["state"] == "ok"), key=lambda r: r["base_parameters"], default=None)
        rows.append(
            [
                system,
                per_parameter(entry.get("host_bytes_per_base_parameter")),
                per_parameter(entry.get("disk_bytes_per_base_parameter")),
                per_parameter(entry.get("host_and_disk_bytes_per_base_parameter")),
                per_parameter(entry.get("planned_host_and_disk_bytes_per_base_parameter")),
                per_parameter(entry.get("quantized_bytes_per_quantized_parameter")),
                "-" if largest is None else f"{largest / 1e9:.1f} B",
                verdict,
                "-" if biggest is None else f"{biggest['hidden']}x{biggest['layers']}",
                *(_step_figures(biggest, read_bps) if biggest is not None else ["-"] * 4),
            ]
        )
    if verify is not None and verify.get("state") == "ok":
        rows.append(
            [
                f"{verify['system']} (verify)",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"trained {verify['base_parameters'] / 1e9:.2f} B: peak RSS {fmt_bytes(verify['peak_rss'])} "
                f"(host budget {fmt_bytes(host_budget) if host_budget else 'none'})",
                f"{verify['hidden']}x{verify['layers']}",
                *_step_figures(verify, read_bps),
            ]
        )
    ratio = summary.get("nf4_over_16bit_on_disk_planned", summary.get("nf4_over_16bit_on_disk"))
    note = (
        "Measured B/param: slopes between the two trained sizes (host: peak RSS; disk: the ledger's disk bytes; "
        "small models, so chunk padding moves them). Planned B/param: chunkmem.plan's host and disk bytes over "
        "the base's parameters at the planned size (meta device, nothing allocated). 4-bit B/weight: the "
        "quantized chunks' bytes (padding included) per weight of the 4-bit layers, measured. Largest base on "
        "disk: the scratch disk's free bytes less the reserve at the planned rate (analytic), and the planner's "
        "verdict on a base of that size under the host budget. Targets: at most 0.6 host and disk bytes a base "
        "parameter; the largest NF4 base at least 3x the 16-bit one's "
        f"(here: {'-' if ratio is None else f'{ratio:.2f}x'})."
    )
    headers = [
        "system",
        "measured host B/param",
        "measured disk B/param",
        "host+disk B/param",
        "planned B/param",
        "4-bit B/weight",
        "largest base on disk",
        "planner / run",
        "step at",
        "step",
        "tokens/s",
        "disk read/step",
        "read at dd",
    ]
    return {"headers": headers, "rows": rows, "note": note}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    begin_run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sizes", default="256x2,256x4", help="model sizes, HIDDENxLAYERS,... (two or more)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--verify", type=_size, default=None, help="train this size with the NF4 base on disk")
    parser.add_argument(
        "--plan-hidden",
        type=int,
        default=None,
        help="at this width, plan (chunkmem.plan, on the meta device) the largest base each disk system fits on disk",
    )
    parser.add_argument(
        "--plan-parameters",
        type=float,
        default=None,
        help="plan a base of about this many parameters instead (default: the largest each disk system fits)",
    )
    parser.add_argument(
        "--disk-reserve", type=parse_bytes, default=8 * 2**30, help="free disk left out of the largest base's room"
    )
    parser.add_argument("--resummarize", type=Path, default=None, help="recompute this results file's summary only")
    add_run_arguments(parser, "qlora_scratch")
    args = parser.parse_args(argv)
    if args.resummarize is not None:
        return resummarize(args.resummarize)
    import psutil

    ram = args.ram or psutil.virtual_memory().total
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    dd = _dd(args.disk_dir, args.dd_mib)
    read_bps = dd.get("read_bytes_per_second")
    base = lora.trial_base(args)
    trials = lora.run_trials(args, base, _run_trial, lambda: current_run().sample())
    free_disk = shutil.disk_usage(args.disk_dir).free
    usable = max(0, free_disk - args.disk_reserve)
    summary = {system: _summary(system, runs, ram, usable) for system, runs in trials.items()}
    print_table(lora.HEADERS, [lora._row(run, read_bps) for runs in trials.values() for run in runs])
    for system, entry in summary.items():
        slope = entry["host_bytes_per_base_parameter"]
        if slope is not None:
            largest = entry["largest_base_parameters_in_ram"]
            fits = f"{largest / 1e9:.2f} B base parameters fit in {fmt_bytes(ram)}" if largest else "no RAM limit"
            print(f"{system}: {slope:.3f} host bytes a base parameter (peak RSS), {fits}")
        if "disk_bytes_per_base_parameter" in entry:
            host = entry.get("accounted_host_bytes_per_base_parameter", 0.0)
            print(
                f"{system}: {entry['disk_bytes_per_base_parameter']:.3f} disk bytes and "
                f"{host:.3f} accounted host bytes a base parameter "
                f"({entry['host_and_disk_bytes_per_base_parameter']:.3f} in all): "
                f"{entry['largest_base_parameters_on_disk'] / 1e9:.2f} B fit in the {fmt_bytes(usable)} free "
                f"beyond the {fmt_bytes(args.disk_reserve)} reserve"
            )
    ratio = _ratio(summary, "largest_base_parameters_on_disk")
    if ratio is not None:
        print(f"the largest NF4 base on this disk is {ratio:.2f}x the largest 16-bit one")
    print("dd: " + ", ".join(f"{k} {fmt_bytes(v)}/s" for k, v in dd.items()))
    planned: dict[str, dict[str, Any]] = {}
    if args.plan_hidden is not None:
        for system in [s for s in ("chunkmem-nf4-disk", "chunkmem-disk") if s in trials]:
            largest = args.plan_parameters or summary.get(system, {}).get("largest_base_parameters_on_disk")
            if not largest:
                continue
            layers = _layers_for(int(largest), args.plan_hidden, args.vocab)
            spec = {**base, "system": system, "hidden": args.plan_hidden, "layers": layers}
            state, value = run_in_fresh_process(_planned, spec, args.timeout)
            planned[system] = value if state == "ok" else {**spec, "state": f"failed: {value[:200]}"}
            print(f"plan of {system} at {args.plan_hidden}x{layers}: " + _plan_line(planned[system], usable))
            _with_plan(summary[system], planned[system], usable)
            current_run().sample()
        ratio = _ratio(summary, "largest_base_parameters_on_disk_planned")
        if ratio is not None:
            print(f"planned: the largest NF4 base on this disk is {ratio:.2f}x the 16-bit one")
    payload: dict[str, Any] = {
        "machine": machine(),
        "ram": ram,
        "free_disk": free_disk,
        "disk_reserve": args.disk_reserve,
        "dd": dd,
        "trials": trials,
        "summary": summary,
        "planned": planned,
    }
    verify = None
    if args.verify is not None:
        hidden, layers = args.verify
        spec = {**base, "system": "chunkmem-nf4-disk", "hidden": hidden, "layers": layers}
        verify = _run_trial(spec, args.timeout)
        payload["verify"] = verify
        print(f"\nchunkmem, NF4 base on disk, {hidden}x{layers}: {verify['state']}")
        print_table(lora.HEADERS, [lora._row(verify, read_bps)])
        if verify["state"] == "ok":
            budget = args.host_budget
            last = verify["steps"][-1]
            print(
                f"peak RSS {fmt_bytes(verify['peak_rss'])} ({fmt_bytes(verify['peak_rss'] - verify['baseline_rss'])} "
                f"over the process before building), host budget {fmt_bytes(budget) if budget else 'none'}; base "
                f"{verify['base_parameters'] / 1e9:.2f} B parameters, {fmt_bytes(verify['base_bf16_bytes'])} in bf16 "
                f"({verify['base_bf16_bytes'] / ram:.2f}x RAM), {fmt_bytes(last['quantized_bytes'])} quantized, "
                f"{fmt_bytes(last['disk_bytes'])} on disk in all"
            )
    payload.update(_summarize(payload, args.host_budget))
    write_json("qlora", payload, args.out_dir)
    return payload


def _ratio(summary: dict[str, Any], key: str) -> float | None:
    """The largest NF4 base over the largest 16-bit one by ``key``, noted in ``summary``."""
    four, sixteen = summary.get("chunkmem-nf4-disk", {}), summary.get("chunkmem-disk", {})
    if key not in four or key not in sixteen:
        return None
    summary[f"nf4_over_16bit_{key.removeprefix('largest_base_parameters_')}"] = four[key] / sixteen[key]
    return four[key] / sixteen[key]


def _summarize(payload: dict[str, Any], host_budget: int | None) -> dict[str, Any]:
    """A run's summary and the benchmarks page's table, from its trials, plans and verify run."""
    usable = max(0, payload["free_disk"] - payload["disk_reserve"])
    trials, planned = payload["trials"], payload["planned"]
    summary = {system: _summary(system, runs, payload["ram"], usable) for system, runs in trials.items()}
    for system, plan_of in planned.items():
        _with_plan(summary[system], plan_of, usable)
    for key in ("largest_base_parameters_on_disk", "largest_base_parameters_on_disk_planned"):
        _ratio(summary, key)
    read_bps = payload["dd"].get("read_bytes_per_second")
    table = _summary_table(trials, summary, planned, payload.get("verify"), read_bps, host_budget)
    return {"summary": summary, "summary_table": table}


def _nf4_runs(payload: dict[str, Any]) -> list[dict[str, Any]]:
    runs = [*payload["trials"].get("chunkmem-nf4-disk", []), payload.get("verify") or {}]
    runs.append(payload["planned"].get("chunkmem-nf4-disk") or {})
    return [r for r in runs if "hidden" in r and r.get("system") == "chunkmem-nf4-disk"]


def resummarize(path: Path) -> dict[str, Any]:
    """Recompute the summary and table of results file ``path`` from its own trials, plans and
    verify run (after this script's summary changed); its ``meta`` (the run's date, command and
    machine) is kept and the recompute noted in ``summary_recomputed``."""
    payload = json.loads(path.read_text())
    for run in _nf4_runs(payload):  # a count of the shape alone (an earlier version counted PEFT's wrappers too)
        run["quantized_parameters"] = _quantized_parameters(
            _meta_qlora(lora.config(run["hidden"], run["layers"], run["vocab"]), run["rank"])
        )
    host_budget = next((r.get("host_budget") for runs in payload["trials"].values() for r in runs), None)
    payload.update(_summarize(payload, host_budget))
    payload["summary_recomputed"] = current_run().meta()
    path.write_text(json.dumps(payload, indent=2, default=str))
    return payload


def _plan_line(planned: dict[str, Any], usable: int) -> str:
    if "fits" not in planned:
        return planned.get("state", "failed")
    room = "within" if planned["disk_bytes"] <= usable else "beyond"
    return (
        f"{planned['base_parameters'] / 1e9:.2f} B base parameters, "
        f"{'fits' if planned['fits'] else 'does not fit: ' + planned['why_not']}; host peak "
        f"{fmt_bytes(planned['peak_host_bytes'])} (min host budget {fmt_bytes(planned['min_host_budget'])}), "
        f"disk {fmt_bytes(planned['disk_bytes'])} ({room} the {fmt_bytes(usable)} usable), planned in "
        f"{planned['plan_seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
