"""A frozen base read in place from its safetensors file (issue 32 item 2): a bf16 base computed in
bf16, its shard on disk, is never copied into the disk tier's file; each gather reads its pieces
straight from the user's file. Training equals plain PyTorch bit for bit at one and two ranks; the
disk tier writes nothing for the base and keeps no room for it; reads are the analytic shard bytes;
a file stored in another dtype is copied as before; a file changed after boost is refused."""

from __future__ import annotations

import itertools
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support.distributed import run_ranks
from support.models import batches
from support.param_disk_helpers import ON_DISK, train_counted
from support.peft_helpers import adamw, plain_peft
from support.values_in_place_helpers import BASE, CHUNK, tiny, write_weights

from chunkmem import Booster, ChunkPlugin, DiskTierError, StateDictMismatchError, plan
from chunkmem.tiers.disk import DISK_BLOCK
from chunkmem.usage.accounting import Location, MemoryKind

STEPS = 2


def _overwrite_keeping_size_and_time(weights: str) -> None:
    """Write other weights of the same shapes over ``weights``, in place, and put its modification time back."""
    kept = os.stat(weights)
    other = Path(weights).with_suffix(".other")
    save_file({n: p.detach().contiguous() * 2 for n, p in tiny().named_parameters()}, str(other))
    with open(weights, "r+b") as file:
        file.write(other.read_bytes())
    assert os.stat(weights).st_size == kept.st_size
    os.utime(weights, ns=(kept.st_atime_ns, kept.st_mtime_ns))


def _run(
    rank: int,
    world_size: int,
    weights: str,
    out: str,
    changer: int | None,
    in_backward: bool = False,
    keep_time: bool = False,
) -> dict[str, Any]:
    """Boost from ``weights`` (``{rank}`` in it: each rank's own copy) and train; ``changer``: the
    rank that rewrites its file after boost, before training (``in_backward``: between the first
    forward and its backward; ``keep_time``: other weights written over it, its size and
    modification time kept)."""
    weights = weights.format(rank=rank)
    with torch.device("meta"):
        model = tiny()
    disk_dir = Path(out) / f"disk-{Path(weights).stem}"
    disk_dir.mkdir(exist_ok=True)
    # A device budget below the gathered model (5 chunks of 8 KiB) makes the backward read base chunks again.
    placement = ON_DISK.model_copy(update={"device_budget": 30_000}) if in_backward else ON_DISK
    booster = Booster(ChunkPlugin(placement=placement, precision="bf16", chunk_size=CHUNK, disk_dir=disk_dir))
    chunked, optimizer, *_ = booster.boost(model, adamw(model), weights=weights)
    chunks = chunked.manager.chunks
    if changer is not None:  # the file is rewritten (same size) while the ranks train on it
        adapters = [c.store.readable_master().clone() for c in chunks if c.layout.trainable]
        share = batches(1)[0].chunk(world_size)[rank]
        loss = chunked(input_ids=share, labels=share).loss if in_backward else None
        if rank == changer and keep_time:
            _overwrite_keeping_size_and_time(weights)
        elif rank == changer:
            data = bytearray(Path(weights).read_bytes())
            data[-2:] = b"\x00\x00"
            Path(weights).write_bytes(bytes(data))
            os.utime(weights, ns=(1, 1))  # even within one tick of the file system's clock
        torch.distributed.barrier()
        began = time.perf_counter()
        with pytest.raises(DiskTierError) as raised:
            if loss is None:
                loss = chunked(input_ids=share, labels=share).loss
            booster.backward(loss, optimizer)
            optimizer.step()
        after = [c.store.readable_master() for c in chunks if c.layout.trainable]
        with pytest.raises(DiskTierError, match=r"changed after boost|overwritten in place"):  # no checkpoint either
            chunked.state_dict()
        return {
            "error": str(raised.value),
            "seconds": time.perf_counter() - began,
            "unchanged": all(torch.equal(a, b) for a, b in zip(adapters, after, strict=True)),
            "steps": chunked.stats().optimizer_steps,
        }
    boost_writes = chunked.stats().disk_param_write_bytes
    losses, stats = train_counted(chunked, optimizer, booster, batches(STEPS), rank, world_size)
    (scratch,) = disk_dir.glob(f".chunkmem-scratch-*-rank{rank}/sides.bin")
    ledger = chunked.manager.ledger
    result = {
        "losses": losses,
        "state": chunked.state_dict(),
        "in_place": sum(c.store.reads_in_place for c in chunks),
        "shard_bytes": {c.layout.shard_numel * 2 for c in chunks},
        "trainable": sum(c.layout.shard_numel for c in chunks if c.layout.trainable),
        "boost_writes": boost_writes,
        "scratch": scratch.stat().st_size,
        "disk_copies": ledger.bytes(Location.DISK, MemoryKind.SHARD_COPY),
        "reads": [b.disk_param_read_bytes - a.disk_param_read_bytes for a, b in itertools.pairwise(stats)],
        "gathers": [b.gathers + b.prefetches - a.gathers - a.prefetches for a, b in itertools.pairwise(stats)],
    }
    # Checkpoints read the base through the gather's path: a model boosted from its own values loads them, and so
    # does this one (the same base: nothing to write); other base values cannot be kept and are refused.
    checkpoint = Path(out) / f"model-{Path(weights).stem}"
    booster.save_model(chunked, checkpoint, shard=world_size > 1)
    copied = tiny()
    copy_booster = Booster(ChunkPlugin(placement=ON_DISK, precision="bf16", chunk_size=CHUNK, disk_dir=disk_dir))
    loaded, *_ = copy_booster.boost(copied, adamw(copied))
    copy_booster.load_model(loaded, checkpoint)
    result["loaded"] = loaded.state_dict()
    booster.load_model(chunked, checkpoint)
    result["reloaded"] = chunked.state_dict()
    other = {name: value + 1 if name == "head.weight" else value for name, value in result["state"].items()}
    with pytest.raises(StateDictMismatchError, match=r"head\.weight") if result["in_place"] else nullcontext():
        chunked.load_state_dict(other)
    result["refused"] = chunked.state_dict()  # nothing written
    return result


