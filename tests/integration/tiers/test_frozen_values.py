"""Frozen chunks that hold only their 16-bit values (issue 32): a LoRA base in bf16 computed in bf16
keeps no fp32 master, no gradient shard and no optimizer state anywhere: 2 bytes per base element
on disk or in host memory, where placement puts it. Byte counts are analytic (from the chunks'
element counts), losses and adapter weights equal plain PEFT bit for bit, and the planner predicts
the run's host and disk bytes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import batches
from support.param_disk_helpers import CHUNK, IN_RAM, ON_DISK, boosted, train_counted
from support.peft_helpers import STEPS, assert_same_adapter, assert_same_states, lora_model, plain_peft

from chunkmem import ChunkPlugin, plan
from chunkmem.placement import StaticPlacementConfig
from chunkmem.tiers.disk import DISK_BLOCK
from chunkmem.usage.accounting import Location, MemoryKind

PLACEMENTS = {"on-disk": ON_DISK, "in-ram": IN_RAM}
ADAM = 4 + 4 + 4 + 4  # per trainable element: fp32 master, fp32 gradient, exp_avg, exp_avg_sq


def bf16_base(model: torch.nn.Module) -> torch.nn.Module:
    """The frozen base in bf16, the adapters in fp32 (what PEFT's autocast_adapter_dtype does)."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


def rounded_base() -> torch.nn.Module:
    """Plain PEFT's model: the same values, the base's rounded to bf16, every parameter fp32."""
    model = bf16_base(lora_model())
    for p in model.parameters():
        p.data = p.data.float()
    return model


def scratch_size(out: str, rank: int) -> int:
    (sides,) = Path(out).glob(f".chunkmem-scratch-*-rank{rank}/sides.bin")
    return sides.stat().st_size


def _run(rank: int, world_size: int, placement: str, out: str) -> dict[str, Any]:
    chunked, optimizer, booster = boosted(bf16_base(lora_model()), PLACEMENTS[placement], "bf16", out)
    chunks = chunked.manager.chunks
    ledger = chunked.manager.ledger
    losses, stats = train_counted(chunked, optimizer, booster, batches(STEPS), rank, world_size)
    result = {
        "losses": losses,
        "state": chunked.state_dict(),
        "frozen": sum(c.layout.shard_numel for c in chunks if not c.layout.trainable),
        "trainable": sum(c.layout.shard_numel for c in chunks if c.layout.trainable),
        "trainable_params": sum(len(c.layout.tensors) for c in chunks if c.layout.trainable),
        "chunks": len(chunks),
        "bytes": {(w, k): ledger.bytes(w, k) for w in (Location.HOST, Location.DISK) for k in MemoryKind},
        "scratch": scratch_size(out, rank) if placement == "on-disk" else 0,
        "host_bytes": stats[-1].host_bytes,
        "disk_bytes": stats[-1].disk_bytes,
        "param_reads": [b.disk_param_read_bytes - a.disk_param_read_bytes for a, b in itertools.pairwise(stats)],
        "param_writes": [b.disk_param_write_bytes - a.disk_param_write_bytes for a, b in itertools.pairwise(stats)],
    }
    if placement == "on-disk":  # checkpoints of such chunks: one file at one rank, sharded at two
        chunked.save_pretrained(Path(out) / "adapter")
        booster.save_model(chunked, Path(out) / "model", shard=world_size > 1)
        booster.save_optimizer(optimizer, Path(out) / "optim", shard=world_size > 1)
        more = batches(2, seed=5)
        result["after"] = train_counted(chunked, optimizer, booster, more, rank, world_size)[0]
        resumed, resumed_optimizer, resumed_booster = boosted(bf16_base(lora_model(3)), ON_DISK, "bf16", out)
        resumed_booster.load_model(resumed, Path(out) / "model")
        resumed_booster.load_optimizer(resumed_optimizer, Path(out) / "optim")
        result["resumed"] = train_counted(resumed, resumed_optimizer, resumed_booster, more, rank, world_size)[0]
        result["resumed_state"] = resumed.state_dict()
        result["final_state"] = chunked.state_dict()
    return result


def assert_frozen_values_only(result: dict[str, Any], placement: str) -> None:
    """The base: 2 bytes per element of this rank's share, on disk or in host memory, nothing else;
    the adapter's chunk: fp32 master, gradient and AdamW states (its 16-bit copy beside)."""
    frozen, trainable, counted = result["frozen"], result["trainable"], result["bytes"]
    where, elsewhere = (Location.DISK, Location.HOST) if placement == "on-disk" else (Location.HOST, Location.DISK)
    assert counted[(where, MemoryKind.MASTER)] == 4 * trainable  # no fp32 master for the base
    assert counted[(where, MemoryKind.SHARD_COPY)] == 2 * (frozen + trainable)
    assert sum(counted[(elsewhere, kind)] for kind in MemoryKind) == 0
    states = 2 * 4 * trainable + 4 * result["trainable_params"]  # AdamW's moments and step counts
    model = 2 * frozen + (4 + 4 + 2) * trainable + states
    assert result["host_bytes" if where is Location.HOST else "disk_bytes"] == model
    trainable_copy = 2 * trainable if placement == "on-disk" else 0  # the base is never written
    assert result["param_writes"] == [trainable_copy] * STEPS
    if placement == "on-disk":  # the scratch file: that, each region rounded up to a block
        assert model <= result["scratch"] <= model + DISK_BLOCK * 4 * result["chunks"]


def assert_equals_plain_peft(results: list[dict[str, Any]], out: Path) -> None:
    expected, reference = plain_peft("bf16", batches(STEPS), torch.device("cpu"), len(results), build=rounded_base)
    for rank, result in enumerate(results):
        assert result["losses"] == [step[rank] for step in expected], rank
        state = result["state"]
        for name, value in reference.state_dict().items():
            # The base comes back in its own dtype, the adapters in fp32, equal to plain PEFT's.
            assert state[name].dtype == (torch.float32 if "lora_" in name else torch.bfloat16), name
            assert torch.equal(state[name].float(), value.cpu()), name
        if "resumed" in result:  # a new job from the checkpoint continues as the uninterrupted run
            assert result["resumed"] == result["after"], rank
            assert_same_states(result["resumed_state"], result["final_state"])
    if "resumed" in results[0]:
        reference.save_pretrained(out / "plain")
        assert_same_adapter(out / "adapter", out / "plain")


@pytest.mark.parametrize("placement", ["on-disk", "in-ram"])
def test_a_bf16_base_holds_two_bytes_an_element_and_trains_like_plain_peft(placement: str, tmp_path: Path) -> None:
    result = _run(0, 1, placement, str(tmp_path))
    assert_frozen_values_only(result, placement)
    assert_equals_plain_peft([result], tmp_path)
    ids = batches(1)[0]
    with torch.device("meta"):
        meta = bf16_base(lora_model())
    plugin = ChunkPlugin(placement=PLACEMENTS[placement], precision="bf16", chunk_size=CHUNK)
    predicted = plan(
        meta,
        plugin,
        {"input_ids": ids, "labels": ids},
        optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1),
        device="cpu",
    )
    assert predicted.host_bytes_per_rank == result["host_bytes"]
    assert predicted.disk_bytes_per_rank == result["disk_bytes"]
    assert predicted.disk_param_read_bytes_per_step == result["param_reads"][-1]


