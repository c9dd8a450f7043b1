"""QLoRA (issue 45): a frozen base in bitsandbytes' 4-bit NF4 format, its packed bytes and scales in
chunks (placed, evicted, sharded and put on disk like any chunk, dequantized by each op), a LoRA
adapter trained over it in chunks of its own.

Against plain PEFT QLoRA over the same NF4 base, the same adapter init and data, in chunkmem's
mixed-precision recipe (``qlora_models.plain_qlora``): the arithmetic is the same (bitsandbytes'
kernels on the same bytes), so losses and the adapter are equal bit for bit, at one and two ranks,
with the base resident, evicted under a budget and on disk; the base's quantized bytes never change
and are those of plain bitsandbytes (a hash over them); the ledger holds exactly what the layers'
shapes say a 4-bit base stores (half a byte a weight and a 4-byte scale per 64), and its peak stays
under the budget. Both ways in: a base loaded quantized (bitsandbytes' API, or ``from_pretrained``
with a ``BitsAndBytesConfig``) and a base quantized at boost from its 16-bit checkpoint (the bytes
``from_pretrained`` quantizes, each rank reading only its slices). The saved adapter loads in plain
PEFT over a plain QLoRA base and gives the same outputs; a kill and resume is the uninterrupted
run. What cannot be kept is refused naming the format and the fix, before anything changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from models import batches
from qlora_models import (
    adamw,
    analytic_quantized_bytes,
    base_16bit,
    digest,
    meta_qlora,
    plain_qlora,
    pretrained_qlora,
    quantize_linears,
    quantized_entries,
    quantized_llama,
    save_16bit,
    train,
)
from test_peft import adapter_files

from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.usage.accounting import Location, MemoryKind

pytest.importorskip("bitsandbytes")  # the test extra installs it

STEPS = 3
BUDGET = 60_000  # below the model's chunks: the base's chunks are evicted and gathered again every step
ON_DISK = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0, offload_param_disk_frac=1.0
)
PLACEMENTS = {
    "resident": lambda: StaticPlacementConfig(),
    "auto-budget": lambda: AutoPlacementConfig(device_budget=BUDGET),
    "base-on-disk": lambda: ON_DISK,
}
SLOW = pytest.mark.slow


def _boost(model: Any, placement: str, disk_dir: Path | None, weights: Path | None = None) -> tuple[Any, Any, Any]:
    plugin = ChunkPlugin(
        placement=PLACEMENTS[placement](), precision="bf16", disk_dir=disk_dir if placement == "base-on-disk" else None
    )
    booster = Booster(plugin)
    chunked, optimizer, *_ = booster.boost(model, adamw(model), weights=weights)
    return chunked, optimizer, booster


def _quantized_report(chunked: Any) -> dict[str, Any]:
    """What the ledger and the chunks say of the quantized base on this rank."""
    manager = chunked.manager
    ledger = manager.ledger
    chunks = [c for c in manager.chunks if c.quantized]
    return {
        "stored": sum(info.numel * c.compute_dtype.itemsize for c in chunks for info in c.tensors),
        "capacity": sum(c.capacity * c.compute_dtype.itemsize for c in chunks),
        "shards": sum(c.shard_numel * c.compute_dtype.itemsize for c in chunks),
        "ledger": {where.value: ledger.bytes(where, MemoryKind.QUANTIZED) for where in Location},
        "dtypes": sorted({str(c.compute_dtype) for c in chunks}),
        "trainable_quantized": any(c.trainable for c in chunks),
        "peak_device": chunked.stats().peak_device_bytes,
        "evictions": chunked.stats().evictions,
        "quantized_bytes": chunked.stats().quantized_bytes,
    }


def _assert_budgets(report: dict[str, Any], placement: str, analytic: int, world_size: int) -> None:
    assert report["dtypes"] == ["torch.float32", "torch.uint8"], report  # packed bytes, fp32 scales: as stored
    assert not report["trainable_quantized"]
    # The chunks hold exactly what the layers' shapes say a 4-bit base stores (the rest is padding:
    # in a model this small, a third), and this rank keeps its shard of them, nothing more.
    assert report["stored"] == analytic, report
    assert report["shards"] * world_size == report["capacity"] < 1.5 * analytic, report
    assert sum(report["ledger"].values()) == report["shards"] == report["quantized_bytes"], report
    if placement == "base-on-disk":  # nothing of the base in memory between uses
        assert report["ledger"]["disk"] == report["shards"] and report["ledger"]["host"] == 0, report
    if placement == "auto-budget":
        assert report["peak_device"] <= BUDGET and report["evictions"] > 0, report


@pytest.mark.parametrize("placement", ["auto-budget", "base-on-disk", pytest.param("resident", marks=SLOW)])
def test_qlora_trains_like_plain_peft_qlora_bit_for_bit(placement: str, tmp_path: Path) -> None:
    data = batches(STEPS)
    model = quantized_llama()
    base_before = digest(quantized_entries(model.state_dict()))
    analytic = analytic_quantized_bytes(model)
    chunked, optimizer, booster = _boost(model, placement, tmp_path)
    losses = train(chunked, optimizer, booster, data)
    expected, reference, masters = plain_qlora(quantized_llama, data)
    assert losses == [step[0] for step in expected]
    state = chunked.state_dict()
    for name, master in masters.items():
        assert torch.equal(state[name], master), name
    # The base: the bytes plain bitsandbytes holds, unchanged by training (state_dict gathers them).
    assert digest(quantized_entries(state)) == base_before == digest(quantized_entries(reference.state_dict()))
    _assert_budgets(_quantized_report(chunked), placement, analytic, 1)


def _adapter_outputs(directory: Path) -> torch.Tensor:
    """The logits of plain PEFT loading the adapter in ``directory`` onto a plain QLoRA base."""
    import peft

    model = peft.PeftModel.from_pretrained(quantize_linears(base_16bit()), directory).eval()
    with torch.no_grad():
        return model(input_ids=batches(1, seed=7)[0]).logits


def assert_same_adapter(saved: Path, expected: Path) -> None:
    """The files plain PEFT writes, with the same tensors; loaded by plain PEFT over a plain
    bitsandbytes base, they give the same outputs."""
    (meta, tensors), (expected_meta, expected_tensors) = adapter_files(saved), adapter_files(expected)
    assert meta == expected_meta
    assert tensors.keys() == expected_tensors.keys()
    for name, value in expected_tensors.items():
        assert torch.equal(tensors[name], value), name
    assert torch.equal(_adapter_outputs(saved), _adapter_outputs(expected))


def _two_ranks(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Both ways in at two ranks: a base loaded quantized, on disk; a base quantized at boost from
    its 16-bit checkpoint (each rank quantizing its pieces), evicted under a budget."""
    data = batches(STEPS)
    results: dict[str, Any] = {}
    for way, build, placement, weights in (
        ("loaded", quantized_llama, "base-on-disk", None),
        ("at boost", lambda: meta_qlora(Path(out) / "base"), "auto-budget", Path(out) / "base"),
    ):
        chunked, optimizer, booster = _boost(build(), placement, Path(out), weights)
        losses = train(chunked, optimizer, booster, data, rank, world_size)
        state = chunked.state_dict()
        results[way] = {
            "losses": losses,
            "adapter": {k: v for k, v in state.items() if "lora_" in k},
            "base": digest(quantized_entries(state)),
            "report": _quantized_report(chunked),
        }
        if way == "loaded":
            chunked.save_pretrained(Path(out) / "adapter")  # every rank calls; rank 0 writes
    return results


