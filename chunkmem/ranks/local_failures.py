"""``LocalFailures``: errors a rank keeps instead of raising them alone, until the ranks agree on them.

A read that fails on one rank only in a forward or a backward (each rank reads files of its own:
the saved activations it wrote to the disk tier, the weights files on its node's disk) must not
raise there at once: the other ranks would wait in their next chunk collective until the
process-group timeout (and on gloo past it). The rank goes on with zeros in place of what it
could not read, so its collectives stay in step with the others', and notes the error here. The
ranks agree at the next point where they already exchange something before those values change
anything (``execution.read_agreement``: the all-reduce that ends every synchronised backward, and
after a forward for models that read in place); there every rank raises the same
``DiskTierError``, naming each failing rank's error.

How long a failure lasts (``Lasts``): one that spoiled this iteration's gradients (an activation
read back wrong) goes once they are dropped (``zero_grad``); one whose cause stays (a weights
file changed after boost) is raised at every agreement from then on. Once the ranks agreed a
failure, every rank keeps the agreed error and refuses the optimizer step with it until
``zero_grad`` (``refuse_step``; no collective: every rank holds the same error).

At world size 1 there is nobody to wait: ``note`` raises at once, and keeps the error as the
agreed one first, so that the optimizer step is refused until ``zero_grad`` as with several ranks
(a user who catches the error and steps would apply the gradients of a half-run backward).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import DiskTierError

__all__ = ["Lasts", "LocalFailure", "LocalFailures"]


class Lasts(enum.Enum):
    """How long a noted failure holds."""

    ITERATION = "iteration"
    """It spoiled this iteration's gradients: dropped with them (``zero_grad``)."""
    RUN = "run"
    """Its cause stays (a weights file changed): raised at every agreement from then on."""


@dataclass(frozen=True, slots=True)
class LocalFailure:
    """One failure of this rank: ``what`` failed (``"reading the frozen weights in place"``), and how."""

    what: str
    error: DiskTierError
    lasts: Lasts


class LocalFailures:
    """This rank's failures kept for the ranks' next agreement; see the module docstring."""

    def __init__(self, world_size: int) -> None:
        self._defer = world_size > 1
        self._kept: list[LocalFailure] = []
        self._agreed: DiskTierError | None = None

    def note(self, what: str, error: DiskTierError, lasts: Lasts) -> None:
        """``what`` failed with ``error`` on this rank: raise it now (one rank), or keep it, the
        first of each ``what``, for the agreement."""
        if not self._defer:
            self._agreed = error
            raise error
        if all(kept.what != what for kept in self._kept):
            self._kept.append(LocalFailure(what, error, lasts))

    @property
    def kept(self) -> tuple[LocalFailure, ...]:
        """What this rank noted and still holds, in the order noted."""
        return tuple(self._kept)

    def agreed(self, error: DiskTierError) -> None:
        """The ranks agreed ``error`` (raised on every rank now): the step is refused until ``zero_grad``."""
        self._agreed = error

    def refuse_step(self) -> None:
        """Raise the agreed error again, if one holds (before an optimizer step: every rank has it)."""
        if self._agreed is not None:
            raise DiskTierError(
                f"{self._agreed}. This optimizer step is refused: call zero_grad() to drop this iteration's "
                "gradients and go on"
            ) from self._agreed

    def end_iteration(self) -> None:
        """The iteration's gradients were dropped: so are the failures that spoiled them (those of
        ``Lasts.RUN`` stay) and the agreed error."""
        self._kept = [kept for kept in self._kept if kept.lasts is Lasts.RUN]
        self._agreed = None
