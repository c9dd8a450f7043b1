"""Sharded checkpoints: every rank writes its own pieces with torch.distributed.checkpoint (no
gather), the directories load at any world size, chunk size and placement, bit for bit, and into
plain PyTorch through DCP itself; they are verified and transactional like single files, and
replaced atomically."""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.distributed import run_ranks
from support.killed_saves import dead_workspace, live_workspace
from support.models import adamw_two_groups, as_reference, batches, boost, gpt2, lm_loss, train_chunked
from support.state_helpers import assert_identical, raw_state
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from chunkmem import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ChunkmemError,
    StateDictMismatchError,
)
from chunkmem.checkpoint import sharded
from chunkmem.placement import StaticPlacementConfig

SAVED_AT = 3  # steps before the save; two more after it
DATA = 5


def _plain_from_directories(root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain model and optimizer loaded from sharded directories by plain DCP (not chunkmem), where
    chunkmem computes: a comparison bit for bit needs the same kernels on both sides."""
    model = as_reference(gpt2(seed=11))
    optimizer = adamw_two_groups(model)
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        # A tied parameter is saved once, under its first name: its alias loads through it.
        dcp.load(state, checkpoint_id=root / "model", planner=DefaultLoadPlanner(allow_partial_load=True))
        model.load_state_dict(state)
        optimizer_state = get_optimizer_state_dict(model, optimizer)
        dcp.load(optimizer_state, checkpoint_id=root / "optim")
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    return model, optimizer


def _plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for ids in data:
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()


def _resume(rank: int, world_size: int, directory: str, chunk_size: int, offload: bool) -> Path:
    """Boost a model of other initial weights, load the directories, check the state equals the
    saved one bit for bit, train the remaining steps; rank 0 writes the final state to the file
    it returns (tensors do not travel back from spawned ranks)."""
    root = Path(directory)
    placement = {"placement": StaticPlacementConfig(offload_optim_frac=1)} if offload else {}
    chunked, optimizer, booster = boost(
        gpt2(seed=7), adamw_two_groups, precision="fp32", chunk_size=chunk_size, **placement
    )
    booster.load_model(chunked, root / "model")
    booster.load_optimizer(optimizer, root / "optim")
    saved = torch.load(root / "reference.pt", weights_only=True)
    assert_identical(chunked.state_dict(), saved["model"], f"model at W={world_size}")
    assert_identical(optimizer.state_dict(), saved["optim"], f"optimizer at W={world_size}")
    train_chunked(chunked, optimizer, booster, batches(DATA)[SAVED_AT:], rank, world_size)
    final = chunked.state_dict()
    out = root / f"resumed-w{world_size}-chunks{chunk_size}.pt"
    if rank == 0:
        torch.save(final, out)
    return out


def _save_at_two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp32", chunk_size=6_000)
    train_chunked(chunked, optimizer, booster, batches(DATA)[:SAVED_AT], rank, world_size)
    # The reference: the same state through the gathering path (state_dict), not through DCP.
    reference = {"model": chunked.state_dict(), "optim": optimizer.state_dict()}
    counted = {"all_gather": 0}
    comm = chunked.manager.comm
    original = comm.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted["all_gather"] += 1
        return original(*args, **kwargs)

    comm.all_gather = counting  # type: ignore[method-assign]
    booster.save_model(chunked, root / "model", shard=True)
    booster.save_optimizer(optimizer, root / "optim", shard=True)
    comm.all_gather = original  # type: ignore[method-assign]
    if rank == 0:
        torch.save(reference, root / "reference.pt")
    torch.distributed.barrier()
    # Resume in the same ranks with another chunk size and the optimizer offloaded to the host.
    return {"chunk_gathers": counted["all_gather"], "resumed": _resume(rank, world_size, directory, 5_000, True)}


@pytest.mark.long
@pytest.mark.multirank
def test_saved_at_two_ranks_resumes_at_one_two_and_four_ranks_like_plain_pytorch(tmp_path: Path) -> None:
    saving = run_ranks(_save_at_two_ranks, args=(str(tmp_path),))
    assert [r["chunk_gathers"] for r in saving] == [0, 0]  # no rank gathered a chunk to save
    for name in ("model", "optim"):  # one data file per saving rank, DCP's metadata, the manifest
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(
            [".metadata", "__0_0.distcp", "__1_0.distcp", "chunkmem.json"]
        )
    saved = torch.load(tmp_path / "reference.pt", weights_only=True)

    # Plain PyTorch reads the directories with DCP alone and continues: the uninterrupted reference.
    plain, plain_optimizer = _plain_from_directories(tmp_path)
    assert_identical(plain.state_dict(), saved["model"], "plain model")
    assert_identical(plain_optimizer.state_dict(), saved["optim"], "plain optimizer")
    _plain_steps(plain, plain_optimizer, batches(DATA)[SAVED_AT:])
    expected = plain.state_dict()

    at_one = torch.load(_resume(0, 1, str(tmp_path), 12_000, False), weights_only=True)
    assert_identical(at_one, expected, "resumed at W=1")  # one rank: the same arithmetic, bit for bit
    at_four = run_ranks(_resume, world_size=4, args=(str(tmp_path), 3_000, False))[0]
    for path, label in ((saving[0]["resumed"], "W=2, other chunks, offloaded"), (at_four, "W=4")):
        resumed = torch.load(path, weights_only=True)
        # Several ranks: gradients are averaged over ranks, so the sums round differently, and
        # AdamW turns a rounding difference in a near-zero gradient into up to a few percent of
        # its lr (1e-3) per step in that element.
        for key, value in expected.items():
            where = f"{label} {key}"
            torch.testing.assert_close(
                resumed[key].cpu(), value.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
            )


def test_a_plain_pytorch_dcp_checkpoint_loads_and_trains_on(tmp_path: Path) -> None:
    """A DCP checkpoint written by plain PyTorch (module state dict; optimizer state keyed by
    parameter name) loads unverified, at another layout, and training goes on identically."""
    data = batches(DATA)
    model = as_reference(gpt2())  # where chunkmem computes: the same kernels on both sides, bit for bit
    optimizer = adamw_two_groups(model)
    _plain_steps(model, optimizer, data[:SAVED_AT])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=tmp_path / "model")
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=tmp_path / "optim")
    chunked, chunked_optimizer, booster = boost(gpt2(seed=3), adamw_two_groups, precision="fp32", chunk_size=7_000)
    booster.load_model(chunked, tmp_path / "model", verify=False)
    booster.load_optimizer(chunked_optimizer, tmp_path / "optim", verify=False)
    assert_identical(chunked.state_dict(), model.state_dict(), "model")
    assert_identical(chunked_optimizer.state_dict(), optimizer.state_dict(), "optimizer")
    _plain_steps(model, optimizer, data[SAVED_AT:])
    train_chunked(chunked, chunked_optimizer, booster, data[SAVED_AT:])
    assert_identical(chunked.state_dict(), model.state_dict(), "after training")


# --- what the directory holds ---------------------------------------------------------------------
def _trained(steps: int, seed: int = 0, **model_kwargs: Any) -> tuple[Any, Any, Any]:
    chunked, optimizer, booster = boost(
        gpt2(n_layer=1, seed=seed, **model_kwargs), adamw_two_groups, precision="fp32", chunk_size=8_000
    )
    train_chunked(chunked, optimizer, booster, batches(steps, seed=seed + 1))
    return chunked, optimizer, booster


def test_manifest_lists_every_file_with_its_checksum_step_and_model(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained(2)
    booster.save_model(chunked, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    plain = gpt2(n_layer=1)
    for name, kind in (("model", "model"), ("optim", "optimizer")):
        manifest = json.loads((tmp_path / name / "chunkmem.json").read_text())
        on_disk = {
            p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in (tmp_path / name).iterdir()
            if p.name != "chunkmem.json"
        }
        assert manifest["files"] == on_disk and ".metadata" in on_disk
        assert manifest["kind"] == kind and manifest["step"] == 2 and manifest["world_size"] == 1
    model_manifest = json.loads((tmp_path / "model" / "chunkmem.json").read_text())
    assert model_manifest["tensors"] == [[n, list(v.shape), str(v.dtype)] for n, v in plain.state_dict().items()]
    # DCP's own metadata: every parameter in its shape, once (the tied lm_head.weight is wte's).
    metadata = dcp.FileSystemReader(tmp_path / "model").read_metadata()
    names = dict(plain.named_parameters())
    assert {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k in names} == {
        k: tuple(v.shape) for k, v in names.items()
    }
    assert "lm_head.weight" not in metadata.state_dict_metadata


def test_fp16_loss_scale_and_frozen_parameters_round_trip(tmp_path: Path) -> None:
    model = gpt2()
    model.transformer.wpe.weight.requires_grad_(False)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp16", chunk_size=12_000)
    booster.backward(lm_loss(chunked, batches(1)[0]) * float("inf"), optimizer)  # skipped: the scale halves
    optimizer.step()
    optimizer.zero_grad()
    train_chunked(chunked, optimizer, booster, batches(2))
    booster.save_model(chunked, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    fresh_model = gpt2(seed=2)
    fresh_model.transformer.wpe.weight.requires_grad_(False)
    fresh, fresh_optimizer, fresh_booster = boost(fresh_model, adamw_two_groups, precision="fp16", chunk_size=5_000)
    fresh_booster.load_model(fresh, tmp_path / "model")
    fresh_booster.load_optimizer(fresh_optimizer, tmp_path / "optim")
    assert fresh_optimizer.loss_scale == optimizer.loss_scale == 2.0**15
    assert_identical(fresh.state_dict(), chunked.state_dict(), "model")
    assert_identical(fresh_optimizer.state_dict(), optimizer.state_dict(), "optimizer")


def test_both_formats_refuse_a_mismatched_state_with_the_same_checks(tmp_path: Path) -> None:
    """A file and a directory go through one set of checks per kind of state: an SGD state loaded
    into AdamW names the settings AdamW lacks in it, an optimizer state and a model of another
    width name the tensor of another shape, from either format, and nothing changes."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    wide = lambda m: torch.optim.AdamW(m.parameters())  # noqa: E731
    for name, make, model_kwargs in (("sgd", sgd, {}), ("wide", wide, {"n_embd": 32})):
        saved, saved_optimizer, saved_booster = boost(
            gpt2(n_layer=1, **model_kwargs), make, precision="fp32", chunk_size=8_000
        )
        train_chunked(saved, saved_optimizer, saved_booster, batches(1))
        for suffix, shard in ((".pt", False), ("", True)):
            saved_booster.save_optimizer(saved_optimizer, tmp_path / f"{name}-optim{suffix}", shard=shard)
            saved_booster.save_model(saved, tmp_path / f"{name}-model{suffix}", shard=shard)
    chunked, optimizer, booster = boost(gpt2(n_layer=1), wide, precision="fp32", chunk_size=8_000)
    train_chunked(chunked, optimizer, booster, batches(1))
    before = raw_state(chunked, optimizer)
    for suffix in (".pt", ""):
        with pytest.raises(StateDictMismatchError, match=r"lacks the settings \['amsgrad', 'betas', 'eps'\]"):
            booster.load_optimizer(optimizer, tmp_path / f"sgd-optim{suffix}")
        # Without their manifests (which would refuse another model first), the states' own checks.
        for path in (tmp_path / f"wide-optim{suffix}", tmp_path / f"wide-model{suffix}"):
            (path / "chunkmem.json" if path.is_dir() else path.with_name(path.name + ".chunkmem.json")).unlink()
        with pytest.raises(StateDictMismatchError, match=r"state 'exp_avg' of parameter 'transformer.wte.weight' "):
            booster.load_optimizer(optimizer, tmp_path / f"wide-optim{suffix}", verify=False)
        with pytest.raises(StateDictMismatchError, match=r"size mismatch for transformer.wte.weight: copying a param"):
            booster.load_model(chunked, tmp_path / f"wide-model{suffix}", verify=False)
        assert_identical(raw_state(chunked, optimizer), before, suffix or "directory")


# --- refusals and failures on two ranks -----------------------------------------------------------
def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def _refusals_on_two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=6_000)
    train_chunked(chunked, optimizer, booster, batches(2), rank, world_size)
    booster.save_model(chunked, root / "step2" / "model", shard=True)
    booster.save_optimizer(optimizer, root / "step2" / "optim", shard=True)
    train_chunked(chunked, optimizer, booster, batches(1, seed=4), rank, world_size)
    booster.save_model(chunked, root / "step3" / "model", shard=True)
    booster.save_optimizer(optimizer, root / "step3" / "optim", shard=True)
    other, other_optimizer, other_booster = boost(
        gpt2(n_layer=1, n_embd=32), adamw_two_groups, precision="fp32", chunk_size=6_000
    )
    train_chunked(other, other_optimizer, other_booster, batches(1), rank, world_size)
    other_booster.save_model(other, root / "other" / "model", shard=True)
    other_booster.save_optimizer(other_optimizer, root / "other" / "optim", shard=True)
    if rank == 0:
        # The data files are checked round robin: __0_0 by rank 0, __1_0 by rank 1.
        shutil.copytree(root / "step2" / "model", root / "flipped")
        _damage(root / "flipped" / "__1_0.distcp", "flip")
        shutil.copytree(root / "step2" / "optim", root / "truncated")
        _damage(root / "truncated" / "__0_0.distcp", "truncate")
    torch.distributed.barrier()

    out: dict[str, Any] = {}

    def attempt(name: str, action: Any) -> None:
        before = raw_state(chunked, optimizer)
        try:
            action()
            out[name] = None
        except ChunkmemError as error:
            out[name] = (type(error).__name__, str(error))
        try:
            assert_identical(raw_state(chunked, optimizer), before)
            out[f"{name} unchanged"] = True
        except AssertionError:
            out[f"{name} unchanged"] = False

    attempt("flipped", lambda: booster.load_model(chunked, root / "flipped"))
    attempt("truncated", lambda: booster.load_optimizer(optimizer, root / "truncated"))
    attempt("other model", lambda: booster.load_model(chunked, root / "other" / "model"))
    attempt("other optimizer", lambda: booster.load_optimizer(optimizer, root / "other" / "optim"))
    attempt("model as optimizer", lambda: booster.load_optimizer(optimizer, root / "step2" / "model"))
    booster.load_model(chunked, root / "step2" / "model")
    attempt("different steps", lambda: booster.load_optimizer(optimizer, root / "step3" / "optim"))
    booster.load_optimizer(optimizer, root / "step2" / "optim")  # the matching pair loads

    # A save that fails on rank 1 (its disk is full) raises on every rank; the previous
    # checkpoint at the target stays as it was and no temporary directory is left.
    target = root / "step3" / "model"
    previous = {p.name: p.read_bytes() for p in target.iterdir()}
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_stream = FileSystem.create_stream
    if rank == 1:

        def full_disk(self: Any, path: Any, mode: str) -> Any:
            if "w" in mode:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_stream(self, path, mode)

        FileSystem.create_stream = full_disk  # type: ignore[method-assign]
    attempt("save fails on rank 1", lambda: booster.save_model(chunked, target, shard=True))
    FileSystem.create_stream = real_stream  # type: ignore[method-assign]
    out["previous intact"] = {p.name: p.read_bytes() for p in target.iterdir()} == previous
    out["left behind"] = sorted(p.name for p in target.parent.iterdir() if p.name.startswith("."))
    booster.save_model(chunked, target, shard=True)  # the ranks are still in step
    return out


