"""Checkpoints from a hostile source: no file a load reads can run code, whatever the manifest
says (a forged one matches the planted file), and the error names the file."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.forked import run_script, start_script
from support.killed_saves import dead_workspace
from support.models import adamw_two_groups, batches, boost, gpt2, train_chunked

from chunkmem import CheckpointCorruptedError, CheckpointUnverifiedError
from chunkmem.checkpoint.dcp_reader import read_metadata
from chunkmem.checkpoint.manifest import Manifest, seal


class _Payload:
    """Unpickling it creates ``marker``: proof that the load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _trained() -> tuple[Any, Any, Any]:
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    train_chunked(chunked, optimizer, booster, batches(1))
    return chunked, optimizer, booster


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _forge_file(path: Path, data: bytes) -> None:
    """Replace a single-file checkpoint and make its manifest vouch for the new bytes (sealed
    again, as whoever can write both files can)."""
    path.write_bytes(data)
    side = path.with_name(path.name + ".chunkmem.json")
    manifest = json.loads(side.read_text())
    manifest["digest"] = _digest(data)
    side.write_text(seal(Manifest.model_validate(manifest)).model_dump_json())


def _forge_in_directory(directory: Path, name: str, data: bytes) -> None:
    (directory / name).write_bytes(data)
    side = directory / "chunkmem.json"
    manifest = json.loads(side.read_text())
    manifest["files"][name] = _digest(data)
    side.write_text(seal(Manifest.model_validate(manifest)).model_dump_json())


def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _plant_in_distcp(directory: Path, marker: Path) -> str:
    """Append a torch.save payload to a data file and point every record of that file at it, in a
    well-formed .metadata; the manifest vouches for both. Returns the data file's name."""
    metadata = read_metadata(directory)
    storage = metadata.storage_data
    name = sorted({info.relative_path for info in storage.values()})[0]
    blob = _torch_saved(_Payload(marker))
    data = (directory / name).read_bytes()
    for index, info in list(storage.items()):
        if info.relative_path == name:
            storage[index] = type(info)(relative_path=name, offset=len(data), length=len(blob))
    metadata.storage_meta = None
    _forge_in_directory(directory, name, data + blob)
    _forge_in_directory(directory, ".metadata", pickle.dumps(metadata))
    return name


def _refused(load: Callable[[], Any], marker: Path, names: str) -> None:
    with pytest.raises(CheckpointCorruptedError) as caught:
        load()
    assert not marker.exists(), "the checkpoint ran code"
    assert names in str(caught.value), str(caught.value)


@pytest.mark.parametrize("manifest", ["forged", "absent"])
def test_no_file_of_a_sharded_checkpoint_runs_code(tmp_path: Path, manifest: str) -> None:
    chunked, optimizer, booster = _trained()
    marker = tmp_path / "ran"
    verify = manifest == "forged"
    for kind, save, load in (
        ("model", booster.save_model, lambda d: booster.load_model(chunked, d, verify=verify)),
        ("optim", booster.save_optimizer, lambda d: booster.load_optimizer(optimizer, d, verify=verify)),
    ):
        metadata_case, data_case = tmp_path / f"{kind}-metadata", tmp_path / f"{kind}-data"
        save(chunked if kind == "model" else optimizer, metadata_case, shard=True)
        save(chunked if kind == "model" else optimizer, data_case, shard=True)
        _forge_in_directory(metadata_case, ".metadata", pickle.dumps(_Payload(marker)))
        name = _plant_in_distcp(data_case, marker)
        for directory in (metadata_case, data_case):
            if manifest == "absent":
                (directory / "chunkmem.json").unlink()
        _refused(lambda d=metadata_case, load=load: load(d), marker, str(metadata_case / ".metadata"))
        _refused(lambda d=data_case, load=load: load(d), marker, str(data_case / name))


