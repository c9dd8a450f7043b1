"""This rank's pieces as chunks of whole tensors in ``torch.distributed.checkpoint`` (DCP).

A rank holds, of each parameter, the elements ``[start, stop)`` of its *flattened* values (and the
same range of each elementwise optimizer state). DCP describes a saved tensor by its global shape
and a list of chunks, each an axis-aligned box (``ChunkStorageMetadata``: offsets and sizes per
dimension); at load, its planner reads the overlap of the saved boxes with the boxes a rank asks
for, whatever the saving layout was. A flat range of a row-major tensor is a union of at most
``2 * ndim - 1`` boxes, each contiguous in memory (:func:`boxes`), so each rank's piece is saved as
a few chunks of the parameter *in its own shape*. The directory is then an ordinary DCP checkpoint
of the module's ``state_dict``: plain PyTorch reads it with ``dcp.load(model.state_dict(), ...)``.

How the pieces reach DCP, and why:

* ``DTensor`` cannot express a piece: its shards follow a device mesh and placements (even or
  ``torch.chunk``-style splits along dimensions), not a range that starts anywhere in a row.
* ``ShardedTensor`` can (local shards with explicit ``ShardMetadata``), but it is deprecated in
  favour of DTensor (``torch.distributed._shard``: "we are deprecating ShardedTensor"), needs an
  initialized process group even for one process, and builds per-tensor metadata collectives.
* DCP's planner interface (``SavePlanner`` / ``LoadPlanner``, ``WriteItem`` and ``ReadItem``
  with ``ChunkStorageMetadata``, ``create_read_items_for_chunk_list``) is the documented extension
  point for custom layouts. :class:`PieceSavePlanner` and :class:`PieceLoadPlanner` extend the
  default planners only through their extension hooks (``create_local_plan``, ``lookup_object``,
  ``lookup_tensor``, ``load_bytes``), so DCP's own global planning, deduplication, validation of
  the saved boxes (in bounds, disjoint, covering each tensor) and resharding reads are kept, and
  one process needs no process group.

Saving copies nothing: ``torch.save`` writes a tensor's whole storage, so DCP clones any view of a
larger buffer; each box is instead handed over as a tensor on a slice of the master's storage with
exactly its bytes (:func:`_exact_storage`), which DCP writes as it is. Loading reads into staging
tensors the caller owns (this rank's pieces), so nothing is written into the model until every
rank has read and checked everything.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import NotSupportedError
from ..ranks.comm import Communicator
from .dcp_reader import SafeFileSystemReader

__all__ = ["Blob", "Entry", "FlatRange", "Whole", "as_meta", "dcp_load", "dcp_save", "read_whole", "whole"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """One axis-aligned box of a tensor, holding the flat elements ``[flat_start, flat_start + numel)``."""

    offsets: Shape
    sizes: Shape
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


def boxes(shape: Shape, start: int, stop: int) -> list[Box]:
    """The flat elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in order,
    each contiguous in memory: from ``start``, the largest box that begins there (a run of whole
    sub-blocks along the outermost dimension the position is aligned to), and so on."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape} ({numel} elements)")
    if not shape:
        return [Box((), (), 0)] if stop > start else []
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    out: list[Box] = []
    at = start
    while at < stop:
        # strides[-1] == 1 always qualifies
        k = next(d for d, stride in enumerate(strides) if at % stride == 0 and stride <= stop - at)
        index = [(at // strides[d]) % shape[d] for d in range(len(shape))]
        count = min(shape[k] - index[k], (stop - at) // strides[k])
        sizes = (1,) * k + (count,) + tuple(shape[k + 1 :])
        out.append(Box(tuple(index), sizes, at))
        at += count * strides[k]
    return out


def _exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous) as a tensor whose storage is exactly its bytes, sharing memory."""
    if view.untyped_storage().nbytes() == view.nbytes:
        return view
    begin = view.storage_offset() * view.element_size()
    storage = view.untyped_storage()[begin : begin + view.nbytes]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape)


# --- what a rank saves and reads -------------------------------------------------------------
@dataclass(frozen=True)
class FlatRange:
    """This rank's elements ``[start, start + value.numel())`` of a tensor of ``shape`` (flattened);
    ``value`` is 1-D and contiguous. Saved as boxes; a load fills ``value``."""

    value: torch.Tensor
    shape: Shape
    start: int

    def __post_init__(self) -> None:
        if self.value.dim() != 1 or not self.value.is_contiguous():
            raise ValueError("FlatRange values must be a contiguous 1-D tensor")

    def parts(self) -> list[tuple[Box, torch.Tensor]]:
        """Its boxes, each with the view of ``value`` that holds it."""
        parts = []
        for box in boxes(self.shape, self.start, self.start + self.value.numel()):
            begin = box.flat_start - self.start
            parts.append((box, self.value[begin : begin + box.numel].view(box.sizes)))
        return parts


@dataclass(frozen=True)
class Whole:
    """A tensor saved whole by one rank (a buffer, a step count; the others do not save it), or
    read whole into ``value`` (the saved shape; any dtype it converts to)."""

    value: torch.Tensor

    @property
    def shape(self) -> Shape:
        return tuple(self.value.shape)

    def parts(self) -> list[tuple[Box, torch.Tensor]]:
        return [(Box((0,) * self.value.dim(), self.shape, 0), self.value)]


@dataclass
class Blob:
    """A small Python object (a hyperparameter) saved whole by one rank with ``torch.save``, or read
    into ``value`` by a load (``torch.load`` with ``weights_only``; ``loaded`` once it was)."""

    value: Any = None
    loaded: bool = False


Entry = FlatRange | Whole | Blob
"""What a rank saves, or reads, under one name of the checkpoint."""


def whole(value: Any) -> Whole | Blob:
    """``value`` saved whole: a tensor as one, anything else with ``torch.save``."""
    return Whole(value.detach()) if isinstance(value, torch.Tensor) else Blob(value)


def read_whole(saved: Any) -> Whole | Blob:
    """Where a load reads a value saved whole (``saved``: its metadata, as :func:`as_meta` gives it)."""
    if isinstance(saved, torch.Tensor):
        return Whole(torch.empty(saved.shape, dtype=saved.dtype))
    assert isinstance(saved, BytesStorageMetadata), f"DCP stores tensors and bytes, not {type(saved).__name__}"
    return Blob()


class PieceSavePlanner(DefaultSavePlanner):
    """Saves a flat mapping of names to :data:`Entry`: pieces as chunks of whole tensors."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = dict(entries)
        self._data: dict[tuple[str, Shape | None], Any] = {}

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, entry in self._entries.items():
            if isinstance(entry, Blob):
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                self._data[(fqn, None)] = entry.value
                continue
            whole = isinstance(entry, Whole)
            if whole:
                entry = Whole(entry.value.detach().contiguous())
            properties = TensorProperties.create_from_tensor(entry.value)
            for box, data in entry.parts():
                index = MetadataIndex(fqn, torch.Size(box.offsets))
                written = TensorWriteData(chunk=box.chunk(), properties=properties, size=torch.Size(entry.shape))
                kind = WriteItemType.TENSOR if whole else WriteItemType.SHARD
                items.append(WriteItem(index=index, type=kind, tensor_data=written))
                self._data[(fqn, box.offsets)] = _exact_storage(data.detach())
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        offsets = None if index.offset is None else tuple(index.offset)
        return self._data[(index.fqn, offsets)]


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads the overlap of the saved chunks with each :data:`Entry` into it."""

    def __init__(self, targets: Mapping[str, Entry]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets = dict(targets)
        self._views: dict[tuple[str, Shape], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "DCP sets the metadata before planning"
        requests: list[ReadItem] = []
        for fqn, target in self._targets.items():
            saved = self.metadata.state_dict_metadata[fqn]
            if isinstance(target, Blob):
                index, origin = MetadataIndex(fqn), torch.Size((0,))  # the whole object, from its start
                requests.append(ReadItem(LoadItemType.BYTE_IO, index, origin, index, origin, lengths=origin))
                continue
            assert isinstance(saved, TensorStorageMetadata), f"{fqn}: checked to be a tensor before loading"
            parts = target.parts()
            for box, view in parts:
                self._views[(fqn, box.offsets)] = view
            requests += create_read_items_for_chunk_list(fqn, saved, [box.chunk() for box, _ in parts])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._views[(index.fqn, tuple(index.offset or ()))]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        target = self._targets[read_item.dest_index.fqn]
        assert isinstance(target, Blob), f"{read_item.dest_index.fqn}: bytes read into a tensor target"
        target.value = torch.load(value, weights_only=True)
        target.loaded = True


def as_meta(saved: Any) -> Any:
    """A saved tensor's metadata as a tensor on the meta device: its shape and dtype, for the checks
    a loaded state passes, whichever format it comes from. Anything else (bytes) as it is."""
    if isinstance(saved, TensorStorageMetadata):
        return torch.empty(tuple(saved.size), dtype=saved.properties.dtype, device="meta")
    return saved


# --- running DCP on the model's ranks ---------------------------------------------------------
def _no_dist(comm: Communicator, what: str) -> bool:
    """Whether DCP runs without collectives (one rank). With several, chunkmem's group must be the
    default group, the one DCP coordinates over here."""
    if comm.world_size == 1:
        return True
    if dist.get_world_size() != comm.world_size:
        raise NotSupportedError(
            f"{what}: the model is sharded over a process group of {comm.world_size} ranks, not the default group of "
            f"{dist.get_world_size()}; sharded checkpoints are written over the default group. Boost over the default "
            "group, or save full checkpoints (shard=False)."
        )
    return False


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # One process without a process group is what chunkmem means at world size 1.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, keeping the names of the files this rank wrote. The metadata ``save``
    returns does not say (its ``storage_data`` is None at world size 1 on torch 2.9-2.12); each
    rank's own write results do, on every release."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.written: set[str] = set()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        def record(done: Future[list[WriteResult]]) -> list[WriteResult]:
            results = done.value()
            self.written.update(result.storage_data.relative_path for result in results)
            return results

        return super().write_data(plan, planner).then(record)


def dcp_save(comm: Communicator, directory: Path, entries: Mapping[str, Entry], what: str) -> list[str]:
    """Write ``entries`` (this rank's) into ``directory`` (a collective over the model's ranks).
    Returns the names of the files this rank wrote."""
    no_dist = _no_dist(comm, what)
    writer = _RecordingWriter(directory)
    with _quiet():
        dcp.save({}, storage_writer=writer, planner=PieceSavePlanner(entries), no_dist=no_dist)
    return sorted(writer.written)


def dcp_load(comm: Communicator, directory: Path, targets: Mapping[str, Entry], what: str) -> Mapping[str, Entry]:
    """Fill ``targets`` from ``directory`` (a collective over the model's ranks); returns them."""
    no_dist = _no_dist(comm, what)
    reader = SafeFileSystemReader(directory)
    with _quiet():
        dcp.load({}, storage_reader=reader, planner=PieceLoadPlanner(targets), no_dist=no_dist)
    unread = [fqn for fqn, target in targets.items() if isinstance(target, Blob) and not target.loaded]
    if unread:
        raise RuntimeError(f"{directory}: the values of {unread[:5]} were not read")
    return targets
