"""PEFT (LoRA) under chunkmem: ``peft.get_peft_model`` first, then boost. Only the adapter has fp32
gradients and optimizer states; the base is frozen chunks. Losses and adapter weights equal plain
PEFT training bit for bit (fp32, and bf16 against the same mixed-precision recipe: 16-bit compute
copies of the model, fp32 adapter masters stepped by the same AdamW) at one and two ranks, under a
device budget (the auto policy moving chunks every step) and with the optimizer sides on disk;
``save_pretrained`` writes the adapter plain PEFT writes; a checkpoint resumes exactly. Boosting
before ``get_peft_model``, and quantized (tensor-subclass) weights, are refused naming the fix."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import batches, gpt2
from support.peft_helpers import (
    RANK,
    STEPS,
    TARGET,
    adamw,
    assert_same_adapter,
    assert_same_states,
    lora_model,
    plain_peft,
    steps_on,
    train,
)

from chunkmem import Booster, ChunkPlugin, NotSupportedError, UnmanageableParameter
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.usage.accounting import Location, MemoryKind

# peft is imported where a test uses it: collecting this module (every pytest-xdist worker collects
# every module, and three more test modules import its helpers) needs no peft.

ADAPTER_NUMEL = 2 * RANK * (64 + 192)  # two layers, lora_A (r x 64) and lora_B (192 x r)
CHUNK = 4_000  # the adapter (2048 elements) fills one trainable chunk of 4000
PLACEMENTS = {
    "auto-budget": lambda: AutoPlacementConfig(device_budget=150_000),  # below the model: chunks move
    "sides-on-disk": lambda: StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=1.0),
}


def boosted(precision: str, placement: str, disk_dir: str | Path | None, seed: int = 0) -> tuple[Any, Any, Booster]:
    model = lora_model(seed)
    booster = Booster(
        ChunkPlugin(
            placement=PLACEMENTS[placement](),
            precision=precision,
            chunk_size=CHUNK,
            disk_dir=disk_dir if placement == "sides-on-disk" else None,
        )
    )
    chunked, optimizer, *_ = booster.boost(model, adamw(model))
    return chunked, optimizer, booster


def adapter_report(chunked: Any, optimizer: Any) -> dict[str, Any]:
    """What chunkmem reports about where the fp32 training state lives, for the analytic count."""
    manager = chunked.manager
    ledger = manager.ledger
    trainable = [c for c in manager.chunks if c.layout.trainable]
    return {
        "trainable_names": sorted(info.name for c in trainable for info in c.layout.tensors),
        "trainable_shard_numel": sum(c.layout.shard_numel for c in trainable),
        "frozen_chunks": sum(not c.layout.trainable for c in manager.chunks),
        "grad_shard_bytes": sum(ledger.bytes(where, MemoryKind.GRAD_SHARD) for where in Location),
        "optim_state_bytes": sum(ledger.bytes(where, MemoryKind.OPTIM_STATE) for where in Location),
        "optim_state_on_disk": ledger.bytes(Location.DISK, MemoryKind.OPTIM_STATE),
        "optimizer_state_numel": sum(v.numel() for s in optimizer.state.values() for k, v in s.items() if k != "step"),
        "reduce_scatter_bytes": chunked.stats().reduce_scatter_bytes,
        "evictions": chunked.stats().evictions,
        "grad_reductions": chunked.stats().grad_reductions,
        "grad_flushes": chunked.stats().grad_flushes,
    }


def assert_only_the_adapter_trains(report: dict[str, Any], placement: str, world_size: int) -> None:
    names = report["trainable_names"]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    assert len(names) == 4  # lora_A and lora_B in each of the two layers
    assert report["frozen_chunks"] > 0
    shard = CHUNK // world_size  # the one trainable chunk holds the whole adapter
    assert report["trainable_shard_numel"] == shard
    assert report["grad_shard_bytes"] == 4 * shard  # fp32 gradients for the adapter's chunk only
    # AdamW: exp_avg and exp_avg_sq over the adapter's elements, and one fp32 step count per parameter.
    assert report["optim_state_bytes"] == 2 * 4 * shard + 4 * len(names)
    if world_size == 1:  # at two ranks each holds the state of its pieces: summed over ranks below
        assert report["optimizer_state_numel"] == 2 * ADAPTER_NUMEL
    if placement == "sides-on-disk":
        assert report["optim_state_on_disk"] == report["optim_state_bytes"]
    else:
        assert report["evictions"] > 0, "the budget must move chunks"
    if world_size > 1:  # only the adapter's chunk is reduced: once a step, plus early flushes under a budget
        assert report["grad_reductions"] - report["grad_flushes"] == STEPS
        assert report["reduce_scatter_bytes"] == report["grad_reductions"] * 4 * CHUNK


SLOW = pytest.mark.slow  # the fast tier keeps a representative of each matrix


@pytest.mark.parametrize(
    ("precision", "placement"),
    [
        ("bf16", "auto-budget"),
        ("fp32", "sides-on-disk"),
        pytest.param("fp32", "auto-budget", marks=SLOW),
        pytest.param("bf16", "sides-on-disk", marks=SLOW),
    ],
)
def test_lora_trains_like_plain_peft_bit_for_bit(precision: str, placement: str, tmp_path: Path) -> None:
    data = batches(STEPS)
    chunked, optimizer, booster = boosted(precision, placement, tmp_path)
    expected_losses, reference = plain_peft(precision, data, steps_on(chunked))
    losses = train(chunked, optimizer, booster, data, 0, 1)
    assert losses == [step[0] for step in expected_losses]
    state = chunked.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value.cpu()), name  # the adapter trained, the base unchanged
    assert_only_the_adapter_trains(adapter_report(chunked, optimizer), placement, 1)
    chunked.save_pretrained(tmp_path / "chunkmem")
    reference.save_pretrained(tmp_path / "plain")
    assert_same_adapter(tmp_path / "chunkmem", tmp_path / "plain")
    # booster.save_model / save_optimizer (one file each) resume a new job to the uninterrupted run.
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    more = batches(2, seed=5)
    after = train(chunked, optimizer, booster, more, 0, 1)
    resumed, resumed_optimizer, resumed_booster = boosted(precision, placement, tmp_path, seed=3)
    resumed_booster.load_model(resumed, tmp_path / "model.pt")
    resumed_booster.load_optimizer(resumed_optimizer, tmp_path / "optim.pt")
    assert train(resumed, resumed_optimizer, resumed_booster, more, 0, 1) == after
    assert_same_states(resumed.state_dict(), chunked.state_dict())


@pytest.mark.slow
def test_an_adapter_gets_chunks_sized_for_it_not_for_the_base(tmp_path: Path) -> None:
    """With the chunk size searched, the adapter (a small part of a frozen model) is packed in chunks
    of its own size: its gradient shard, optimizer states, disk scratch and writes per step are the
    adapter's bytes (plain AdamW's state over it), not a base-sized chunk's; training equals plain PEFT."""
    model = lora_model()
    placement = PLACEMENTS["sides-on-disk"]()
    booster = Booster(ChunkPlugin(placement=placement, precision="fp32", disk_dir=tmp_path))  # chunk_size searched
    chunked, optimizer, *_ = booster.boost(model, adamw(model))
    chunks = chunked.manager.chunks
    assert sum(c.layout.capacity for c in chunks if c.layout.trainable) == ADAPTER_NUMEL  # 2048: no padding
    frozen = [c.layout.capacity for c in chunks if not c.layout.trainable]
    assert min(frozen) > 10 * ADAPTER_NUMEL  # the base's size, searched
    plain = lora_model()
    plain_optimizer = adamw(plain)
    ids = batches(1)[0]
    plain(input_ids=ids, labels=ids).loss.backward()
    plain_optimizer.step()
    state_bytes = sum(t.numel() * t.element_size() for s in plain_optimizer.state.values() for t in s.values())
    data = batches(STEPS)
    before = chunked.stats()
    losses = train(chunked, optimizer, booster, data, 0, 1)
    after = chunked.stats()
    report = adapter_report(chunked, optimizer)
    assert report["grad_shard_bytes"] == 4 * ADAPTER_NUMEL
    assert report["optim_state_bytes"] == report["optim_state_on_disk"] == state_bytes
    assert chunked.manager.ledger.disk_bytes == 4 * ADAPTER_NUMEL + state_bytes  # the scratch: gradient and states
    # Every step writes the adapter's fp32 gradient and its two AdamW moments, nothing of the base.
    assert after.disk_write_bytes - before.disk_write_bytes == STEPS * (4 + 2 * 4) * ADAPTER_NUMEL
    expected_losses, reference = plain_peft("fp32", data, steps_on(chunked))
    assert losses == [step[0] for step in expected_losses]
    state = chunked.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value.cpu()), name