@pytest.mark.slow  # the fast tier's LoRA on a disk base at two ranks is test_param_disk's
@pytest.mark.multirank
def test_a_bf16_base_on_disk_at_two_ranks_holds_two_bytes_an_element_per_rank(tmp_path: Path) -> None:
    results = run_ranks(_run, 2, args=("on-disk", str(tmp_path)))
    for result in results:
        assert_frozen_values_only(result, "on-disk")
    assert_equals_plain_peft(results, tmp_path)


def test_a_step_does_not_copy_a_frozen_base_to_the_device_again(tmp_path: Path) -> None:
    """Host values with their device copy kept (optimizer sides on the host, parameter shards on the
    device): a step changes only the adapters, so from the second step on the host-to-device bytes
    are the trainable chunks' 16-bit copies, refreshed once a step, and none of the base's."""
    placement = StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=1)
    chunked, optimizer, booster = boosted(bf16_base(lora_model()), placement, "bf16", tmp_path)
    _, stats = train_counted(chunked, optimizer, booster, batches(3))
    trainable_numel = sum(c.layout.shard_numel for c in chunked.manager.chunks if c.layout.trainable)
    trainable = trainable_numel * torch.bfloat16.itemsize
    assert [after.h2d_bytes - before.h2d_bytes for before, after in itertools.pairwise(stats[1:])] == [trainable] * 2