def test_no_single_file_checkpoint_runs_code(tmp_path: Path) -> None:
    chunked, optimizer, booster = _trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    marker = tmp_path / "ran"
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    booster.save_lr_scheduler(scheduler, tmp_path / "sched.pt", optimizer)
    payload = _torch_saved({"state": _Payload(marker)})
    for name in ("model.pt", "optim.pt", "sched.pt"):
        _forge_file(tmp_path / name, payload)
    _refused(lambda: booster.load_model(chunked, tmp_path / "model.pt"), marker, str(tmp_path / "model.pt"))
    _refused(lambda: booster.load_optimizer(optimizer, tmp_path / "optim.pt"), marker, str(tmp_path / "optim.pt"))
    _refused(lambda: booster.load_lr_scheduler(scheduler, tmp_path / "sched.pt"), marker, str(tmp_path / "sched.pt"))
    # a manifest is JSON: bytes that would unpickle to code are refused as a damaged manifest
    (tmp_path / "model.pt.chunkmem.json").write_bytes(pickle.dumps(_Payload(marker)))
    _refused(lambda: booster.load_model(chunked, tmp_path / "model.pt"), marker, "model.pt.chunkmem.json")


def _planted_metadata_on_two_ranks(rank: int, world_size: int, directory: str) -> str:
    chunked, _, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    target = Path(directory) / "model"
    with pytest.raises(CheckpointCorruptedError) as caught:
        booster.load_model(chunked, target)
    return str(caught.value)


@pytest.mark.multirank
def test_a_planted_metadata_is_refused_on_every_rank_without_running(tmp_path: Path) -> None:
    chunked, _, booster = _trained()
    booster.save_model(chunked, tmp_path / "model", shard=True)
    marker = tmp_path / "ran"
    _forge_in_directory(tmp_path / "model", ".metadata", pickle.dumps(_Payload(marker)))
    messages = run_ranks(_planted_metadata_on_two_ranks, 2, (str(tmp_path),))
    assert not marker.exists()
    assert all(".metadata" in m and "refusing" in m for m in messages), messages


# --- a .metadata that would change Python's own classes --------------------------------------
_PATCHES = [  # (class the pickle names, attribute it sets on it, value: another name it may import)
    (("pathlib", "Path"), "is_symlink", ("builtins", "set")),  # then a link out of the directory loads
    (("pathlib", "Path"), "iterdir", ("builtins", "set")),  # then a save deletes a user's file
    (("pathlib", "PosixPath"), "is_symlink", ("torch", "Size")),  # names that DCP's metadata does use
    (("torch.distributed.checkpoint.metadata", "MetadataIndex"), "__eq__", ("torch", "Size")),
]


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _patching_metadata(directory: Path, target: tuple[str, str], attribute: str, value: tuple[str, str]) -> bytes:
    """A pickle that first sets ``attribute`` on the class ``target`` (``BUILD`` on a class with a
    state of ``(None, {attribute: value})``: pickle's ``setattr``), then returns the directory's own,
    well-formed metadata."""
    metadata = read_metadata(directory)
    metadata.storage_meta = None
    body = pickle.dumps(metadata, protocol=2)[2:]  # without its PROTO opcode
    key = attribute.encode()
    state = b"N}X" + len(key).to_bytes(4, "little") + key + _global(*value) + b"s\x86"  # (None, {key: value})
    return b"\x80\x02" + _global(*target) + state + b"b0" + body  # BUILD, POP the class, then the metadata


def _patchable() -> dict[str, type]:
    import pathlib

    from torch.distributed.checkpoint import metadata

    return {"Path": pathlib.Path, "PosixPath": pathlib.PosixPath, "MetadataIndex": metadata.MetadataIndex}


def _class_attributes() -> dict[str, dict[str, Any]]:
    return {name: dict(vars(cls)) for name, cls in _patchable().items()}


def _put_back(before: dict[str, dict[str, Any]]) -> list[str]:
    """Restore the classes (so that a failure here does not break later tests); what had changed."""
    changed = []
    for name, cls in _patchable().items():
        for attribute in set(vars(cls)) | set(before[name]):
            if vars(cls).get(attribute) is not before[name].get(attribute):
                changed.append(f"{name}.{attribute}")
                if attribute in before[name]:
                    setattr(cls, attribute, before[name][attribute])
                else:
                    delattr(cls, attribute)
    return changed


