"""``ShardKind``: what one chunk's shard stores, decided once from its parameters and the compute
dtype; ``SourceKind``: where a gather reads it from, which follows from placement.

A trained chunk keeps an fp32 master (what the optimizer updates), its gradient shard and the
compute-dtype copies gathers read. A frozen chunk is never updated, so it needs neither gradient
nor optimizer state; whether it needs a master depends on its parameters' own dtype:

* in the compute dtype (a bf16 LoRA base computed in bf16, an fp32 one in fp32): those values are
  all there is (``FROZEN_VALUES``): no fp32 master anywhere, no write-back after the boost;
* in another dtype (fp32 weights computed in 16 bits): the fp32 values are the user's weights that
  ``state_dict`` and ``save_model`` give back, so they stay as the master, and gathers read their
  16-bit copy (``FROZEN_MASTER``);
* quantized (a 4-bit base: packed weights and their scales, ``chunkmem.quantized``): kept and gathered
  in their own dtype (uint8, float32) as they are, never cast; the ops using them dequantize
  (``QUANTIZED``). Such a chunk holds only quantized tensors, and its dtype is theirs.
"""

from __future__ import annotations

import enum

import torch

from .master_buffer import MASTER_DTYPE

__all__ = ["ShardKind", "SourceKind"]


class ShardKind(enum.Enum):
    """What a chunk's shard stores; see the module docstring."""

    TRAINED = "trained"
    """An fp32 master, its gradient shard, and the compute-dtype copies derived from the master."""
    FROZEN_MASTER = "frozen_master"
    """Frozen parameters of another dtype than the compute dtype: their fp32 values as master and
    the compute-dtype copies derived from it; no gradient shard."""
    FROZEN_VALUES = "frozen_values"
    """Frozen parameters in the compute dtype: their values only, in that dtype."""
    QUANTIZED = "quantized"
    """A quantized frozen base's stored tensors (packed 4-bit weights, their scales): their values
    only, in their own dtype, which is the chunk's (what gathers read: never cast)."""

    @staticmethod
    def of(trainable: bool, param_dtype: torch.dtype, compute_dtype: torch.dtype, quantized: bool = False) -> ShardKind:
        """The kind of a chunk whose parameters have ``param_dtype`` (one dtype per chunk);
        ``quantized``: a chunk of a quantized base's stored tensors."""
        if quantized:
            return ShardKind.QUANTIZED
        if trainable:
            return ShardKind.TRAINED
        return ShardKind.FROZEN_VALUES if param_dtype == compute_dtype else ShardKind.FROZEN_MASTER

    @property
    def has_grad(self) -> bool:
        return self is ShardKind.TRAINED

    @property
    def values_only(self) -> bool:
        """The shard keeps the values alone, in the dtype gathers read (no master, no cast)."""
        return self is ShardKind.FROZEN_VALUES or self is ShardKind.QUANTIZED

    def values_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the shard's authoritative values (the master, or the values alone), for a
        chunk gathered in ``compute_dtype`` (a quantized chunk's is its tensors' own)."""
        return compute_dtype if self.values_only else MASTER_DTYPE


class SourceKind(enum.Enum):
    """Where a gather reads this rank's shard from."""

    DEVICE_MASTER = "device_master"
    DEVICE_COPY = "device_copy"
    HOST = "host"
    DISK = "disk"
