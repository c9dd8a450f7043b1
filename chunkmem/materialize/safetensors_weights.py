"""``SafetensorsWeights``: a checkpoint in the ``safetensors`` format (a ``transformers`` model
directory, sharded or not, or one ``.safetensors`` file), read a slice at a time.

A rank reads only the elements of its shard. A piece of a flattened tensor is a run of whole rows
plus partial rows at both ends (rows along the first dimension): the covering rows are read with
``get_slice`` and cut. Each read opens the file and closes it again, so the pages it mapped are
released at once and a rank never holds more of the file than one slice.

``location`` says where a piece's bytes lie in its file (safetensors stores each tensor contiguous,
little-endian, after an 8-byte header length and a JSON header): what a frozen chunk read in place
(``chunkmem.tiers.weights_in_place``) reads for each gather.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from ..errors import DiskTierError, MaterializeError

__all__ = ["SafetensorsWeights"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safe_open(path: Path) -> object:
    try:
        from safetensors import safe_open
    except ImportError as error:  # pragma: no cover - safetensors comes with transformers
        raise MaterializeError("reading weights= needs the safetensors package (pip install safetensors)") from error
    return safe_open(str(path), framework="pt", device="cpu")


def _unreadable() -> tuple[type[Exception], ...]:
    """What reading a file that is not a whole safetensors file raises (its header cut short, or
    not JSON, or naming bytes past the end)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        return (OSError, ValueError, KeyError, struct.error)
    return (OSError, ValueError, KeyError, struct.error, SafetensorError)


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint: names, shapes, dtypes, and slices on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        self.path = root
        if root.is_file():
            files = [root]
        elif (root / _INDEX).is_file():
            with open(root / _INDEX) as handle:
                weight_map: dict[str, str] = json.load(handle)["weight_map"]
            files = sorted({root / name for name in weight_map.values()})
        elif (root / _SINGLE).is_file():
            files = [root / _SINGLE]
        else:
            raise FileNotFoundError(
                f"weights={str(path)!r}: expected a safetensors file, or a directory holding {_SINGLE} or {_INDEX} "
                "with its shards (what transformers' save_pretrained writes)"
            )
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        self._data_offset: dict[str, int] = {}
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"weights={str(path)!r}: the index names {file.name}, which does not exist")
            try:
                self._read_header(file)
            except MaterializeError:
                raise
            except _unreadable() as error:
                raise DiskTierError(
                    f"the weights file {file} cannot be read ({type(error).__name__}: {error}): it is truncated, "
                    "still being written, or not a safetensors file. Boost from a complete checkpoint (compare the "
                    "file's size with the saved one's, or write it again with save_pretrained)"
                ) from error

    def _read_header(self, file: Path) -> None:
        """Each tensor of ``file``: its name, shape, dtype and where its bytes lie."""
        self._data_offset.update(_data_offsets(file))
        with _safe_open(file) as handle:
            names = handle.keys()
            for key in names:
                piece = handle.get_slice(key)
                self._file[key] = file
                self._shape[key] = tuple(piece.get_shape())
                self._dtype[key] = piece.get_dtype()

    def __contains__(self, key: str) -> bool:
        return key in self._file

    def keys(self) -> list[str]:
        return list(self._file)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def location(self, key: str, start: int) -> tuple[Path, int] | None:
        """The file holding ``key`` and the byte offset there of its flattened element ``start``
        (``None``: a dtype torch does not know)."""
        dtype = _DTYPES.get(self._dtype[key])
        if dtype is None:
            return None
        return self._file[key], self._data_offset[key] + start * dtype.itemsize

    def stored_dtype(self, key: str) -> torch.dtype | None:
        """The dtype ``key`` is stored in (``None``: one torch does not know)."""
        return _DTYPES.get(self._dtype[key])

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, 1-D, in its stored dtype."""
        shape = self._shape[key]
        with _safe_open(self._file[key]) as handle:
            if len(shape) == 0:
                return handle.get_tensor(key).reshape(-1)[start:stop]
            row = math.prod(shape[1:])
            if row == 0:
                return torch.empty(0, dtype=_DTYPES.get(self._dtype[key], torch.float32))
            first, last = start // row, -(-stop // row)
            rows = handle.get_slice(key)[first:last]
            return rows.reshape(-1)[start - first * row : stop - first * row]

    def read_all(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (for buffers, which are small)."""
        with _safe_open(self._file[key]) as handle:
            return handle.get_tensor(key)


def _data_offsets(file: Path) -> dict[str, int]:
    """Each tensor's first byte in ``file`` (the safetensors format: a little-endian u64 header
    length, the JSON header with each tensor's ``data_offsets`` from the end of the header)."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {key: 8 + length + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"}