def test_a_metadata_cannot_change_classes_of_the_process(tmp_path: Path) -> None:
    chunked, _, booster = _trained()
    directory = tmp_path / "model"
    booster.save_model(chunked, directory, shard=True)
    weights = {k: v.clone() for k, v in chunked.state_dict().items()}
    intact = read_metadata(directory)
    for target, attribute, value in _PATCHES:
        _forge_in_directory(directory, ".metadata", _patching_metadata(directory, target, attribute, value))
        before = _class_attributes()
        try:
            with pytest.raises(CheckpointCorruptedError, match=r"refusing to read .*\.metadata") as caught:
                booster.load_model(chunked, directory)  # verify=True: the forged manifest vouches for it
        finally:
            changed = _put_back(before)
        assert changed == [], f"the load changed {changed}"
        assert "Nothing from it was run or changed" in str(caught.value)
        assert all(torch.equal(v, weights[k]) for k, v in chunked.state_dict().items())
        intact.storage_meta = None
        _forge_in_directory(directory, ".metadata", pickle.dumps(intact))


def _patched_metadata_on_two_ranks(rank: int, world_size: int, directory: str) -> tuple[str, list[str]]:
    chunked, _, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    before = _class_attributes()
    try:
        with pytest.raises(CheckpointCorruptedError) as caught:
            booster.load_model(chunked, Path(directory))
    finally:
        changed = _put_back(before)
    return str(caught.value), changed


@pytest.mark.multirank
def test_a_metadata_cannot_change_classes_on_any_rank(tmp_path: Path) -> None:
    chunked, _, booster = _trained()
    directory = tmp_path / "model"
    booster.save_model(chunked, directory, shard=True)
    (target, attribute, value) = _PATCHES[0]
    _forge_in_directory(directory, ".metadata", _patching_metadata(directory, target, attribute, value))
    results = run_ranks(_patched_metadata_on_two_ranks, 2, (str(directory),))
    assert all(changed == [] for _, changed in results), results
    assert all("refusing to read" in message and ".metadata" in message for message, _ in results), results


# --- verification by default ------------------------------------------------------------------
def test_a_checkpoint_without_its_manifest_loads_only_when_told_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chunked, optimizer, booster = _trained()
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    (tmp_path / "model.pt.chunkmem.json").unlink()
    (tmp_path / "optim" / "chunkmem.json").unlink()
    with pytest.raises(CheckpointUnverifiedError, match=r"model.pt has no manifest.*verify=False"):
        booster.load_model(chunked, tmp_path / "model.pt")
    with pytest.raises(CheckpointUnverifiedError, match=r"optim has no manifest.*verify=False"):
        booster.load_optimizer(optimizer, tmp_path / "optim")
    with caplog.at_level("WARNING", logger="chunkmem"):
        booster.load_model(chunked, tmp_path / "model.pt", verify=False)
        booster.load_optimizer(optimizer, tmp_path / "optim", verify=False)
    unverified = [r.getMessage() for r in caplog.records if "unverified" in r.getMessage()]
    assert len(unverified) == 2 and "model.pt" in unverified[0] and "optim" in unverified[1], unverified


