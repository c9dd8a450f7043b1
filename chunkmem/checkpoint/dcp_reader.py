"""Reading a DCP directory without running code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``: a directory whose
``.metadata`` was written by anyone else can run arbitrary code when it is loaded, before any check
of ours can refuse it (a manifest sits beside the files, so whoever can plant one can plant the
other, and its seal is no signature). :class:`SafeFileSystemReader` reads the same file as plain
data and rebuilds DCP's ``Metadata`` from it. An unpickler that only restricts which classes a
pickle may *name* would still hand it the real classes, and pickle can do more with a class than
instantiate it: ``BUILD`` on a class object sets attributes on it for the whole process
(``pathlib.Path.is_symlink = set``), and ``REDUCE`` calls it with any arguments. So no real object
is ever given to the pickle here:

1. :class:`_PlainUnpickler` answers every global the pickle names (only the names DCP's metadata is
   made of) with a *stand-in*, a fresh empty class made for this read alone. What the pickle does
   with it (calls it, instantiates it, sets state or attributes on it) only records arguments and
   state on stand-ins of this read, which are thrown away afterwards.
2. :class:`_Rebuild` then walks the result and builds DCP's ``Metadata`` by calling the real
   dataclasses with checked plain values (strings, ints, ``torch.Size`` of ints, dtypes from a fixed
   table), refusing any shape it does not expect: a stand-in used as a value where none belongs, a
   field a class does not have, a state set twice, a class given arguments it never takes.

The tensor and byte records of the data files are read with ``torch.load(weights_only=True)``,
PyTorch's own restricted unpickler (DCP's reader for tensors;
:class:`~chunkmem.checkpoint.dcp_layout.PieceLoadPlanner` for bytes).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..compat.dcp import GET_LAYOUT, MEMORY_FORMAT_ENCODING, MEMORY_FORMATS, STORAGE_INFO, StorageInfo
from ..errors import CheckpointCorruptedError
from .workspace import read_error

__all__ = ["SafeFileSystemReader", "data_files", "read_metadata", "unpickle_metadata"]

_M = "torch.distributed.checkpoint.metadata"
_DATACLASSES = {
    f"{_M}.Metadata",
    f"{_M}.TensorStorageMetadata",
    f"{_M}.BytesStorageMetadata",
    f"{_M}.ChunkStorageMetadata",
    f"{_M}.TensorProperties",
    f"{_M}.MetadataIndex",
    f"{_M}.StorageMeta",
    STORAGE_INFO,
}
_DTYPES = {f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
_PATHS = {
    f"pathlib.{cls}" for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
}
_CALLED = {
    "torch.Size",
    GET_LAYOUT,
    MEMORY_FORMAT_ENCODING,
    *_PATHS,
}
_NAMEABLE = _DATACLASSES | _CALLED | set(_DTYPES)
_PLAIN = (str, int, float, bool, bytes, type(None))
_UNSET = object()


@dataclass
class _Made:
    """What the pickle did with one stand-in instance: the arguments it was made with, its state."""

    name: str
    args: tuple[Any, ...]
    state: Any = _UNSET
    keep: object = field(default=None, repr=False)  # the instance: its id stays unique while read


class _Refused(Exception):
    """The pickle is not DCP metadata (its message says why); raised as a CheckpointCorruptedError."""


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles into stand-ins (see the module's docstring); :attr:`made` and :attr:`named` say
    which stand-in instance and which stand-in class stand for what."""

    def __init__(self, data: io.BytesIO) -> None:
        super().__init__(data)
        self.made: dict[int, _Made] = {}
        self.named: dict[int, tuple[type, str]] = {}

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it refers to a persistent object, which DCP's metadata never does")

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in _NAMEABLE:
            raise _Refused(f"it asks to import {full}, which is not part of DCP's metadata")
        made = self.made

        def new(cls: type, *args: Any) -> object:
            instance = object.__new__(cls)
            made[id(instance)] = _Made(full, args, keep=instance)
            return instance

        def setstate(instance: object, state: Any) -> None:
            record = made.get(id(instance))
            if record is None or record.keep is not instance or record.state is not _UNSET:
                raise _Refused(f"it sets the state of {full} twice or on something that is not a new instance")
            record.state = state

        stand_in = type("StandIn", (), {"__new__": new, "__setstate__": setstate})
        self.named[id(stand_in)] = (stand_in, full)
        return stand_in