@pytest.mark.multirank
def test_refused_loads_and_a_failed_save_raise_on_every_rank_and_change_nothing(tmp_path: Path) -> None:
    results = run_ranks(_refusals_on_two_ranks, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        for name in ("flipped", "truncated", "other model", "other optimizer", "model as optimizer", "different steps"):
            assert out[f"{name} unchanged"], (rank, name)
        cls, text = out["flipped"]
        assert cls == "CheckpointCorruptedError" and "on rank 1" in text and "__1_0.distcp is corrupted" in text
        cls, text = out["truncated"]
        assert cls == "CheckpointCorruptedError" and "on rank 0" in text and "__0_0.distcp is truncated" in text
        cls, text = out["other model"]
        assert cls == "CheckpointMismatchError" and "saved for another model" in text and "on every rank" in text
        assert "different: 'transformer.wte.weight'" in text
        cls, text = out["other optimizer"]
        assert cls == "CheckpointMismatchError" and "over other parameters" in text
        cls, text = out["model as optimizer"]
        assert cls == "CheckpointMismatchError" and "holds a model state" in text and "load_model" in text
        cls, text = out["different steps"]
        assert cls == "CheckpointMismatchError" and "saved at step 3" in text and "saved at step 2" in text
        cls, text = out["save fails on rank 1"]
        assert cls == "CheckpointWriteError" and "on rank 1" in text and "No space left on device" in text
        assert out["save fails on rank 1 unchanged"] and out["previous intact"], rank
        assert out["left behind"] == [], rank


# --- the directory on disk ------------------------------------------------------------------------
def test_a_save_replaces_the_previous_directory_and_cleans_up_after_killed_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked, optimizer, booster = _trained(1)
    target = tmp_path / "model"
    booster.save_model(chunked, target, shard=True)
    first = json.loads((target / "chunkmem.json").read_text())
    dead = dead_workspace(target)
    process, live = live_workspace(target)
    try:
        train_chunked(chunked, optimizer, booster, batches(1, seed=8))
        # a save still running in another process: this one is refused, touching nothing of it
        with pytest.raises(CheckpointWriteError, match=r"another save to .*model is running"):
            booster.save_model(chunked, target, shard=True)
        assert not dead.exists() and live.exists()
        assert json.loads((target / "chunkmem.json").read_text()) == first
        process.kill()
        process.wait()
        booster.save_model(chunked, target, shard=True)
        assert not live.exists()
        second = json.loads((target / "chunkmem.json").read_text())
        assert second["step"] == first["step"] + 1 and second["files"] != first["files"]

        # Where directories cannot be exchanged in one step, the previous one is moved into the
        # workspace first; a save killed between the two renames leaves it there, and the next
        # save puts it back.
        monkeypatch.setattr(sharded, "_exchange", lambda first, second: False)
        interrupted = dead_workspace(target, move_previous=True)
        with pytest.raises(CheckpointCorruptedError, match=r"does not exist; a save to it was interrupted"):
            booster.load_model(chunked, target)

        def failing_install(workspace: Any, target: Path, manifest: Any) -> None:
            raise OSError("boom")

        monkeypatch.setattr(sharded, "install", failing_install)
        with pytest.raises(CheckpointWriteError, match=r"boom.*previous checkpoint at .*model, if any, is unchanged"):
            booster.save_model(chunked, target, shard=True)
        assert json.loads((target / "chunkmem.json").read_text()) == second  # put back by that save
        assert not interrupted.exists()
        monkeypatch.undo()
        monkeypatch.setattr(sharded, "_exchange", lambda first, second: False)
        booster.save_model(chunked, target, shard=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
        booster.load_model(chunked, target)
    finally:
        process.kill()
        process.wait()


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained(1)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    with pytest.raises(CheckpointWriteError, match=r"holds files that are not a chunkmem checkpoint"):
        booster.save_model(chunked, tmp_path / "notes", shard=True)
    with pytest.raises(CheckpointWriteError, match=r"a file is there"):
        booster.save_model(chunked, tmp_path / "file", shard=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes"]
    with pytest.raises(CheckpointCorruptedError, match=r"is not a checkpoint directory"):
        booster.load_model(chunked, tmp_path / "notes")
    (tmp_path / "empty").mkdir()
    booster.save_model(chunked, tmp_path / "empty", shard=True)  # an empty directory is fine
    with pytest.raises(CheckpointMismatchError, match=r"holds a model state"):
        booster.load_optimizer(optimizer, tmp_path / "empty")
    # Saving the optimizer to the model's directory, or over files put into it, would lose them.
    with pytest.raises(CheckpointWriteError, match=r"holds a model checkpoint, which this save would replace"):
        booster.save_optimizer(optimizer, tmp_path / "empty", shard=True)
    (tmp_path / "empty" / "sched.pt").write_text("a scheduler state")
    with pytest.raises(CheckpointWriteError, match=r"also holds \['sched.pt'\]"):
        booster.save_model(chunked, tmp_path / "empty", shard=True)
    assert (tmp_path / "empty" / "sched.pt").read_text() == "a scheduler state"
    booster.load_model(chunked, tmp_path / "empty")  # extra files do not stop a load


# --- memory -----------------------------------------------------------------------------------
def _memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _peak_growth_during(action: Any) -> int:
    """How far the resident set rose above where it was, while ``action`` ran. ``ru_maxrss``
    cannot say: in a spawned process it starts at the parent's size (fork before exec). The
    peak of this process alone (``VmHWM``) is reset first (``clear_refs``), after freed heap
    memory is returned to the system (else reusing it would hide growth)."""
    gc.collect()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _memory()["VmRSS"]
    action()
    return _memory()["VmHWM"] - before


def _save_memory(rank: int, world_size: int, directory: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(24)])  # 100.7 MB
    chunked, _, booster = boost(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), chunk_size=1 << 21)
    del model
    root = Path(directory)
    # The first save of a process imports DCP and starts its writer threads: that growth (measured
    # 7.4-8.5 MB here, up to 23 MB on a loaded CI machine) is paid once, not per save or per byte
    # saved, so the bound is checked on a second save. A save holding its shard would hold it again.
    booster.save_model(chunked, root / "first", shard=True)
    return {
        "sharded": _peak_growth_during(lambda: booster.save_model(chunked, root / "sharded", shard=True)),
        "full": _peak_growth_during(lambda: booster.save_model(chunked, root / "full.pt")),
    }


@pytest.mark.multirank
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_a_sharded_save_holds_no_more_than_a_small_part_of_its_shard(tmp_path: Path) -> None:
    model_bytes = 24 * 1024 * 1024 * 4
    shard_bytes = model_bytes // 2
    chunk_bytes = (1 << 21) * 4
    results = run_ranks(_save_memory, args=(str(tmp_path),), fresh=True)
    for rank, grown in enumerate(results):
        # A sharded save streams its shard a chunk at a time: at most one chunk's copy in flight, plus
        # what DCP allocates for its plan and metadata (a warm save grew by 1.1 MB on this 2-core
        # machine, fp32 masters on the CPU being written without a copy). Holding the shard, as a
        # save that copied it whole would, grows by 50 MB.
        assert grown["sharded"] < chunk_bytes + 8 * 1024 * 1024 < shard_bytes / 2, (rank, grown)
    assert results[0]["full"] > model_bytes  # the full save gathers the model on rank 0
    # Both checkpoints hold the same weights (read by plain DCP and torch.load).
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    state = {name: torch.empty_like(value) for name, value in full.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=tmp_path / "sharded")
    assert_identical(state, full)
