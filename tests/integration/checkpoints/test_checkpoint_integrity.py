"""Checkpoints you can trust: every file has a manifest (checksum, step, model fingerprint) that a
load verifies before writing anything; corrupted, truncated, swapped, mismatched and
paired-from-different-steps files are refused with the file named and nothing changed; temporary
files never outlive a save; a failure on one rank raises on every rank."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.forked import start_script
from support.killed_saves import dead_workspace, live_workspace
from support.models import adamw_two_groups, batches, boost, gpt2, train_chunked
from support.state_helpers import assert_identical, raw_state

from chunkmem import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ChunkmemError,
    StateDictMismatchError,
    checkpoint,
)
from chunkmem.checkpoint.manifest import seal
from chunkmem.execution.gather import Destination
from chunkmem.optim.state_dict import full_optimizer_state


def _trained(steps: int, seed: int = 0, **model_kwargs: Any) -> tuple[Any, Any, Any]:
    chunked, optimizer, booster = boost(
        gpt2(n_layer=1, seed=seed, **model_kwargs), adamw_two_groups, precision="fp32", chunk_size=8_000
    )
    train_chunked(chunked, optimizer, booster, batches(steps, seed=seed + 1))
    return chunked, optimizer, booster


def _save_all(chunked: Any, optimizer: Any, booster: Any, directory: Path) -> None:
    booster.save_model(chunked, directory / "model.pt")
    booster.save_optimizer(optimizer, directory / "optim.pt")


def test_manifest_records_checksum_step_and_fingerprint(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained(3)
    _save_all(chunked, optimizer, booster, tmp_path)
    for name, kind in (("model.pt", "model"), ("optim.pt", "optimizer")):
        data = (tmp_path / name).read_bytes()
        manifest = json.loads((tmp_path / f"{name}.chunkmem.json").read_text())
        assert manifest["kind"] == kind and manifest["file"] == name
        assert manifest["digest"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert manifest["step"] == 3
    model_manifest = json.loads((tmp_path / "model.pt.chunkmem.json").read_text())
    plain = gpt2(n_layer=1)
    expected = [[n, list(v.shape), str(v.dtype)] for n, v in plain.state_dict().items()]
    assert model_manifest["tensors"] == expected
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # still a plain torch file
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model.pt", "model.pt.chunkmem.json", "optim.pt", "optim.pt.chunkmem.json"]
    )


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate-unverified"])
def test_damaged_files_are_refused_and_nothing_changes(tmp_path: Path, damage: str) -> None:
    _save_all(*_trained(2), tmp_path)
    for name in ("model.pt", "optim.pt"):
        (_flip if damage == "flip" else _truncate)(tmp_path / name)
        if damage == "truncate-unverified":
            (tmp_path / f"{name}.chunkmem.json").unlink()
    chunked, optimizer, booster = _trained(1, seed=5)
    before = raw_state(chunked, optimizer)
    expected = {"flip": "is corrupted: its SHA-256", "truncate": "is truncated", "truncate-unverified": "cannot read"}
    verify = damage != "truncate-unverified"
    with pytest.raises(CheckpointCorruptedError, match=expected[damage]) as error:
        booster.load_model(chunked, tmp_path / "model.pt", verify=verify)
    assert str(tmp_path / "model.pt") in str(error.value)
    with pytest.raises(CheckpointCorruptedError, match=expected[damage]) as error:
        booster.load_optimizer(optimizer, tmp_path / "optim.pt", verify=verify)
    assert str(tmp_path / "optim.pt") in str(error.value)
    assert_identical(raw_state(chunked, optimizer), before)


def test_files_of_another_model_are_refused(tmp_path: Path) -> None:
    """Same parameter names, other shapes: refused by the manifest, and without it by the
    shape checks (the optimizer state used to load and fail at the next step)."""
    _save_all(*_trained(2, n_embd=32), tmp_path)
    chunked, optimizer, booster = _trained(1, seed=5)
    before = raw_state(chunked, optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"saved for another model.*different: 'transformer.wte.weight'"):
        booster.load_model(chunked, tmp_path / "model.pt")
    with pytest.raises(CheckpointMismatchError, match=r"saved for an optimizer over other parameters"):
        booster.load_optimizer(optimizer, tmp_path / "optim.pt")
    for name in ("model.pt", "optim.pt"):
        (tmp_path / f"{name}.chunkmem.json").unlink()
    with pytest.raises(StateDictMismatchError, match=r"size mismatch for transformer.wte.weight"):
        booster.load_model(chunked, tmp_path / "model.pt", verify=False)
    with pytest.raises(StateDictMismatchError, match=r"state 'exp_avg' of parameter 'transformer.wte.weight'"):
        booster.load_optimizer(optimizer, tmp_path / "optim.pt", verify=False)
    assert_identical(raw_state(chunked, optimizer), before)
    optimizer.step()  # still usable


def test_files_from_different_steps_are_refused(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained(2)
    _save_all(chunked, optimizer, booster, tmp_path / "step2")
    train_chunked(chunked, optimizer, booster, batches(1, seed=9))
    _save_all(chunked, optimizer, booster, tmp_path / "step3")

    fresh, fresh_optimizer, fresh_booster = _trained(1, seed=5)
    fresh_booster.load_model(fresh, tmp_path / "step2" / "model.pt")
    before = raw_state(fresh, fresh_optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"saved at step 3.*step2/model.pt, saved at step 2"):
        fresh_booster.load_optimizer(fresh_optimizer, tmp_path / "step3" / "optim.pt")
    assert_identical(raw_state(fresh, fresh_optimizer), before)
    fresh_booster.load_optimizer(fresh_optimizer, tmp_path / "step2" / "optim.pt")  # the matching pair loads

    other, other_optimizer, other_booster = _trained(1, seed=6)
    other_booster.load_optimizer(other_optimizer, tmp_path / "step3" / "optim.pt")
    before = raw_state(other, other_optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"saved at step 2"):
        other_booster.load_model(other, tmp_path / "step2" / "model.pt")
    assert_identical(raw_state(other, other_optimizer), before)
    # Resumed at step 3, the next save records step 3 + what was trained since.
    other_booster.load_model(other, tmp_path / "step3" / "model.pt")
    train_chunked(other, other_optimizer, other_booster, batches(2, seed=3))
    other_booster.save_model(other, tmp_path / "step5.pt")
    assert checkpoint.read_manifest(tmp_path / "step5.pt").step == 5


# Manifests as chunkmem wrote them before file and directory manifests became one type, checksums
# included (a file's, with the manifest of the file it replaced; a directory's).
_TENSORS = [["w", [2, 3], "torch.float32"], ["b", [3], "torch.float32"]]
_FILE_MANIFEST = {
    "format": "chunkmem-checkpoint",
    "version": 2,
    "checksum": "04a43aaab96c57d712450e83390a03a1a64cf8434f181164dd8d35b884ce9d97",
    "kind": "optimizer",
    "file": "optim.pt",
    "digest": {"size": 20, "sha256": "b" * 64},
    "step": 3,
    "model_fingerprint": "f" * 64,
    "world_size": 2,
    "tensors": _TENSORS,
    "previous": {
        "format": "chunkmem-checkpoint",
        "version": 2,
        "checksum": None,
        "kind": "model",
        "file": "model.pt",
        "digest": {"size": 10, "sha256": "a" * 64},
        "step": 2,
        "model_fingerprint": "f" * 64,
        "world_size": 2,
        "tensors": _TENSORS[:1],
        "previous": None,
    },
}
_DIRECTORY_MANIFEST = {
    "format": "chunkmem-sharded-checkpoint",
    "version": 2,
    "checksum": "31e8b42bcd3991410195de3383c96d3f58470343193fb2685e48800eb8421eb3",
    "layout": "torch.distributed.checkpoint",
    "kind": "model",
    "files": {".metadata": {"size": 10, "sha256": "a" * 64}, "__0_0.distcp": {"size": 20, "sha256": "b" * 64}},
    "step": 4,
    "model_fingerprint": "e" * 64,
    "world_size": 4,
    "tensors": _TENSORS[:1],
}


def test_manifests_written_before_keep_loading_and_are_written_the_same_way(tmp_path: Path) -> None:
    """Old manifests read and verify as they are, and the same fields are written the same way
    (the checksum covers every field, so it holds only if nothing about them changed)."""
    (tmp_path / "optim.pt.chunkmem.json").write_text(json.dumps(_FILE_MANIFEST, indent=1))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "chunkmem.json").write_text(json.dumps(_DIRECTORY_MANIFEST, indent=1))
    file_manifest = checkpoint.read_manifest(tmp_path / "optim.pt")
    directory_manifest = checkpoint.read_manifest(tmp_path / "model", directory=True)
    assert file_manifest is not None and directory_manifest is not None  # their seals hold
    assert file_manifest.step == 3 and file_manifest.previous is not None and file_manifest.previous.step == 2
    assert directory_manifest.step == 4 and sorted(directory_manifest.files or {}) == [".metadata", "__0_0.distcp"]
    for manifest, literal in ((file_manifest, _FILE_MANIFEST), (directory_manifest, _DIRECTORY_MANIFEST)):
        written = json.loads(manifest.model_dump_json())
        assert written == literal and list(written) == list(literal)
        assert seal(manifest.model_copy(update={"checksum": None})).checksum == manifest.checksum
    # Each format reads only its own kind of manifest.
    (tmp_path / "model" / "chunkmem.json").write_text(json.dumps(_FILE_MANIFEST))
    with pytest.raises(CheckpointCorruptedError, match="is damaged"):
        checkpoint.read_manifest(tmp_path / "model", directory=True)
    (tmp_path / "optim.pt.chunkmem.json").write_text(json.dumps(_DIRECTORY_MANIFEST))
    with pytest.raises(CheckpointCorruptedError, match="is damaged"):
        checkpoint.read_manifest(tmp_path / "optim.pt")


def test_each_boosted_model_keeps_its_own_step(tmp_path: Path) -> None:
    """The step belongs to a boosted model and its optimizer: two models trained in one process
    save their own step counts, and a load moves only the step of the model it loads into."""
    first, first_optimizer, first_booster = _trained(3)
    second, second_optimizer, second_booster = _trained(1, seed=6)
    first_booster.save_model(first, tmp_path / "first.pt")
    second_booster.save_optimizer(second_optimizer, tmp_path / "second.pt")
    assert checkpoint.read_manifest(tmp_path / "first.pt").step == 3
    assert checkpoint.read_manifest(tmp_path / "second.pt").step == 1
    second_booster.load_model(second, tmp_path / "first.pt")
    train_chunked(second, second_optimizer, second_booster, batches(1, seed=3))
    second_booster.save_optimizer(second_optimizer, tmp_path / "second.pt")
    first_booster.save_optimizer(first_optimizer, tmp_path / "first_optim.pt")
    assert checkpoint.read_manifest(tmp_path / "second.pt").step == 4
    assert checkpoint.read_manifest(tmp_path / "first_optim.pt").step == 3


def test_a_file_of_the_wrong_kind_is_named(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained(1)
    _save_all(chunked, optimizer, booster, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"holds a model state.*load it with load_model"):
        booster.load_optimizer(optimizer, tmp_path / "model.pt")
    with pytest.raises(CheckpointMismatchError, match=r"holds an optimizer state.*load it with load_optimizer"):
        booster.load_model(chunked, tmp_path / "optim.pt")
    for name in ("model.pt", "optim.pt"):
        (tmp_path / f"{name}.chunkmem.json").unlink()
    with pytest.raises(StateDictMismatchError, match=r"holds a model state dict.*load_model"):
        booster.load_optimizer(optimizer, tmp_path / "model.pt", verify=False)
    with pytest.raises(StateDictMismatchError, match=r"holds an optimizer state.*load_optimizer"):
        booster.load_model(chunked, tmp_path / "optim.pt", verify=False)
    (tmp_path / "swapped.pt").write_bytes((tmp_path / "model.pt").read_bytes())
    shutil.copy(tmp_path / "optim.pt", tmp_path / "other.pt")
    booster.save_model(chunked, tmp_path / "named.pt")
    os.replace(tmp_path / "named.pt.chunkmem.json", tmp_path / "swapped.pt.chunkmem.json")
    with pytest.raises(CheckpointMismatchError, match=r"describes the file 'named.pt'"):
        booster.load_model(chunked, tmp_path / "swapped.pt")


def test_workspaces_of_killed_saves_are_removed_by_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    dead = dead_workspace(target)
    process, live = live_workspace(target)
    try:  # a save still running in another process: this one is refused, and touches nothing of it
        with pytest.raises(CheckpointWriteError, match=r"another save to .*model.pt is running"):
            checkpoint.atomic_save({"w": torch.ones(3)}, target)
        assert not dead.exists() and live.exists() and not target.exists()
    finally:
        process.kill()
        process.wait()
    checkpoint.atomic_save({"w": torch.ones(3)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_killed_save_leaves_the_old_file_and_its_temp_goes_next_time(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    checkpoint.atomic_save({"version": torch.tensor(1)}, target)
    script = textwrap.dedent(
        f"""
        import time, torch
        from chunkmem import checkpoint

        def slow_save(obj, f):
            f.write(b"partial checkpoint" * 1000)
            f.flush()
            time.sleep(60)

        torch.save = slow_save
        checkpoint.atomic_save({{"version": torch.tensor(2)}}, {str(target)!r})
        """
    )
    process = start_script(script)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".model.pt.chunkmem-tmp-*/data")) and time.monotonic() < deadline:
            time.sleep(0.1)
        temps = list(tmp_path.glob(".model.pt.chunkmem-tmp-*"))
        assert temps, "the saving process did not start writing"
    finally:
        process.kill()
        process.wait()
    assert all(t.exists() for t in temps)
    assert torch.load(target, weights_only=True)["version"].item() == 1  # the old file is intact
    checkpoint.atomic_save({"version": torch.tensor(3)}, target)
    assert not any(t.exists() for t in temps)
    assert torch.load(target, weights_only=True)["version"].item() == 3


def test_a_failed_write_names_the_file_and_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunked, _, booster = _trained(1)

    def full_disk(obj: Any, f: Any) -> None:
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint file .*model.pt.*bytes free") as error:
        booster.save_model(chunked, tmp_path / "model.pt")
    assert isinstance(error.value, OSError)
    assert list(tmp_path.iterdir()) == []


def _copy_with_manifest(source: Path, target: Path) -> None:
    shutil.copy(source, target)
    manifest = checkpoint.read_manifest(source)
    renamed = seal(manifest.model_copy(update={"file": target.name}))
    checkpoint.manifest_path(target).write_text(renamed.model_dump_json())


# --- two ranks ----------------------------------------------------------------------------------
def _failures_on_one_rank(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=6_000)
    train_chunked(chunked, optimizer, booster, batches(2), rank, world_size)
    out: dict[str, Any] = {}
    comm = chunked.manager.comm

    # Collectives of a save: one gather per chunk (model), one per chunk and state key (optimizer).
    calls = {"all_gather": 0}
    original = comm.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_gather"] += 1
        return original(*args, **kwargs)

    comm.all_gather = counting  # type: ignore[method-assign]
    booster.save_model(chunked, root / "model.pt")
    out["model_gathers"] = calls["all_gather"]
    calls["all_gather"] = 0
    booster.save_optimizer(optimizer, root / "optim.pt")
    out["optim_gathers"] = calls["all_gather"]
    comm.all_gather = original  # type: ignore[method-assign]
    out["chunks"] = len(chunked.manager.chunks)
    out["trainable_chunks"] = sum(c.layout.trainable for c in chunked.manager.chunks)
    out["kept_on_this_rank"] = (
        len(chunked.full_state_dict(Destination.FIRST_RANK)),
        len(full_optimizer_state(optimizer, Destination.FIRST_RANK)),
    )

    before = raw_state(chunked, optimizer)

    def attempt(name: str, action: Any) -> None:
        try:
            action()
            out[name] = None
        except ChunkmemError as error:
            out[name] = (type(error).__name__, str(error))

    # rank 0 cannot write: the target is a directory
    (root / "a_directory.pt").mkdir(exist_ok=True)
    attempt("unwritable", lambda: booster.save_model(chunked, root / "a_directory.pt"))
    # rank 0's disk is full
    from chunkmem.checkpoint import files

    real_write = files._HashingWriter.write
    if rank == 0:

        def full_disk(self: Any, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        files._HashingWriter.write = full_disk  # type: ignore[method-assign]
    attempt("disk_full", lambda: booster.save_optimizer(optimizer, root / "full.pt"))
    files._HashingWriter.write = real_write  # type: ignore[method-assign]
    # rank 1 reads a damaged copy
    mine = root / f"model-rank{rank}.pt"
    if rank == 0:
        for copy_rank in range(world_size):
            _copy_with_manifest(root / "model.pt", root / f"model-rank{copy_rank}.pt")
        _flip(root / "model-rank1.pt")
    torch.distributed.barrier()
    attempt("damaged_on_rank_1", lambda: booster.load_model(chunked, mine))
    # rank 1 passes a state dict with a wrong shape
    state = chunked.state_dict()
    if rank == 1:
        state["lm_head.weight"] = torch.zeros(3, 3)
    attempt("bad_state_on_rank_1", lambda: chunked.load_state_dict(state))
    out["unchanged"] = True
    try:
        assert_identical(raw_state(chunked, optimizer), before)
    except AssertionError:
        out["unchanged"] = False
    # the ranks are still in step: a good save and load work
    booster.save_model(chunked, root / "again.pt")
    booster.load_model(chunked, root / "again.pt")
    return out


@pytest.mark.multirank
def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_failures_on_one_rank, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        assert out["unchanged"], rank
        assert out["model_gathers"] == out["chunks"]
        assert out["optim_gathers"] == 2 * out["trainable_chunks"]  # AdamW: exp_avg and exp_avg_sq
        cls, text = out["unwritable"]
        assert cls == "CheckpointWriteError" and "on rank 0" in text and "a_directory.pt" in text
        cls, text = out["disk_full"]
        assert cls == "CheckpointWriteError" and "No space left on device" in text and "full.pt" in text
        cls, text = out["damaged_on_rank_1"]
        assert cls == "CheckpointCorruptedError" and "on rank 1" in text and "model-rank1.pt is corrupted" in text
        cls, text = out["bad_state_on_rank_1"]
        assert cls == "StateDictMismatchError" and "on rank 1" in text and "size mismatch for lm_head.weight" in text
    assert results[0]["kept_on_this_rank"][0] > 0 and results[0]["kept_on_this_rank"][1] > 0
    assert results[1]["kept_on_this_rank"] == (0, 0)  # rank 1 keeps nothing of a rank-0 gather
