"""Reading a DCP directory without running code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``: a directory whose
``.metadata`` was written by anyone else can run arbitrary code when it is loaded, before any check
of ours can refuse it (a manifest sits beside the files, so whoever can plant one can plant the
other, and its seal is no signature). :class:`SafeFileSystemReader` reads the same file as plain
data and rebuilds DCP's ``Metadata`` from it (:mod:`.dcp_metadata`): the pickle never gets hold of a
real class or function, so it can neither run code nor change one (``Path.is_symlink = set``).
The tensor and byte records of the data files are read with ``torch.load(weights_only=True)``,
PyTorch's own restricted unpickler (DCP's reader for tensors;
:class:`~chunkmem.checkpoint.dcp_layout.PieceLoadPlanner` for bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointCorruptedError
from .dcp_metadata import unpickle_metadata
from .workspace import first_line

__all__ = ["SafeFileSystemReader", "read_metadata"]


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file system reader, whose ``.metadata`` is read as plain data and rebuilt."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = unpickle_metadata(Path(self.path) / name)
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