def test_an_edited_step_is_refused_and_an_unsealed_manifest_loads_only_when_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chunked, _, booster = _trained()
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_model(chunked, tmp_path / "model", shard=True)
    for side in (tmp_path / "model.pt.chunkmem.json", tmp_path / "model" / "chunkmem.json"):
        original = json.loads(side.read_text())
        edited = {**original, "step": original["step"] + 1}
        side.write_text(json.dumps(edited))
        target = tmp_path / ("model.pt" if side.parent == tmp_path else "model")
        with pytest.raises(CheckpointCorruptedError, match=r"changed after it was written"):
            booster.load_model(chunked, target)
        # an edit to version 1 (before manifests were sealed) is no way around the seal: such a
        # manifest loads only with verify=False, logged, and its digests are still checked
        legacy = {k: v for k, v in edited.items() if k != "checksum"}
        side.write_text(json.dumps({**legacy, "version": 1}))
        with pytest.raises(CheckpointUnverifiedError, match=r"no seal \(version 1.*verify=False"):
            booster.load_model(chunked, target)
        with caplog.at_level("WARNING", logger="chunkmem"):
            booster.load_model(chunked, target, verify=False)
        assert any("unsealed" in r.getMessage() and str(target) in r.getMessage() for r in caplog.records)
        data = next(p for p in sorted(target.iterdir()) if p.suffix == ".distcp") if target.is_dir() else target
        data.write_bytes(data.read_bytes()[:-1])
        with pytest.raises(CheckpointCorruptedError, match="truncated"):
            booster.load_model(chunked, target, verify=False)


@pytest.mark.parametrize("entry", ["../../secret.txt", "/etc/hostname", "link"])
def test_manifest_and_metadata_paths_stay_inside_the_checkpoint(tmp_path: Path, entry: str) -> None:
    chunked, _, booster = _trained()
    directory = tmp_path / "ckpt" / "model"
    booster.save_model(chunked, directory, shard=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint")
    side = directory / "chunkmem.json"
    manifest = json.loads(side.read_text())
    if entry == "link":
        (directory / "link").symlink_to(secret)
    manifest["files"][entry] = _digest(secret.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forged manifest skips validation: pydantic warns on dumping it
        side.write_text(seal(Manifest.model_construct(**manifest)).model_dump_json())
    with pytest.raises(CheckpointCorruptedError) as caught:
        booster.load_model(chunked, directory)
    message = str(caught.value)
    assert "inside" in message or "leading out" in message, message
    assert str(secret.stat().st_size) not in message.replace(str(tmp_path), "")
    # DCP's metadata may not point outside either, with or without a manifest
    side.unlink()
    if entry == "link":
        return
    metadata = read_metadata(directory)
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)(relative_path=entry, offset=0, length=4)
    metadata.storage_meta = None
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointCorruptedError, match="leading out"):
        booster.load_model(chunked, directory, verify=False)


# --- what a save may touch --------------------------------------------------------------------
_LOOK_ALIKES = {
    ".model.pt.tmp-notes.txt": b"notes",
    ".model.pt.tmp-otherhost-999999": b"another host's save",
    ".model.pt.chunkmem.json.tmp-keep": b"keep",
    ".model.pt.chunkmem-tmp-0123456789abcdef": b"a file, not a workspace",
    ".model_s.tmp-backup/kept.txt": b"backup",
    ".model_s.old-2024-backup/kept.txt": b"old backup",
    ".model_s.chunkmem-tmp-zz/kept.txt": b"not a token",
    ".model_s.chunkmem-tmp-fedcba9876543210/.chunkmem-workspace": b"a marker that says something else",
    ".model_s.chunkmem-tmp-0011223344556677/kept.txt": b"no marker",
}


def test_look_alike_names_survive_saves_kills_and_cleanups(tmp_path: Path) -> None:
    for name, data in _LOOK_ALIKES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    chunked, optimizer, booster = _trained()
    for _ in range(2):
        dead_workspace(tmp_path / "model.pt")
        dead_workspace(tmp_path / "model_s")
        booster.save_model(chunked, tmp_path / "model.pt")
        booster.save_model(chunked, tmp_path / "model_s", shard=True)
        train_chunked(chunked, optimizer, booster, batches(1))
    for name, data in _LOOK_ALIKES.items():
        assert (tmp_path / name).read_bytes() == data, name
    top = {name.split("/")[0] for name in _LOOK_ALIKES}
    assert {p.name for p in tmp_path.iterdir()} == top | {"model.pt", "model.pt.chunkmem.json", "model_s"}
    booster.load_model(chunked, tmp_path / "model.pt")
    booster.load_model(chunked, tmp_path / "model_s")


