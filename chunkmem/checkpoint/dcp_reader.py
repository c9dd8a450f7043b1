"""Reading a DCP directory without running code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``: a directory whose
``.metadata`` was written by anyone else can run arbitrary code when it is loaded, before any check
of ours can refuse it (a manifest sits beside the files, so whoever can plant one can plant the
other). :class:`SafeFileSystemReader` reads the same file through an unpickler that resolves only the
classes DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts, paths) and
refuses anything else, naming the file and what it asked for. The tensor and byte records of the
data files are read with ``torch.load(weights_only=True)``, PyTorch's own restricted unpickler
(DCP's reader for tensors; :class:`~chunkmem.checkpoint.dcp_layout.PieceLoadPlanner` for bytes).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointCorruptedError
from .workspace import first_line

__all__ = ["SafeFileSystemReader", "read_metadata"]

# What a ``.metadata`` pickle may name: the data classes DCP describes a checkpoint with. A name is
# matched exactly (never a dotted attribute path), so an allowed class cannot lead to its methods.
_DCP_CLASSES = frozenset(
    name
    for name, value in vars(dcp_metadata).items()
    if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
)
_ALLOWED: dict[str, frozenset[str]] = {
    dcp_metadata.__name__: _DCP_CLASSES,
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size", *(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, path: Path) -> None:
        super().__init__(data)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointCorruptedError(
            f"refusing to read {self._path}: it asks to import {module}.{name}, which is not part of DCP's metadata. "
            "Nothing from it was run. The file was not written by torch.distributed.checkpoint (or was altered "
            "since); load an intact copy or an earlier checkpoint."
        )


def _unpickle(path: Path) -> Metadata:
    data = io.BytesIO(path.read_bytes())
    metadata = _MetadataUnpickler(data, path).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptedError(
            f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: it is not a DCP checkpoint's .metadata. "
            "Load an intact copy or an earlier checkpoint."
        )
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file system reader, whose ``.metadata`` is unpickled with a class allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = _unpickle(Path(self.path) / name)
        # As DCP's own reader does: a load id for this load, storage_meta for old checkpoints.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reads, one data file at a time, so that a file that cannot be read (a record
        ``torch.load(weights_only=True)`` refuses, a truncated slice) is named in the error."""
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(LoadPlan(items), planner).wait()
            except CheckpointCorruptedError:
                raise
            except Exception as error:
                raise CheckpointCorruptedError(
                    f"cannot read checkpoint file {Path(self.path) / name} ({type(error).__name__}: "
                    f"{first_line(error)}). Nothing from it was run. It is damaged or was not written by "
                    "torch.distributed.checkpoint; load an intact copy or an earlier checkpoint."
                ) from error
        done: Future[None] = Future()
        done.set_result(None)
        return done


def read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read without running code from it."""
    return SafeFileSystemReader(directory).read_metadata()
