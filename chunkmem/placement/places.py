"""Where data lives: the one vocabulary (``Location``) and the one table of where a chunk's parts
may be placed together (``PLACES``).

A chunk's placement (``snapshot.ChunkPlacement``) is three facts: where its optimizer side (the
fp32 master, the gradient shard and the optimizer states) lives between steps, where its
compute-dtype parameter shard (what gathers read) lives, and whether its gathered buffer stays on
the device between uses. ``PLACES`` says which (optimizer side, parameter shard) pairs can be, and
why the others cannot; a gathered buffer kept on the device needs the optimizer side there too.
The static config's fractions, the policies' layouts and the shard store all take this table's
word: a placement that passed it is built as it says.
"""

from __future__ import annotations

import enum

__all__ = ["PLACES", "Location", "why_not_placed"]


class Location(enum.Enum):
    """Where a buffer lives. On a machine without a GPU the compute device is the CPU, and
    "device" and "host" are still kept apart so that every path runs and is accounted."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    """Files under ``ChunkPlugin(disk_dir=...)``: optimizer sides between steps (the disk tier), and
    offloaded activations beyond ``ActivationPlacement.host_budget``."""


_DEVICE, _HOST, _DISK = Location.DEVICE, Location.HOST, Location.DISK
_MASTER_IS_THE_SHARD = (
    "a master on the device serves as the parameter shard (cast on the fly when gathered), so the "
    "parameter shard cannot be on the {}: put it on the device too, or the optimizer side off it"
)

PLACES: dict[tuple[Location, Location], str | None] = {
    # (optimizer side, parameter shard): None where the pair can be, else why not.
    (_DEVICE, _DEVICE): None,  # nothing offloaded
    (_DEVICE, _HOST): _MASTER_IS_THE_SHARD.format("host"),
    (_DEVICE, _DISK): _MASTER_IS_THE_SHARD.format("disk"),
    (_HOST, _DEVICE): None,  # Gemini's offload_optim alone: a device copy of the shard, refreshed per step
    (_HOST, _HOST): None,  # ZeRO-Offload: gathers copy the host shard to the device
    (_HOST, _DISK): (
        "a parameter shard on disk is written by its chunk's step from disk: put the optimizer side on disk too"
    ),
    (_DISK, _DEVICE): None,
    (_DISK, _HOST): None,  # the disk tier: the side is stepped from disk, gathers read host memory
    (_DISK, _DISK): None,  # ZeRO-Infinity: gathers read the shard from disk
}
"""Every (optimizer side, parameter shard) pair: ``None`` where a chunk can be placed so, else why
it cannot."""


def why_not_placed(optim: Location, shard: Location, keep_gathered: bool) -> str | None:
    """Why a chunk cannot be placed so (``None``: it can), from ``PLACES``."""
    why = PLACES[optim, shard]
    if why is None and keep_gathered and optim is not _DEVICE:
        why = (
            "a chunk kept gathered keeps its optimizer side on the device (as in Gemini): place it there, "
            "or release the chunk between uses"
        )
    return why
