"""``SavedMeter``: the saved activations of a boosted model on the compute device that no device
budget governs, measured (``Stats.unbudgeted_activation_bytes`` and its peak).

The budget governs chunk memory and the saved activations of ``ActivationPlacement(auto=...)``
calls (and of the stretches ``offload_outside`` offloads with them): those are in the ledger
(``DeviceActivations``). Everything else autograd saves for the backward of a training forward of
the boosted model stays where autograd keeps it, and is only measured here:

* what is saved outside any placed block (the embeddings, the head, the loss: its logits' log
  softmax), and inside blocks no ``ActivationPlacement`` names: the meter's saved-tensor hooks
  are entered around the model's whole training forward, beneath every other hook of chunkmem's
  (the blocks' offload, keep and checkpoint hooks, the stretches outside the blocks) and of the
  model's own, so it sees exactly what none of them places (the hooks with which the auto
  placement policy profiles an iteration on the CPU count each tensor and hand it on to the
  meter's: ``usage.memory.NonModelSampler``);
* the storages an ``offload`` block (or a stretch outside the blocks, without ``auto``) leaves on
  the device (under ``min_offload_bytes``), and an offloaded call's copies fetched back for its
  backward, until the call is gone (``keep``, ``hold``).

Each storage counts once however many saved tensors share it, from its save until autograd lets go
of the last of them (its backward ran, or the graph was dropped). Model memory is never counted:
the runtime's parameters and their views are told apart by type (a tensor subclass, or a view of
a parameter), the model's buffers by storage (the counting rule of ``counting``, where a plain
tensor sharing a gathered chunk's storage is told apart by a scan of every parameter, which a
meter around every forward cannot afford; chunkmem's ops hand out no such tensor).

Not counted: a recomputed block's tensors (its checkpoint's inputs are: it saves them as an
autograd node outside its own hooks; its recomputation in the backward is one block's working
set), temporaries, and a forward under saved-tensor hooks of the user's around the boosted model
(the meter does not put its own beneath them, which would take what they save from them) or on
the meta device (a plan).

Only a model with an ``ActivationPlacement`` is measured (the plugin makes no meter otherwise):
under saved-tensor hooks PyTorch unpacks every saved tensor as a new tensor object, so a custom
``torch.autograd.Function`` that saved a parameter gets back a plain tensor sharing its values,
not the runtime's hooked parameter, and its backward's ops on it are not seen by the runtime's op
hooks (what the runtime records of the backward, and gathers for it, then rests on the node's
autograd bridges alone). A placement already runs the blocks it names under such hooks; the meter adds the rest of
the forward, and leaves a model without one as plain PyTorch runs it. Under the hooks the meter
checks, as autograd does without hooks, that a saved tensor was not written in place before its
backward (``usage.saved.KeptTensor``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..compat.torch import view_base
from ..usage.saved import KeptTensor, LiveSaved, top_hooks, unlinked
from .counting import storage_key

__all__ = ["SavedMeter"]


class SavedMeter:
    """See the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._live = LiveSaved()
        self._buffers: set[int] = set()  # the model's buffers' storages, while a forward runs

    @property
    def bytes(self) -> int:
        """Unbudgeted saved-activation bytes on the device now."""
        return self._live.bytes

    @property
    def peak_bytes(self) -> int:
        """The most of them at once since boosting."""
        return self._live.peak_bytes

    def keep(self, tensor: torch.Tensor) -> KeptTensor:
        """The handle of a saved tensor left on the device (counted while a handle holds it)."""
        return self._live.keep(tensor)

    def hold(self, owner: object, nbytes: int) -> None:
        """``nbytes`` on the device (a fetched copy) while ``owner`` lives."""
        self._live.hold(owner, nbytes)

    @contextmanager
    def forward(self, device: torch.device) -> Iterator[None]:
        """Around the boosted model's forward on ``device``: a training forward is measured."""
        if not torch.is_grad_enabled() or device.type == "meta" or top_hooks() is not None:
            yield
            return
        self._buffers = {storage_key(b) for b in self._model.buffers()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or isinstance(view_base(tensor), torch.nn.Parameter)
            or storage_key(tensor) in self._buffers
        ):
            return unlinked(tensor)
        return self._live.keep(tensor)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.get() if isinstance(saved, KeptTensor) else saved
