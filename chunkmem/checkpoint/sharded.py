"""The sharded format: a directory written by ``torch.distributed.checkpoint`` (DCP: one data file
per saving rank and DCP's ``.metadata``) and its manifest, ``chunkmem.json``, which records the size
and SHA-256 of every other file in it.

A save (a collective; each rank writes its own pieces, nobody gathers) runs four agreed steps
(:func:`save_directory`): rank 0 creates the workspace (:mod:`.workspace`) the ranks write into;
every rank checks that it sees it (a filesystem all ranks share) and lists its pieces; DCP writes
them and each rank hashes its files; rank 0 checks that it sees every file as written, writes the
manifest last and swaps the directory into place in one ``renameat2(RENAME_EXCHANGE)`` (Linux;
elsewhere the previous directory is moved into the workspace, then the new one into place, and a
save killed between the two renames is repaired by the next one). A failure at any step raises the
same error on every rank, the workspace goes and the previous checkpoint is unchanged. Only an empty
directory or a chunkmem checkpoint of the same kind holding nothing but its own files is replaced.

A load (a collective, :func:`load_directory`) verifies the files (the ranks share the checksums)
and checks every key and shape before DCP reads this rank's pieces into staging tensors; the caller
installs them only once every rank read and checked them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointCorruptedError, CheckpointError, CheckpointWriteError, ChunkmemError
from ..ranks.agreement import agree, on_first_rank
from ..ranks.comm import Communicator
from .dcp_layout import Blob, Entry, dcp_load, dcp_save
from .dcp_reader import data_files, read_metadata
from .kept import check_keepable, keep_directory
from .loadable import check_loadable
from .manifest import (
    A_KIND,
    DCP_LAYOUT,
    DIRECTORY_FORMAT,
    MANIFEST_NAME,
    FileDigest,
    Kind,
    Manifest,
    Record,
    check_digest,
    check_kind,
    digest_of,
    manifest_for_load,
    plain_name,
    read_manifest,
)
from .workspace import (
    PREVIOUS,
    Pinned,
    Workspace,
    fsync_directory,
    interrupted_saves,
    open_workspace,
    read_error,
    read_while_replaced,
    write_durably,
    write_error,
)

__all__ = ["Reading", "load_directory", "save_directory"]

T = TypeVar("T")
DCP_METADATA = ".metadata"
WRITE_INTO = "checkpoint"
"""The entry of a save's workspace that the ranks write the new directory into."""


# --- the directory on disk --------------------------------------------------------------------
def _check_replaceable(target: Path, kind: Kind) -> Manifest | None:
    """Refuse a target that is a file, or a directory that is not empty and not exactly a chunkmem
    checkpoint of the same kind (a save replaces the whole directory, so it never deletes what an
    earlier save of this kind did not write: another kind's checkpoint, files put there since).
    Returns the manifest of the checkpoint it would replace, if any."""
    if not target.exists():
        return None
    if not target.is_dir() or target.is_symlink():
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: a file is there (a sharded checkpoint is a directory). "
            "Choose another path, or remove the file."
        )
    present = {entry.name for entry in target.iterdir()}
    if not present:
        return None
    if MANIFEST_NAME not in present:
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: the directory holds files that are not a chunkmem "
            f"checkpoint (it has no {MANIFEST_NAME}), and saving replaces the whole directory. Choose another path, "
            "or empty it."
        )
    try:
        manifest = read_manifest(target, directory=True)
    except CheckpointCorruptedError as error:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: {error}. Remove the directory to save there."
        ) from error
    assert manifest is not None and manifest.files is not None, f"{MANIFEST_NAME} is present"
    if manifest.kind != kind:
        raise CheckpointWriteError(
            f"cannot write a sharded {kind} checkpoint at {target}: it holds {A_KIND[manifest.kind]} checkpoint, "
            f"which this save would replace. Give each state its own directory (e.g. {target / kind})."
        )
    extra = sorted(present - set(manifest.files) - {MANIFEST_NAME})
    if extra:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: it also holds {extra[:3]}, which the checkpoint does not list "
            "and saving would delete. Move them elsewhere, or save to another path."
        )
    return manifest


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def install(workspace: Workspace, target: Path, manifest: Manifest) -> None:
    """On the first rank: write the manifest into the new directory (durably), then put it in
    place of ``target`` atomically; the previous checkpoint is kept (:mod:`.kept`) when it holds
    another step, else deleted with the workspace."""
    replaced = _check_replaceable(target, manifest.kind)
    if replaced is not None and replaced.step != manifest.step:
        check_keepable(target)
    new = workspace / WRITE_INTO
    write_durably(new / MANIFEST_NAME, manifest.model_dump_json(indent=1))
    fsync_directory(new)
    old = new
    if not target.exists():
        os.rename(new, target)
    elif not _exchange(new, target):
        old = workspace / PREVIOUS
        os.rename(target, old)
        try:
            os.rename(new, target)
        except OSError:
            os.rename(old, target)
            raise
    fsync_directory(target.parent)
    keep_directory(target, old, replaced, manifest.step)
    workspace.remove()