def adamw_over(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _plain(world_size: int) -> tuple[list[list[float]], Any]:
    return plain_peft("bf16", batches(STEPS), torch.device("cpu"), world_size, build=lambda: tiny(torch.float32))


def _assert_plain(results: list[dict[str, Any]]) -> None:
    expected, reference = _plain(len(results))
    for rank, result in enumerate(results):
        assert result["losses"] == [step[rank] for step in expected], rank
        for name, value in reference.state_dict().items():
            assert torch.equal(result["state"][name].float(), value), name
        for name, value in result["state"].items():
            assert torch.equal(result["loaded"][name], value), name
            assert torch.equal(result["reloaded"][name], value), name
            if result["in_place"]:  # a load of other base values is refused on every rank and writes nothing
                assert torch.equal(result["refused"][name], value), name


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multirank)])
def test_a_bf16_base_is_read_in_place_trains_like_plain_pytorch_and_writes_nothing(
    world_size: int, tmp_path: Path
) -> None:
    weights = write_weights(tmp_path, torch.bfloat16)
    before = weights.read_bytes()
    args = (str(weights), str(tmp_path), None)
    results = run_ranks(_run, world_size, args=args) if world_size > 1 else [_run(0, 1, *args)]
    _assert_plain(results)
    assert weights.read_bytes() == before  # never written
    for result in results:
        assert result["in_place"] == len(BASE)
        # The disk tier writes the adapter's 16-bit shard each step, never the base's (not at boost either),
        # keeps no room for it, and counts none of it as its own.
        trainable_copy = 2 * result["trainable"]
        assert result["boost_writes"] == trainable_copy
        assert result["disk_copies"] == trainable_copy
        # The scratch file: the adapter's fp32 master, gradient and AdamW moments (8 shard bytes an element with
        # its 16-bit copy), its four step counts, each of its four regions rounded up to a block.
        (shard_bytes,) = result["shard_bytes"]
        assert 9 * shard_bytes + 4 * 4 <= result["scratch"] <= 9 * shard_bytes + 4 * 4 + 5 * DISK_BLOCK
        # Every gather reads one shard's bytes: from the scratch file for the adapter, the weights file for the base.
        assert result["reads"] == [g * shard_bytes for g in result["gathers"]]
    if world_size == 1:  # a plan sees no files: it predicts the copy; its reads are the run's (full chunks)
        with torch.device("meta"):
            meta = tiny()
        ids = batches(1)[0]
        plugin = ChunkPlugin(placement=ON_DISK, precision="bf16", chunk_size=CHUNK)
        predicted = plan(meta, plugin, {"input_ids": ids, "labels": ids}, optimizer=adamw_over, device="cpu")
        assert predicted.disk_param_read_bytes_per_step == results[0]["reads"][-1]


