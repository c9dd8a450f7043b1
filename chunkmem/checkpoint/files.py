"""Checkpoint files on disk: atomic pairs of a file and its manifest, checksums, safe reads.

A save writes the file and its manifest into a workspace chunkmem owns beside the target
(:mod:`~chunkmem.checkpoint.workspace`: a random name, a marker, a lock held while the save runs),
flushes both to disk, then renames the manifest into place, then the file. The new manifest also
describes the file it replaces (``previous``), so a reader between the two renames, or a save
killed between them, finds the old file verified; before them the old pair is untouched, after
them the new pair is whole. A failed write removes its workspace; a killed save's is removed by
the next save to the same target, and nothing else beside the target is ever touched.

Beside each checkpoint file ``<name>`` chunkmem writes ``<name>.chunkmem.json`` (a
:class:`Manifest`): what kind of state the file holds, its size and SHA-256, the step it was saved
at, and a fingerprint of the model, sealed by a checksum over all of it. The checkpoint file
itself stays a plain ``torch.save`` file that plain PyTorch loads; the manifest is what lets a load
refuse a corrupted, truncated, swapped or mismatched file before anything is written. Reads use
``torch.load(weights_only=True)`` and check the same inode they load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnverifiedError,
    CheckpointWriteError,
)
from .workspace import Workspace, remove_dead_workspaces

log = logging.getLogger("chunkmem")

__all__ = [
    "MANIFEST_SUFFIX",
    "FileDigest",
    "Kind",
    "Manifest",
    "TensorEntry",
    "atomic_save",
    "check_seal",
    "digest_of",
    "fingerprint",
    "fsync_directory",
    "manifest_path",
    "plain_name",
    "read_checkpoint",
    "read_manifest",
    "seal",
    "unverified",
    "write_checkpoint",
]

MANIFEST_SUFFIX = ".chunkmem.json"
Kind = Literal["model", "optimizer", "lr_scheduler"]
TensorEntry = tuple[str, tuple[int, ...], str]
"""A named tensor's name, shape and dtype (``"torch.float32"``)."""
_SAVE_WITH: dict[str, str] = {
    "model": "save_model / load_model",
    "optimizer": "save_optimizer / load_optimizer",
    "lr_scheduler": "save_lr_scheduler / load_lr_scheduler",
}
_READ_BLOCK = 1 << 20


class FileDigest(BaseModel):
    """Size and SHA-256 of a file as written."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def plain_name(name: str) -> bool:
    """Whether ``name`` names an entry of a directory itself: not a path, ``.`` or ``..``."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _confined(name: str) -> str:
    if not plain_name(name):
        raise ValueError(f"{name!r} is not a file name inside the checkpoint (no '/', '..' or absolute paths)")
    return name


class Manifest(BaseModel):
    """What ``<file>.chunkmem.json`` records about the checkpoint file ``<file>``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["chunkmem-checkpoint"] = "chunkmem-checkpoint"
    version: Literal[1, 2] = 2
    """2: sealed by ``checksum``; 1: written before manifests were sealed (still loaded)."""
    checksum: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of every other field (:func:`seal`): an edited step or digest is refused."""
    kind: Kind
    """Which save wrote it: a model, an optimizer or an LR scheduler state."""
    file: str
    """Name of the checkpoint file (in the same directory)."""
    digest: FileDigest
    """Size and SHA-256 of the checkpoint file."""
    step: int = Field(ge=0)
    """Optimizer steps (``step()`` calls, skipped fp16 steps included) behind the saved state."""
    model_fingerprint: str
    """SHA-256 of the model's parameters (names, shapes, fp32) in registration order."""
    world_size: int = Field(ge=1)
    """World size of the run that saved it (informative: files load at any world size)."""
    tensors: list[TensorEntry]
    """For a model file, every state-dict entry; for an optimizer file, its parameters in param
    group order (what the file's integer parameter ids stand for)."""

    previous: Manifest | None = None
    """The manifest of the file this one replaced, while the save that replaces it runs: a save
    renames its manifest into place first, then its file, so a reader in between (or after a kill
    in between) finds the previous file, described here."""

    _file_is_a_name = field_validator("file")(_confined)