def inside(directory: Path, name: str) -> Path:
    """``directory / name``, refused when it leads out of ``directory`` (a path or a link)."""
    path = directory / name
    if not plain_name(name) or (path.is_symlink() and path.resolve().parent != directory.resolve()):
        raise CheckpointCorruptedError(
            f"checkpoint directory {directory} refers to {name!r}, which is not a file of the directory (a path or a "
            "link leading out of it); nothing outside a checkpoint is read. Load an intact copy or an earlier "
            "checkpoint."
        )
    return path


def verify_files(directory: Path, manifest: Manifest, rank: int, world_size: int) -> None:
    """Check this rank's share of the files against the manifest: DCP's ``.metadata`` on every
    rank (each unpickles it), the data files round robin, so that together the ranks read each
    file once."""
    files = manifest.files or {}
    if DCP_METADATA not in files:
        raise CheckpointCorruptedError(
            f"the manifest of {directory} lists no {DCP_METADATA}: it is not a DCP checkpoint"
        )
    data = sorted(name for name in files if name != DCP_METADATA)
    for name in [DCP_METADATA, *data[rank::world_size]]:
        path = inside(directory, name)
        try:
            actual = digest_of(path)
        except FileNotFoundError:
            raise CheckpointCorruptedError(
                f"checkpoint file {path} is missing: the manifest of {directory} lists it. The directory was damaged "
                "or partly copied; load an intact copy or an earlier checkpoint."
            ) from None
        except OSError as error:
            raise CheckpointCorruptedError(f"cannot read checkpoint file {path}: {error}") from error
        check_digest(path, actual, files[name], directory / MANIFEST_NAME, directory)


def _write_error(target: Path, error: BaseException) -> ChunkmemError:
    return write_error(target, error, "the sharded checkpoint")


def _through_dcp(call: Callable[[], T], rank: int, convert: Callable[[BaseException], ChunkmemError]) -> T | None:
    """Run a DCP collective. DCP reports a failure on any rank to every rank; this rank raises
    only its own (converted), and returns ``None`` when only other ranks failed (the agreement
    that follows raises here too)."""
    try:
        return call()
    except CheckpointException as error:
        own = error.failures.get(rank)
        if own is None:
            return None
        raise convert(own[0]) from own[0]


# --- saving -----------------------------------------------------------------------------------
def save_directory(comm: Communicator, target: Path, record: Record, build: Callable[[], Mapping[str, Entry]]) -> None:
    """Save what ``build`` lists on each rank (its pieces, and what it saves once) as the DCP
    checkpoint directory ``target``, atomically. A collective: every rank calls it."""
    what = f"saving a sharded {record.kind} checkpoint"
    subject = str(target)
    workspace: Workspace | None = None  # rank 0's, until it is installed or removed

    def prepare() -> None:
        nonlocal workspace
        if comm.rank == 0:
            try:
                workspace = open_workspace(target, lambda: _check_replaceable(target, record.kind), WRITE_INTO)
            except OSError as error:
                raise _write_error(target, error) from error

    try:
        agree(comm, what, prepare, CheckpointWriteError, subject)
        name = comm.all_gather_object(workspace.path.name if workspace is not None else None)[0]
        shared = target.parent / name / WRITE_INTO
        entries: dict[str, Entry] = {}

        def ready() -> None:
            if not shared.is_dir():
                raise CheckpointWriteError(
                    f"rank {comm.rank} does not see {shared}, the directory rank 0 created to write {target}: every "
                    "rank must save to the same directory, on a filesystem all ranks share"
                )
            entries.update(build())
            for name, entry in entries.items():
                if isinstance(entry, Blob):
                    check_loadable(entry.value, name, f"the sharded {record.kind} checkpoint {target}")

        agree(comm, f"{what} (preparing)", ready, CheckpointWriteError, subject)

        def write() -> dict[str, FileDigest] | None:
            done = _through_dcp(
                lambda: dcp_save(comm, shared, entries, what), comm.rank, lambda e: _write_error(target, e)
            )
            if done is None:
                return None
            try:
                return {name: digest_of(shared / name) for name in done}
            except OSError as error:
                raise _write_error(target, error) from error

        written = agree(comm, f"{what} (writing)", write, CheckpointWriteError, subject)
        assert written is not None, "a rank that saw another rank fail raised in the agreement"
        everyone: list[dict[str, FileDigest]] = comm.all_gather_object(written)

        def finish() -> None:
            assert workspace is not None, "rank 0 created the workspace"
            files = {name: digest for digests in everyone for name, digest in digests.items()}
            try:
                files[DCP_METADATA] = digest_of(shared / DCP_METADATA)
                referenced = data_files(read_metadata(shared))
                for name in sorted(referenced | set(files)):
                    path = shared / name
                    if name not in files or not path.is_file() or path.stat().st_size != files[name].size:
                        raise CheckpointWriteError(
                            f"rank 0 does not see {path} as it was written (a file of the sharded checkpoint "
                            f"{target}): every rank must save to the same directory, on a filesystem all ranks share"
                        )
                install(workspace, target, record.manifest(format=DIRECTORY_FORMAT, layout=DCP_LAYOUT, files=files))
            except OSError as error:
                raise _write_error(target, error) from error

        on_first_rank(comm, f"{what} (finishing)", finish, CheckpointWriteError, subject)
        workspace = None
    except BaseException as error:
        # A ChunkmemError is raised on every rank at the same step: rank 0 removes what was
        # written, and no rank returns before it has (a caller may look at the directory at once).
        # A rank that cannot be reached any more has failed already: the original error matters.
        if workspace is not None:
            workspace.remove()
        if isinstance(error, ChunkmemError):
            with contextlib.suppress(Exception):
                comm.barrier()
        raise