def test_a_file_in_another_dtype_is_copied_as_before(tmp_path: Path) -> None:
    weights = write_weights(tmp_path, torch.float32)
    result = _run(0, 1, str(weights), str(tmp_path), None)
    assert result["in_place"] == 0
    (shard_bytes,) = result["shard_bytes"]
    assert result["disk_copies"] == shard_bytes * (len(BASE) + 1)
    _assert_plain([result])


@pytest.mark.multirank
def test_a_weights_file_changed_after_boost_is_refused_on_every_rank(tmp_path: Path) -> None:
    weights = write_weights(tmp_path, torch.bfloat16)
    results = run_ranks(_run, 2, args=(str(weights), str(tmp_path), 0))
    for result in results:
        assert str(weights) in result["error"] and "changed after boost" in result["error"], result
        assert result["unchanged"] and result["steps"] == 0, result


@pytest.mark.multirank
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_weights_file_changed_on_one_rank_only_is_refused_on_every_rank_at_once(
    tmp_path: Path, in_backward: bool
) -> None:
    """Each rank reads its own copy (a node's local disk); only rank 1's changes, before the
    forward or between it and the backward. Rank 0 does not wait in a gather's collective until
    the process-group timeout (60 s pooled): both raise the same error naming rank 1's file within
    seconds (after the forward, or the backward), and no step changes the adapter."""
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        write_weights(tmp_path / f"rank{rank}", torch.bfloat16)
    template = str(tmp_path / "rank{rank}" / "bfloat16.safetensors")
    results = run_ranks(_run, 2, args=(template, str(tmp_path), 1, in_backward), timeout=40)
    assert results[0]["error"] == results[1]["error"]
    changed = template.format(rank=1)
    for result in results:
        assert "on rank 1: rank 1: chunk" in result["error"] and changed in result["error"], result
        assert "changed after boost" in result["error"] and "on rank 0" not in result["error"], result
        assert result["seconds"] < 10, result
        assert result["unchanged"] and result["steps"] == 0, result


@pytest.mark.multirank
def test_a_weights_file_overwritten_with_its_size_and_time_kept_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's copy gets other weights written over it in place, its size and modification time put
    back: the pages each read checks against boost's differ, and both ranks raise the same error."""
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        write_weights(tmp_path / f"rank{rank}", torch.bfloat16)
    template = str(tmp_path / "rank{rank}" / "bfloat16.safetensors")
    results = run_ranks(_run, 2, args=(template, str(tmp_path), 1, False, True), timeout=40)
    assert results[0]["error"] == results[1]["error"]
    for result in results:
        assert "on rank 1: chunk" in result["error"] and template.format(rank=1) in result["error"], result
        assert "overwritten in place" in result["error"] and "on rank 0" not in result["error"], result
        assert result["seconds"] < 10, result
        assert result["unchanged"] and result["steps"] == 0, result
