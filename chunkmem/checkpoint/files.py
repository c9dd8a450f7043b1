"""Checkpoint files on disk: atomic writes, checksums and the manifest beside each file.

A file is written to a temporary name next to its target (``.<name>.tmp-<host>-<pid>``), hashed
while it is written, flushed to disk and renamed over the target, so a reader sees the old file or
the whole new one. A failed write removes its temporary file; one left by a killed save is removed
by the next save to the same target.

Beside each checkpoint file ``<name>`` chunkmem writes ``<name>.chunkmem.json`` (a
:class:`Manifest`): what kind of state the file holds, its size and SHA-256, the step it was saved
at, and a fingerprint of the model. The checkpoint file itself stays a plain ``torch.save`` file
that plain PyTorch loads; the manifest is what lets a load refuse a corrupted, truncated, swapped
or mismatched file before anything is written.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointUnverifiedError,
    CheckpointWriteError,
)

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
    "left_by_a_killed_save",
    "manifest_path",
    "plain_name",
    "read_checkpoint",
    "read_manifest",
    "remove_stale_temps",
    "seal",
    "temp_name",
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

    _file_is_a_name = field_validator("file")(_confined)


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


_HOST = socket.gethostname().replace("-", "_")


def temp_name(target: Path) -> Path:
    """Where this process writes ``target`` before renaming it into place."""
    return target.with_name(f".{target.name}.tmp-{_HOST}-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def left_by_a_killed_save(candidate: Path, prefix: str) -> bool:
    """Whether ``candidate`` (named ``<prefix><host>-<pid>``) was left by a save that is gone: one
    of this host whose process no longer runs, or one of another host (one target has one writer)."""
    host, _, pid = candidate.name.rpartition("-")
    host = host.removeprefix(prefix)
    return not (host == _HOST and pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))))


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove temporary files (or, for a sharded checkpoint, directories) a killed save to
    ``target`` left behind (see :func:`left_by_a_killed_save`). Returns what was removed."""
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    prefix = f".{target.name}.tmp-"
    for candidate in target.parent.glob(f"{prefix}*"):
        if not left_by_a_killed_save(candidate, prefix):
            continue
        if candidate.is_dir() and not candidate.is_symlink():
            shutil.rmtree(candidate, ignore_errors=True)
        else:
            candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


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


def _atomic_write(obj: Any, target: Path) -> FileDigest:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target)
    except OSError as error:
        raise _write_error(target, obj, error) from error
    tmp = temp_name(target)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            writer.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_directory(target.parent)
    except (OSError, RuntimeError) as error:
        raise _write_error(target, obj, error) from error
    finally:
        tmp.unlink(missing_ok=True)
    return writer.digest()


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` so that readers see either the old file or the whole new one.
    Raises :class:`CheckpointWriteError` (an ``OSError``) naming the file when the write fails."""
    target = Path(path)
    _atomic_write(obj, target)
    return target


def write_checkpoint(
    obj: Any,
    path: str | os.PathLike[str],
    kind: Kind,
    step: int,
    model_fingerprint: str,
    world_size: int,
    tensors: Sequence[TensorEntry],
) -> Manifest:
    """Write ``obj`` atomically, then its manifest (also atomically)."""
    target = Path(path)
    digest = _atomic_write(obj, target)
    manifest = seal(
        Manifest(
            kind=kind,
            file=target.name,
            digest=digest,
            step=step,
            model_fingerprint=model_fingerprint,
            world_size=world_size,
            tensors=[(name, tuple(shape), dtype) for name, shape, dtype in tensors],
        )
    )
    side = manifest_path(target)
    remove_stale_temps(side)
    tmp = temp_name(side)
    try:
        tmp.write_text(manifest.model_dump_json(indent=1))
        os.replace(tmp, side)
        fsync_directory(side.parent)
    except OSError as error:
        raise _write_error(side, None, error) from error
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


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


def digest_of(path: Path) -> FileDigest:
    """Size and SHA-256 of the file at ``path``, read through one reused block (hashing a large
    checkpoint holds a megabyte, not a fresh buffer per read)."""
    digest = hashlib.sha256()
    size = 0
    block = bytearray(_READ_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
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


def check_file(path: Path, manifest: Manifest, kind: Kind) -> None:
    """Refuse a file whose manifest names another kind, size or checksum."""
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
    actual = digest_of(path)
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


def read_checkpoint(path: str | os.PathLike[str], kind: Kind, verify: bool = True) -> tuple[Any, Manifest | None]:
    """Verify ``path`` against its manifest, then load it (memory-mapped where the format allows: a
    rank reads only the slices it uses). A file without a manifest is refused unless ``verify`` is
    false (a file from plain PyTorch or elsewhere), and then logged as unverified."""
    target = Path(path)
    if not target.is_file():
        raise CheckpointCorruptedError(
            f"checkpoint file {target} does not exist or is not a file"
            + (" (it is a directory)" if target.is_dir() else "")
        )
    manifest = read_manifest(target)
    if manifest is not None:
        check_file(target, manifest, kind)
    else:
        unverified(target, manifest_path(target).name, verify)
    try:
        try:
            obj = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            obj = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointCorruptedError(
            f"cannot read checkpoint file {target} ({type(error).__name__}: {first}); it is truncated, damaged "
            "or not a torch.save file. Load an intact copy or an earlier checkpoint."
        ) from error
    return obj, manifest