# --- loading ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reading(Generic[T]):
    """What one rank reads of a directory: ``targets`` (staging tensors for its pieces, and the
    small values everyone needs), and ``finish``, which checks what was read and returns the
    staged state (raising a ``StateDictMismatchError`` that lists every problem)."""

    targets: Mapping[str, Entry]
    finish: Callable[[], T]


def _open(comm: Communicator, target: Path, kind: Kind, verify: bool) -> tuple[Manifest | None, Metadata]:
    if not target.is_dir():
        interrupted = interrupted_saves(target)
        hint = (
            f"; a save to it was interrupted and left the previous checkpoint at {interrupted[0]} (the next save to "
            f"{target.name} puts it back, or move it yourself)"
            if interrupted
            else ""
        )
        raise CheckpointCorruptedError(f"checkpoint directory {target} does not exist{hint}")
    if not (target / MANIFEST_NAME).exists() and not (target / DCP_METADATA).is_file():
        raise CheckpointCorruptedError(
            f"{target} is not a checkpoint directory: it has neither chunkmem's {MANIFEST_NAME} nor DCP's "
            f"{DCP_METADATA}"
        )
    manifest = manifest_for_load(target, verify, directory=True)
    if manifest is not None:
        check_kind(target, manifest, kind)
        verify_files(target, manifest, comm.rank, comm.world_size)
    metadata = read_metadata(target)
    referenced = data_files(metadata)
    for name in sorted(referenced):
        inside(target, name)  # DCP would open it: nothing outside the directory
    if manifest is not None:
        unlisted = sorted(referenced - set(manifest.files or {}))
        if unlisted:
            raise CheckpointCorruptedError(
                f"{target / DCP_METADATA} refers to files its manifest does not list ({unlisted[:3]}): the files of "
                "two checkpoints were mixed. Load an intact copy or an earlier checkpoint."
            )
    return manifest, metadata


def load_directory(
    comm: Communicator,
    target: Path,
    kind: Kind,
    plan: Callable[[Manifest | None, Metadata], Reading[T]],
    verify: bool = True,
) -> tuple[T, Manifest | None]:
    """Verify ``target``, let ``plan`` check the saved keys and shapes and say what this rank
    reads, read it, and return what ``Reading.finish`` staged, with the manifest (``None`` for a
    DCP checkpoint written without chunkmem, refused unless ``verify`` is false). Nothing is
    installed. A collective: every rank calls it."""
    what = f"loading a sharded {kind} checkpoint"

    def open_and_plan() -> tuple[Manifest | None, Reading[T]]:
        manifest, metadata = _open(comm, target, kind, verify)
        return manifest, plan(manifest, metadata)

    def failed(error: BaseException) -> ChunkmemError:
        return read_error(f"checkpoint directory {target}", error, "it is damaged or not a checkpoint of this state")

    def read(reading: Reading[T]) -> T | None:
        done = _through_dcp(lambda: dcp_load(comm, target, reading.targets, what), comm.rank, failed)
        return None if done is None else reading.finish()

    def attempt(pinned: Pinned) -> tuple[T, Manifest | None]:
        manifest, reading = agree(comm, what, open_and_plan, CheckpointError, str(target))
        staged = agree(comm, f"{what} (reading)", lambda: read(reading), CheckpointCorruptedError, str(target))
        assert staged is not None, "a rank that saw another rank fail raised in the agreement"
        return staged, manifest

    # The agreements raise the same class on every rank, so every rank decides whether to read
    # again. (A departure between ranks is another class: it must not wait for a collective.)
    return read_while_replaced(target, f"checkpoint directory {target}", attempt, comm)