# --- a kill at any point of a save ------------------------------------------------------------
_SAVE = """
import os, sys, torch
from chunkmem import Booster, ChunkPlugin

kill_at = int(sys.argv[1])
calls = 0
def dying(real):
    def call(*args, **kwargs):
        global calls
        calls += 1
        if calls == kill_at:
            os._exit(9)
        return real(*args, **kwargs)
    return call
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
chunked, *_ = booster.boost(model)
chunked.load_state_dict({k: torch.full_like(v, 2.0) for k, v in chunked.state_dict().items()})
for name in ("fsync", "replace", "rename"):
    setattr(os, name, dying(getattr(os, name)))
booster.save_model(chunked, sys.argv[2], shard=sys.argv[3] == "shard")
sys.exit(0)
"""


def _small() -> tuple[Any, Any]:
    from chunkmem import Booster, ChunkPlugin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
    chunked, *_ = booster.boost(model)
    return chunked, booster


def _fill(chunked: Any, value: float) -> None:
    chunked.load_state_dict({k: torch.full_like(v, value) for k, v in chunked.state_dict().items()})


def _loaded_value(chunked: Any, booster: Any, target: Path) -> float:
    _fill(chunked, -1.0)
    booster.load_model(chunked, target)  # verified: it has its manifest, which must match
    values = {float(v.unique().item()) for v in chunked.state_dict().values()}
    assert len(values) == 1, values
    return values.pop()


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["file", "shard"])
def test_a_save_killed_at_any_point_leaves_the_old_or_the_new_checkpoint_verified(tmp_path: Path, shard: str) -> None:
    chunked, booster = _small()
    target = tmp_path / ("model" if shard == "shard" else "model.pt")
    seen = []
    for kill_at in range(1, 40):
        _fill(chunked, 1.0)
        booster.save_model(chunked, target, shard=shard == "shard")
        done = run_script(_SAVE, str(kill_at), str(target), shard)
        assert done.returncode in (0, 9), done.stderr[-2000:]
        seen.append(_loaded_value(chunked, booster, target))
        if done.returncode == 0:
            break
    else:
        pytest.fail("the save was killed at every one of 39 points")
    assert seen[0] == 1.0 and seen[-1] == 2.0 and set(seen) == {1.0, 2.0}, seen
    booster.save_model(chunked, target, shard=shard == "shard")  # cleans up after the killed ones
    expected = {"model"} if shard == "shard" else {"model.pt", "model.pt.chunkmem.json"}
    assert {p.name for p in tmp_path.iterdir()} == expected


# --- a reader beside a saver ------------------------------------------------------------------
_SAVER = """
import sys, torch
from chunkmem import Booster, ChunkPlugin

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
chunked, *_ = booster.boost(model)
print("ready", flush=True)
value = 1.0
while True:
    chunked.load_state_dict({k: torch.full_like(v, value) for k, v in chunked.state_dict().items()})
    booster.save_model(chunked, sys.argv[1], shard=sys.argv[2] == "shard")
    value = 3.0 - value
"""


@pytest.mark.slow
@pytest.mark.parametrize(("shard", "loads"), [("file", 300), ("shard", 80)])
def test_a_reader_beside_a_saver_never_sees_a_false_corruption(tmp_path: Path, shard: str, loads: int) -> None:
    chunked, booster = _small()
    target = tmp_path / ("model" if shard == "shard" else "model.pt")
    _fill(chunked, 1.0)
    booster.save_model(chunked, target, shard=shard == "shard")
    saver = start_script(_SAVER, str(target), shard)
    try:
        assert saver.stdout.readline().strip() == "ready"
        # At least ``loads`` loads, and on until one saw the saver's value (a saver slow to start
        # on a busy machine is waited for, up to a minute, rather than failing the test).
        values, patience = [], time.monotonic() + 60
        while len(values) < loads or (2.0 not in values and time.monotonic() < patience):
            values.append(_loaded_value(chunked, booster, target))
        assert saver.poll() is None, saver.communicate()[1]
    finally:
        saver.kill()
        saver.wait()
    assert set(values) <= {1.0, 2.0} and len(set(values)) == 2, "the saver did not replace it during the loads"
