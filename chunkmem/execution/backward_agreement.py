"""At the end of a synchronised backward the ranks agree, in one small all-reduce, that they ran
the same ops on managed parameters (an op-sequence digest: the maximum of ``d`` and of ``-d`` tell
whether every rank has ``d``), which parameters got a gradient on any rank (a parameter with a
gradient anywhere has one everywhere, as in DDP), and whether a read failed on any rank in the
forward or this backward (``ranks.local_failures``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..chunks.chunk import Chunk
from ..errors import TraceDivergenceError
from ..ranks.comm import Communicator
from ..ranks.local_failures import LocalFailures
from .read_agreement import raise_read_failure, read_failed

__all__ = ["agree_backward"]


def agree_backward(comm: Communicator, digest: int, chunks: Sequence[Chunk], failures: LocalFailures) -> None:
    """Agree ``digest`` and the trainable ``chunks``' gradient flags over ranks; raise
    ``TraceDivergenceError`` naming the odd ranks when the digests differ. Whether a read failed
    on a rank (its ``failures``) rides along: then every rank raises that ``DiskTierError``
    (``read_agreement``)."""
    trainable = [c for c in chunks if c.layout.trainable]
    flags = [int(f) for c in trainable for f in c.grads.params_with_grad]
    values = [digest, -digest, read_failed(failures), *flags]
    payload = torch.tensor(values, dtype=torch.int64, device=comm.tensor_device)
    comm.all_reduce(payload, dist.ReduceOp.MAX)
    if int(payload[2]):
        raise_read_failure(comm, failures)
    if int(payload[0]) != digest or int(-payload[1]) != digest:
        everyone = comm.all_gather_tensors(torch.tensor([digest], device=comm.tensor_device))
        digests = [int(d) for d in everyone]
        reference = max(set(digests), key=digests.count)
        odd = [r for r, d in enumerate(digests) if d != reference]
        raise TraceDivergenceError(
            f"rank {comm.rank}: ranks {odd} ran different operations on managed parameters than the "
            f"other ranks in this iteration (op-sequence digests {digests}), so chunk collectives did not "
            "match and gradients are not trustworthy; the optimizer step must not run. All ranks must "
            "use the same parameters in the same order (no rank-dependent branches in the model)."
        )
    agreed = [bool(v) for v in payload[3:].tolist()]
    start = 0
    for chunk in trainable:
        n = len(chunk.layout.tensors)
        chunk.grads.set_params_with_grad(tuple(agreed[start : start + n]))
        start += n