Manifest.model_rebuild()


def _canonical(manifest: BaseModel) -> bytes:
    fields = manifest.model_dump(mode="json", exclude={"checksum"})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: Any) -> Any:
    """``manifest`` with its ``checksum`` over every other field."""
    return manifest.model_copy(update={"checksum": hashlib.sha256(_canonical(manifest)).hexdigest()})


def check_seal(manifest: Any, side: Path, what: str) -> None:
    """Refuse a sealed manifest whose fields were changed after it was written."""
    if manifest.version == 1:
        return
    if manifest.checksum != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointCorruptedError(
            f"the manifest {side} of {what} was changed after it was written: its checksum does not match its "
            "fields (step, digests, model). Restore it from the same checkpoint, or load an earlier checkpoint."
        )


def fingerprint(entries: Sequence[TensorEntry]) -> str:
    """A hash of named shapes and dtypes: equal for the same model structure."""
    text = json.dumps([[name, list(shape), dtype] for name, shape, dtype in entries], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_path(path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    return target.with_name(target.name + MANIFEST_SUFFIX)


# --- writing ----------------------------------------------------------------------------------
class _HashingWriter(io.RawIOBase):
    """Passes bytes to a file while hashing and counting them."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        self._hash.update(memoryview(data)[:written])
        self.size += written
        return written

    def flush(self) -> None:
        self._file.flush()

    def digest(self) -> FileDigest:
        return FileDigest(size=self.size, sha256=self._hash.hexdigest())


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


def _write_error(target: Path, obj: Any, error: BaseException) -> CheckpointWriteError:
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        free = None
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    hint = ""
    if free is not None:
        need = _nbytes(obj)
        if full or free < need:
            hint = (
                f" The disk holding it has {free} bytes free and the file needs about {need}: free space or save "
                "elsewhere."
            )
        else:
            hint = f" ({free} bytes free on its disk.)"
    return CheckpointWriteError(
        f"could not write checkpoint file {target}: {type(error).__name__}: {detail}.{hint} "
        f"The previous file at {target}, if any, is unchanged."
    )


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_into(obj: Any, path: Path) -> FileDigest:
    """``torch.save`` into ``path`` (a workspace entry), durably; its size and SHA-256."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        writer.flush()
        os.fsync(f.fileno())
    return writer.digest()


def _workspace(target: Path, obj: Any) -> Workspace:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_workspaces(target)
        return Workspace(target)
    except OSError as error:
        raise _write_error(target, obj, error) from error


def _replace_through_workspace(target: Path, obj: Any, fill: Callable[[Workspace], list[tuple[Path, Path]]]) -> None:
    """Let ``fill`` write into a fresh workspace of ``target`` and say what to rename where, then
    rename in that order and flush the directory. Failures name ``target``; the workspace goes."""
    workspace = _workspace(target, obj)
    try:
        for source, destination in fill(workspace):
            os.replace(source, destination)
        fsync_directory(target.parent)
    except (OSError, RuntimeError) as error:
        raise _write_error(target, obj, error) from error
    finally:
        workspace.remove()


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` so that readers see either the old file or the whole new one.
    Raises :class:`CheckpointWriteError` (an ``OSError``) naming the file when the write fails."""
    target = Path(path)

    def fill(workspace: Workspace) -> list[tuple[Path, Path]]:
        _write_into(obj, workspace / "data")
        return [(workspace / "data", target)]

    _replace_through_workspace(target, obj, fill)
    return target


def _current_manifest(target: Path) -> Manifest | None:
    """The manifest now beside ``target`` (without its own ``previous``), to describe the file a
    save replaces. Not checked against the file: a pair that does not match now is refused in the
    window as it is now, and hashing the old file would cost a full read per save."""
    try:
        manifest = read_manifest(target)
    except CheckpointCorruptedError:
        return None
    if manifest is None:
        return None
    return manifest.model_copy(update={"previous": None, "checksum": None, "version": 2})


def write_checkpoint(
    obj: Any,
    path: str | os.PathLike[str],
    kind: Kind,
    step: int,
    model_fingerprint: str,
    world_size: int,
    tensors: Sequence[TensorEntry],
) -> Manifest:
    """Write ``obj`` and its manifest so that a reader, or a save killed at any point, finds the
    old pair or the new one: both are written into a workspace, then the manifest (which also
    describes the file it replaces, as ``previous``) is renamed into place, then the file."""
    target = Path(path)
    side = manifest_path(target)
    written: list[Manifest] = []

    def fill(workspace: Workspace) -> list[tuple[Path, Path]]:
        manifest = seal(
            Manifest(
                kind=kind,
                file=target.name,
                digest=_write_into(obj, workspace / "data"),
                step=step,
                model_fingerprint=model_fingerprint,
                world_size=world_size,
                tensors=[(name, tuple(shape), dtype) for name, shape, dtype in tensors],
                previous=_current_manifest(target),
            )
        )
        with open(workspace / "manifest", "w") as f:
            f.write(manifest.model_dump_json(indent=1))
            f.flush()
            os.fsync(f.fileno())
        written.append(manifest)
        return [(workspace / "manifest", side), (workspace / "data", target)]

    _replace_through_workspace(target, obj, fill)
    return written[0]


# --- reading ----------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """The manifest beside ``path``, or ``None`` when there is none (a file from plain PyTorch)."""
    side = manifest_path(path)
    try:
        text = side.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointCorruptedError(f"cannot read the manifest {side} of checkpoint file {path}: {error}") from error
    try:
        manifest = Manifest.model_validate_json(text)
    except ValidationError as error:
        raise CheckpointCorruptedError(
            f"the manifest {side} of checkpoint file {path} is damaged ({error.error_count()} problem(s): "
            f"{error.errors()[0]['msg']}). Restore it from the same checkpoint, or delete it and load {path} with "
            "verify=False."
        ) from error
    check_seal(manifest, side, f"checkpoint file {path}")
    return manifest


def digest_of(path: Path | io.BufferedReader) -> FileDigest:
    """Size and SHA-256 of the file at ``path`` (or of an open file, from its start), read through
    one reused block (hashing a large checkpoint holds a megabyte, not a fresh buffer per read)."""
    digest = hashlib.sha256()
    size = 0
    block = bytearray(_READ_BLOCK)
    view = memoryview(block)
    with contextlib.ExitStack() as stack:
        if isinstance(path, io.BufferedReader):
            f = path.raw
            f.seek(0)
        else:
            f = stack.enter_context(open(path, "rb", buffering=0))
        while count := f.readinto(block):
            digest.update(view[:count])
            size += count
    return FileDigest(size=size, sha256=digest.hexdigest())


def unverified(target: Path, manifest_name: str, verify: bool) -> None:
    """A checkpoint without its manifest: refused, or with ``verify=False`` logged as unverified."""
    if verify:
        raise CheckpointUnverifiedError(
            f"{target} has no manifest ({manifest_name}), so chunkmem cannot check that it is intact and saved for "
            "this model. If it comes from plain PyTorch or another tool, load it with verify=False (it is then "
            f"logged as unverified); if chunkmem saved it, copy {manifest_name} with it."
        )
    log.warning("loading %s unverified (verify=False): it has no %s", target, manifest_name)


def check_file(path: Path, manifest: Manifest, kind: Kind, actual: FileDigest) -> None:
    """Refuse a file (whose size and checksum are ``actual``) that its manifest says is of another
    kind, name, size or checksum."""
    if manifest.kind != kind:
        raise CheckpointMismatchError(
            f"{path} holds a {manifest.kind} state (written by {_SAVE_WITH[manifest.kind].split(' / ')[0]}), not "
            f"a {kind} state; load it with {_SAVE_WITH[manifest.kind].split(' / ')[1]}"
        )
    if manifest.file != path.name:
        raise CheckpointMismatchError(
            f"the manifest beside {path} describes the file '{manifest.file}': the files were renamed or swapped. "
            f"Rename them back together (a file and its {MANIFEST_SUFFIX} keep the same base name)."
        )
    if actual.size != manifest.digest.size:
        what = "truncated" if actual.size < manifest.digest.size else "longer than saved"
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is {what}: {actual.size} bytes, its manifest says {manifest.digest.size}. It "
            "was damaged after saving or the save was interrupted; load an intact copy or an earlier checkpoint."
        )
    if actual.sha256 != manifest.digest.sha256:
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is corrupted: its SHA-256 {actual.sha256[:16]}... differs from the "
            f"{manifest.digest.sha256[:16]}... recorded when it was saved. Load an intact copy or an earlier "
            f"checkpoint; if you replaced the file on purpose, delete {manifest_path(path).name} and load it with "
            "verify=False."
        )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _load(target: Path) -> Any:
    try:
        try:
            return torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            return torch.load(target, map_location="cpu", weights_only=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointCorruptedError(
            f"cannot read checkpoint file {target} ({type(error).__name__}: {first}); it is truncated, damaged "
            "or not a torch.save file. Load an intact copy or an earlier checkpoint."
        ) from error


_KEEP_READING = 120.0
"""Seconds a load reads a file again while saves keep replacing it, before giving up."""


def read_checkpoint(path: str | os.PathLike[str], kind: Kind, verify: bool = True) -> tuple[Any, Manifest | None]:
    """Verify ``path`` against its manifest, then load it (memory-mapped where the format allows: a
    rank reads only the slices it uses). A file without a manifest is refused unless ``verify`` is
    false (a file from plain PyTorch or elsewhere), and then logged as unverified. A save that
    replaces the file meanwhile is not damage: the file checked is the one loaded (the same inode,
    held open throughout), or the read starts again."""
    target = Path(path)
    deadline = time.monotonic() + _KEEP_READING
    attempts = 0
    while time.monotonic() < deadline or attempts == 0:
        attempts += 1
        try:
            held = open(target, "rb")  # noqa: SIM115 (closed below; keeps the inode while it is read)
        except FileNotFoundError:
            held = None
        except IsADirectoryError:
            held = None
        if held is None or not target.is_file():
            raise CheckpointCorruptedError(
                f"checkpoint file {target} does not exist or is not a file"
                + (" (it is a directory)" if target.is_dir() else "")
            )
        with held:
            pinned = os.fstat(held.fileno())
            identity = (pinned.st_dev, pinned.st_ino)
            manifest = read_manifest(target)
            if manifest is None:
                unverified(target, manifest_path(target).name, verify)
                obj = _load(target)
                if _identity(target) == identity:
                    return obj, None
                continue
            actual = digest_of(held)
            chosen = manifest
            if actual != manifest.digest and manifest.previous is not None and actual == manifest.previous.digest:
                chosen = manifest.previous  # a save is between renaming its manifest and its file
            if actual != chosen.digest and _identity(target) != identity:
                continue  # replaced while it was read: read the new one
            check_file(target, chosen, kind, actual)
            obj = _load(target)
            if _identity(target) == identity:
                return obj, chosen
    raise CheckpointError(
        f"checkpoint file {target} was replaced by a save during each of {attempts} reads in {_KEEP_READING:.0f} s: "
        "another process keeps saving to it. Nothing was loaded; load it when those saves stop, or load a copy."
    )