@SLOW
@pytest.mark.multirank
def test_qlora_at_two_ranks_equals_plain_peft_qlora_both_ways_in(tmp_path: Path) -> None:
    directory = save_16bit(tmp_path / "base")
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),))
    data = batches(STEPS)
    references = {
        "loaded": plain_qlora(quantized_llama, data, world_size=2),
        "at boost": plain_qlora(lambda: pretrained_qlora(directory, draw_b=False), data, world_size=2),
    }
    analytic = analytic_quantized_bytes(quantized_llama())
    for way, (expected, reference, masters) in references.items():
        base = digest(quantized_entries(reference.state_dict()))
        for rank, result in enumerate(results):
            run = result[way]
            assert run["losses"] == [step[rank] for step in expected], (way, rank)
            for name, master in masters.items():
                assert torch.equal(run["adapter"][name], master), (way, rank, name)
            assert run["base"] == base, (way, rank)  # the bytes bitsandbytes quantized, unchanged
            _assert_budgets(run["report"], "base-on-disk" if way == "loaded" else "auto-budget", analytic, 2)
        if way == "loaded":  # plain PEFT saves its fp32 masters
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    if name in masters:
                        p.data = masters[name].detach()
            reference.save_pretrained(tmp_path / "plain")
            assert_same_adapter(tmp_path / "adapter", tmp_path / "plain")