@contextmanager
def gathered_elements(chunked: Any) -> Iterator[list[int]]:
    """The number of elements of each all-gather of the model's communicator in the block."""
    comm = chunked.manager.comm
    sizes: list[int] = []
    original = comm.all_gather

    def counted(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(output.numel())
        return original(output, *args, **kwargs)

    comm.all_gather = counted
    try:
        yield sizes
    finally:
        del comm.all_gather  # the class's method again


def _two_ranks(rank: int, world_size: int, precision: str, placement: str, out: str) -> dict[str, Any]:
    data = batches(STEPS + 2)
    chunked, optimizer, booster = boosted(precision, placement, out)  # ranks may share a disk_dir
    losses = train(chunked, optimizer, booster, data[:STEPS], rank, world_size)
    report = adapter_report(chunked, optimizer)
    report["steps_on"] = str(steps_on(chunked))
    with gathered_elements(chunked) as gathered:
        chunked.save_pretrained(Path(out) / "adapter")  # every rank calls; rank 0 writes
    booster.save_model(chunked, Path(out) / "model", shard=True)
    booster.save_optimizer(optimizer, Path(out) / "optim", shard=True)
    state = {k: v for k, v in chunked.state_dict().items() if "lora_" in k}
    after = train(chunked, optimizer, booster, data[STEPS:], rank, world_size)
    # A new job from the checkpoint (another seed: every value must come from the files).
    resumed, resumed_optimizer, resumed_booster = boosted(precision, placement, out, seed=3)
    resumed_booster.load_model(resumed, Path(out) / "model")
    resumed_booster.load_optimizer(resumed_optimizer, Path(out) / "optim")
    again = train(resumed, resumed_optimizer, resumed_booster, data[STEPS:], rank, world_size)
    return {
        "losses": losses,
        "report": report,
        "state": state,
        "after": after,
        "resumed": again,
        "saved_elements": sum(gathered),
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("precision", "placement"),
    [
        # Its fp32 state is gathered in slices (a whole chunk does not fit the budget). The fast tier's
        # LoRA cases are the one-rank ones above and LoRA on a disk base at two ranks (test_param_disk).
        ("bf16", "auto-budget"),
        pytest.param("fp32", "sides-on-disk", marks=SLOW),
        pytest.param("bf16", "sides-on-disk", marks=SLOW),
    ],
)
def test_lora_at_two_ranks_equals_plain_peft_saves_its_adapter_and_resumes(
    precision: str, placement: str, tmp_path: Path
) -> None:
    results = run_ranks(_two_ranks, 2, args=(precision, placement, str(tmp_path)))
    sides = {result["report"]["steps_on"] for result in results}
    assert len(sides) == 1, sides
    expected_losses, reference = plain_peft(
        precision, batches(STEPS + 2)[:STEPS], torch.device(sides.pop()), world_size=2
    )
    for rank, result in enumerate(results):
        assert result["losses"] == [step[rank] for step in expected_losses], rank
        assert_only_the_adapter_trains(result["report"], placement, 2)
        assert result["resumed"] == result["after"], rank
        # save_pretrained gathers the adapter's chunk, not the base: the file holds the adapter only.
        assert result["saved_elements"] == CHUNK, rank
        for name, value in result["state"].items():
            assert torch.equal(value, reference.state_dict()[name].cpu()), name
    assert sum(result["report"]["optimizer_state_numel"] for result in results) == 2 * ADAPTER_NUMEL
    reference.save_pretrained(tmp_path / "plain")
    assert_same_adapter(tmp_path / "adapter", tmp_path / "plain")


def test_get_peft_model_after_boosting_is_refused_naming_the_order() -> None:
    """PEFT replaces the boosted model's layers with its wrappers and adds adapter parameters that
    are in no chunk and no optimizer: the next forward refuses, saying to apply it first."""
    import peft

    model = gpt2()
    booster = Booster(ChunkPlugin(precision="fp32", chunk_size=CHUNK))
    chunked, *_ = booster.boost(model, adamw(model))
    config = peft.LoraConfig(r=RANK, target_modules=[TARGET], lora_dropout=0.0, fan_in_fan_out=True)
    wrapped = peft.get_peft_model(chunked, config)
    ids = batches(1)[0]
    with pytest.raises(NotSupportedError, match=r"added after boosting.*lora_A\.default\.weight.*get_peft_model"):
        wrapped(input_ids=ids, labels=ids)


class _Packed(torch.Tensor):
    """Stands in for a quantized weight (torchao's tensors are ``torch.Tensor`` subclasses that
    ``nn.Parameter`` keeps as they are)."""


class _Params4bit(torch.nn.Parameter):
    """Stands in for bitsandbytes' ``Params4bit``: an ``nn.Parameter`` subclass over packed uint8."""


@pytest.mark.parametrize("kind", ["tensor subclass", "parameter subclass"])
def test_quantized_base_weights_are_refused_naming_the_fix(kind: str) -> None:
    model = gpt2()
    attention = model.transformer.h[0].attn.c_attn
    weight = attention.weight.detach()
    if kind == "tensor subclass":
        attention.weight = torch.nn.Parameter(weight.as_subclass(_Packed), requires_grad=False)
    else:
        attention.weight = _Params4bit(torch.zeros(weight.numel() // 2, dtype=torch.uint8), requires_grad=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    booster = Booster(ChunkPlugin(precision="fp32"))
    with pytest.raises(UnmanageableParameter, match=r"transformer\.h\.0\.attn\.c_attn\.weight.*quantized") as refused:
        booster.boost(model, adamw(model))
    assert "16-bit" in str(refused.value)
    for name, p in model.named_parameters():  # nothing changed
        assert torch.equal(p.detach(), before[name]), name


def _save_on_one_rank(rank: int, world_size: int, out: str) -> tuple[str, str] | None:
    chunked, optimizer, booster = boosted("fp32", "auto-budget", None)
    try:
        for step, ids in enumerate(batches(3)):
            if step == 1 and rank == 0:
                chunked.save_pretrained(out)
            train(chunked, optimizer, booster, [ids], rank, world_size)
    except Exception as error:
        return type(error).__name__, str(error)
    return None


@pytest.mark.multirank
@pytest.mark.slow  # fresh ranks: a departure leaves the group unusable
def test_saving_the_adapter_on_one_rank_raises_on_every_rank_and_writes_nothing(tmp_path: Path) -> None:
    results = run_ranks(_save_on_one_rank, 2, args=(str(tmp_path / "adapter"),), timeout=120, pg_timeout=60)
    for rank, result in enumerate(results):
        assert result is not None and result[0] == "TraceDivergenceError", (rank, result)
        assert "save_pretrained()" in result[1]
    assert not (tmp_path / "adapter").exists()