class _Rebuild:
    """Real metadata objects from what :class:`_PlainUnpickler` produced."""

    def __init__(self, unpickler: _PlainUnpickler) -> None:
        self._made = unpickler.made
        self._named = unpickler.named

    # --- leaves ---------------------------------------------------------------------------------
    def _record(self, value: Any, *names: str) -> _Made:
        record = self._made.get(id(value))
        if record is None or record.keep is not value or record.name not in names:
            raise _Refused(f"it holds {self._what(value)} where {' or '.join(names)} belongs")
        return record

    def _what(self, value: Any) -> str:
        if id(value) in self._named and self._named[id(value)][0] is value:
            return f"the name {self._named[id(value)][1]}"
        record = self._made.get(id(value))
        if record is not None and record.keep is value:
            return f"a {record.name}"
        return f"a {type(value).__name__}"

    def _typed(self, value: Any, kinds: type | tuple[type, ...], what: str) -> Any:
        if type(value) not in (kinds if isinstance(kinds, tuple) else (kinds,)):
            raise _Refused(f"its {what} is {self._what(value)}")
        return value

    def _size(self, value: Any, what: str) -> torch.Size:
        record = self._record(value, "torch.Size")
        if record.state is not _UNSET or len(record.args) != 1 or type(record.args[0]) not in (tuple, list):
            raise _Refused(f"its {what} is not a torch.Size of integers")
        dims = [self._typed(d, int, what) for d in record.args[0]]
        if any(d < 0 for d in dims):
            raise _Refused(f"its {what} has a negative entry")
        return torch.Size(dims)

    def _dtype(self, value: Any) -> torch.dtype:
        named = self._named.get(id(value))
        if named is None or named[0] is not value or named[1] not in _DTYPES:
            raise _Refused(f"a tensor's dtype is {self._what(value)}")
        return _DTYPES[named[1]]

    def _called(self, value: Any, name: str, table: dict[Any, Any], what: str) -> Any:
        record = self._record(value, name)
        if record.state is not _UNSET or len(record.args) != 1 or type(record.args[0]) not in (str, int):
            raise _Refused(f"its {what} is not one {name} takes")
        if record.args[0] not in table:
            raise _Refused(f"its {what} {record.args[0]!r} is not one PyTorch has")
        return table[record.args[0]]

    def _path(self, value: Any) -> PurePath:
        record = self._record(value, *_PATHS)
        if record.state is not _UNSET or any(type(part) is not str for part in record.args):
            raise _Refused("its checkpoint_id is not a path of strings")
        return PureWindowsPath(*record.args) if "Windows" in record.name else PurePosixPath(*record.args)

    def plain(self, value: Any, what: str) -> Any:
        """Strings, numbers, ``None`` and lists, tuples and dicts of them (DCP's planner data)."""
        if type(value) in _PLAIN:
            return value
        if type(value) in (list, tuple):
            return type(value)(self.plain(v, what) for v in value)
        if type(value) is dict:
            return {self.plain(k, what): self.plain(v, what) for k, v in value.items()}
        raise _Refused(f"its {what} holds {self._what(value)}")

    def _optional(self, value: Any, build: Callable[[Any], Any]) -> Any:
        return None if value is None else build(value)

    # --- dataclasses --------------------------------------------------------------------------
    def _fields(self, value: Any, name: str, required: set[str], optional: set[str]) -> dict[str, Any]:
        """The fields a dataclass instance was pickled with (made without arguments, then a
        ``BUILD`` of a dict of its field names)."""
        record = self._record(value, f"{_M}.{name}" if "." not in name else name)
        state = {} if record.state is _UNSET else record.state
        if record.args or type(state) is not dict or any(type(k) is not str for k in state):
            raise _Refused(f"its {name} is not pickled as a dataclass of fields")
        unknown, missing = set(state) - required - optional, required - set(state)
        if unknown or missing:
            raise _Refused(f"its {name} has the fields {sorted(state)}, not {sorted(required)} (+ {sorted(optional)})")
        return state

    def _chunk(self, value: Any) -> ChunkStorageMetadata:
        fields = self._fields(value, "ChunkStorageMetadata", {"offsets", "sizes"}, set())
        return ChunkStorageMetadata(self._size(fields["offsets"], "offsets"), self._size(fields["sizes"], "sizes"))

    def _properties(self, value: Any) -> TensorProperties:
        record = self._record(value, f"{_M}.TensorProperties")
        if record.args or type(record.state) is not tuple or len(record.state) != 5:
            raise _Refused("its TensorProperties are not pickled as DCP pickles them")
        dtype, layout, requires_grad, memory_format, pin_memory = record.state
        return TensorProperties(
            dtype=self._dtype(dtype),
            layout=self._called(layout, GET_LAYOUT, _LAYOUTS, "layout"),
            requires_grad=self._typed(requires_grad, bool, "requires_grad"),
            memory_format=self._called(memory_format, MEMORY_FORMAT_ENCODING, MEMORY_FORMATS, "memory format"),
            pin_memory=self._typed(pin_memory, bool, "pin_memory"),
        )

    def _storage(self, value: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        record = self._record(value, f"{_M}.TensorStorageMetadata", f"{_M}.BytesStorageMetadata")
        if record.name.endswith("BytesStorageMetadata"):
            self._fields(value, "BytesStorageMetadata", set(), set())
            return BytesStorageMetadata()
        fields = self._fields(value, "TensorStorageMetadata", {"properties", "size", "chunks"}, set())
        chunks = self._typed(fields["chunks"], list, "chunks")
        return TensorStorageMetadata(
            properties=self._properties(fields["properties"]),
            size=self._size(fields["size"], "size"),
            chunks=[self._chunk(chunk) for chunk in chunks],
        )

    def _index(self, value: Any) -> MetadataIndex:
        fields = self._fields(value, "MetadataIndex", {"fqn"}, {"offset", "index"})
        return MetadataIndex(
            fqn=self._typed(fields["fqn"], str, "fqn"),
            offset=self._optional(fields.get("offset"), lambda v: self._size(v, "offset")),
            index=self._typed(fields.get("index"), (int, type(None)), "index"),
        )

    def _storage_info(self, value: Any) -> StorageInfo:
        fields = self._fields(
            value,
            STORAGE_INFO,
            {"relative_path", "offset", "length"},
            {"transform_descriptors"},
        )
        descriptors = fields.get("transform_descriptors")
        if descriptors is not None:
            listed = self._typed(descriptors, (list, tuple), "transform descriptors")
            descriptors = [self._typed(d, str, "transform descriptor") for d in listed]
        info = StorageInfo(
            relative_path=self._typed(fields["relative_path"], str, "relative_path"),
            offset=self._typed(fields["offset"], int, "offset"),
            length=self._typed(fields["length"], int, "length"),
            transform_descriptors=descriptors,
        )
        if info.offset < 0 or info.length < 0:
            raise _Refused(f"it gives {info.relative_path} a negative offset or length")
        return info

    def _storage_meta(self, value: Any) -> StorageMeta:
        fields = self._fields(value, "StorageMeta", set(), {"checkpoint_id", "save_id", "load_id", "modules"})
        checkpoint_id = fields.get("checkpoint_id")
        if checkpoint_id is not None and type(checkpoint_id) is not str:
            checkpoint_id = self._path(checkpoint_id)
        modules = self._typed(fields.get("modules", []), list, "modules")
        return StorageMeta(
            checkpoint_id=checkpoint_id,
            save_id=self._typed(fields.get("save_id"), (str, type(None)), "save_id"),
            load_id=self._typed(fields.get("load_id"), (str, type(None)), "load_id"),
            modules=[self._typed(m, str, "module") for m in modules],
        )

    def metadata(self, value: Any) -> Metadata:
        fields = self._fields(
            value, "Metadata", {"state_dict_metadata"}, {"planner_data", "storage_data", "storage_meta", "version"}
        )
        entries = self._typed(fields["state_dict_metadata"], dict, "state_dict_metadata")
        storage = self._typed(fields.get("storage_data") or {}, dict, "storage_data")
        rebuilt = {
            "state_dict_metadata": {self._typed(k, str, "key"): self._storage(v) for k, v in entries.items()},
            "planner_data": self.plain(fields.get("planner_data"), "planner_data"),
            "storage_data": {self._index(k): self._storage_info(v) for k, v in storage.items()},
            "storage_meta": self._optional(fields.get("storage_meta"), self._storage_meta),
            "version": self._typed(fields.get("version"), (str, type(None)), "version"),
        }
        # Older releases' Metadata has no ``version`` (added in torch 2.9): only what it declares.
        declared = {f.name for f in dataclasses.fields(Metadata)}
        return Metadata(**{name: value for name, value in rebuilt.items() if name in declared})


def unpickle_metadata(path: Path) -> Metadata:
    """DCP's ``Metadata`` of the ``.metadata`` file ``path``, rebuilt from plain values; a file that
    is not plainly DCP's metadata is refused with a :class:`CheckpointCorruptedError` naming it."""
    try:
        unpickler = _PlainUnpickler(io.BytesIO(path.read_bytes()))
        return _Rebuild(unpickler).metadata(unpickler.load())
    except Exception as error:  # whatever the bytes make the unpickler raise: they are not DCP's metadata
        reason = str(error) if isinstance(error, _Refused) else f"it cannot be read ({type(error).__name__}: {error})"
        raise CheckpointCorruptedError(
            f"refusing to read {path}: {reason}. Nothing from it was run or changed. The file was not written by "
            "torch.distributed.checkpoint (or was altered since); load an intact copy or an earlier checkpoint."
        ) from None


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
                meaning = "nothing from it was run: it is damaged or was not written by torch.distributed.checkpoint"
                raise read_error(f"checkpoint file {Path(self.path) / name}", error, meaning) from error
        done: Future[None] = Future()
        done.set_result(None)
        return done


def read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read without running code from it."""
    return SafeFileSystemReader(directory).read_metadata()


def data_files(metadata: Metadata) -> set[str]:
    """The names of the data files ``metadata`` refers to."""
    return {info.relative_path for info in (metadata.storage_data or {}).values()}
