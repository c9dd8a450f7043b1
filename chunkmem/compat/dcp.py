"""``torch.distributed.checkpoint``'s private names that chunkmem's safe metadata reader knows.
Checked on torch 2.13. Imported only by that reader (DCP loads with the first sharded save or load).

A DCP checkpoint's ``.metadata`` file is a pickle that names these private objects; the reader
rebuilds them without unpickling arbitrary code, so it needs their dotted names and the class.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["GET_LAYOUT", "MEMORY_FORMATS", "MEMORY_FORMAT_ENCODING", "STORAGE_INFO", "StorageInfo"]

StorageInfo = _StorageInfo
"""``torch.distributed.checkpoint.filesystem._StorageInfo``: where one item's bytes lie in a data
file (``relative_path``, ``offset``, ``length``, ``transform_descriptors``)."""

STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
"""``StorageInfo``'s dotted name, as the metadata pickle names it."""

GET_LAYOUT = "torch.serialization._get_layout"
"""The function a pickled ``TensorProperties`` calls to rebuild its layout from the layout's name."""

MEMORY_FORMAT_ENCODING = "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"
"""The enum a pickled ``TensorProperties`` calls to rebuild its memory format from a number."""

MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}
"""The memory formats by the number a pickled ``TensorProperties`` gives ``MEMORY_FORMAT_ENCODING``
(that private enum's values)."""
