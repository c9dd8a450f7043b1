"""``RankChannel``: short point-to-point messages between the ranks of a group, read by a listener
thread, so that a rank can be reached while its main thread is busy or blocked.

The cross-rank checks use it for alarms (a rank departed from the trace), for asking another rank
what its main thread is doing while an agreement waits for it, for the answer, and for the verdict
that ends the wait. Messages travel on a small gloo group of their own: a fixed header (a kind,
the sender and five numbers) from any rank, then, when there is one, a text from that rank. Each
kind's text has a tag of its own, because the main thread and the listener send different kinds
at the same time; one thread sends all messages of a kind, so a header and its text pair up.

A gloo send completes only once the receiving rank has posted its receive, so nothing here waits
for a send unless told to: two listeners answering each other at once would each wait for the
other to come back to receiving.

The listener holds what it hands messages to weakly: a strong reference from it would keep the
boosted model that owns the channel (its chunks, its disk tier's scratch files) alive after the user
dropped it. Its owner ``close``s the channel when that model is collected, and the channel's gloo
groups (each a few threads and sockets) are destroyed once every rank has let go of its model, so a
process that boosts model after model on every rank (a sweep, a test session's ranks) does not
pile them up. (A rank that keeps its model keeps the others' groups alive; after the user destroyed
every group, as a script's last line may, nothing is left to tell and the listener stays blocked
until the process ends.) A receive cannot be cancelled, so
closing is a short handshake: each rank that closes its end says so to every other rank, and a
listener stops once every other rank has closed theirs (nothing more can come) or the group failed
(a rank's process ended). The groups are destroyed once both this rank has closed and its listener
has stopped, on the thread that saw the second of the two, never on the thread that dropped the
model (a garbage collection can run inside any call).
"""

from __future__ import annotations

import datetime
import enum
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Message", "RankChannel"]

log = logging.getLogger("chunkmem")

_NUMBERS = 5
_HEADER = 2 + _NUMBERS + 1  # kind, sender, numbers, length of the text
_HEADER_TAG = 0
_CLOSED = 0  # the kind of the header that says its sender closed its end (no text; ``send`` refuses it)
# How long a closing message waits to be received: a live listener takes it at once; one that stopped
# because another rank's process ended never will (a timed-out wait closes the connection, harmless here).
_CLOSING_WAIT = datetime.timedelta(seconds=10)


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    sender: int
    """The sender's index in the group (its group rank)."""
    numbers: tuple[int, ...]
    text: str


class ChannelState(enum.Enum):
    """Where a channel is in its life (changed only by ``_Ends``' verbs)."""

    OPEN = "open"
    """This rank uses it; the listener receives."""
    CLOSING = "closing"
    """This rank closed its end; the listener receives until every other rank has closed theirs."""
    PEERS_GONE = "peers gone"
    """Every other rank closed its end, or the group failed; this rank has not closed its own."""
    CLOSED = "closed"
    """Both: its groups are destroyed (or being destroyed)."""


class _Ends:
    """What the channel and its listener share about its ending: its state and the groups destroyed
    at the end. It holds nothing of the channel's owner."""

    def __init__(self, group: Any, rank: int) -> None:
        self._lock = threading.Lock()
        self._state = ChannelState.OPEN
        self._rank = rank
        self._groups: list[Any] = [group]

    @property
    def state(self) -> ChannelState:
        return self._state

    def closed_here(self, groups: Sequence[Any]) -> None:
        """This rank's closing messages were received, or could not be (``groups``: more groups to
        destroy with the channel's). The end of the two, if the listener had already stopped: then it
        destroys the groups, on this thread."""
        with self._lock:
            if self._state not in (ChannelState.OPEN, ChannelState.PEERS_GONE):
                raise RuntimeError(
                    f"RankChannel of group rank {self._rank}: closed while {self._state.value}; a channel is closed "
                    "once, by its owner"
                )
            self._groups += groups
            last = self._state is ChannelState.PEERS_GONE
            self._state = ChannelState.CLOSED if last else ChannelState.CLOSING
        if last:
            self._destroy()

    def listener_stopped(self) -> None:
        """The listener stopped (every other rank closed its end, or the group failed). The end of
        the two, if this rank had already closed: then it destroys the groups, on the listener's thread."""
        with self._lock:
            if self._state not in (ChannelState.OPEN, ChannelState.CLOSING):
                raise RuntimeError(
                    f"RankChannel of group rank {self._rank}: its listener stopped while {self._state.value}; it "
                    "stops once"
                )
            last = self._state is ChannelState.CLOSING
            self._state = ChannelState.CLOSED if last else ChannelState.PEERS_GONE
        if last:
            self._destroy()

    def _destroy(self) -> None:
        for group in self._groups:
            try:
                dist.destroy_process_group(group)
            except Exception as error:  # already destroyed with every group, by the user
                log.debug("chunkmem: a check group of rank %d was gone already: %s", self._rank, error)


class RankChannel:
    """Messages between the ranks ``ranks`` (global ranks; this process is ``ranks[rank]``). Every
    message received is handed to ``receive`` on the listener thread, which must not block for long.
    Its owner calls ``close`` when it is done with it (see the module docstring)."""

    def __init__(
        self, ranks: Sequence[int], rank: int, timeout: datetime.timedelta, receive: Callable[[Message], None]
    ) -> None:
        self._ranks = list(ranks)
        self._rank = rank
        group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self._group = group
        self._ends = _Ends(group, rank)
        self._sending = threading.Lock()  # a header and its text leave one after the other
        self._in_flight: list[Any] = []  # sends not waited for, kept until they complete
        self._listener = threading.Thread(
            target=_listen,
            args=(group, self._ranks, rank, weakref.WeakMethod(receive), self._ends),
            name="chunkmem-alarms",
            daemon=True,
        )
        self._listener.start()

    def send(self, to: int, kind: int, numbers: Sequence[int] = (), text: str = "") -> list[Any]:
        """Start sending a message to the rank with index ``to``; returns the sends, which the
        caller may wait for (they complete once that rank receives). ``kind`` is at least 1 (it
        tags the text)."""
        if kind < 1 or len(numbers) > _NUMBERS:
            raise ValueError(f"RankChannel.send: kind {kind} must be >= 1 and at most {_NUMBERS} numbers given")
        if self._ends.state in (ChannelState.CLOSING, ChannelState.CLOSED):
            raise RuntimeError(f"RankChannel.send: rank {self._rank} closed this channel; its owner is gone")
        return self._send(to, kind, numbers, text)

    def _send(self, to: int, kind: int, numbers: Sequence[int], text: str) -> list[Any]:
        data = text.encode()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1], header[-1] = kind, self._rank, len(data)
        header[2 : 2 + len(numbers)] = torch.tensor(list(numbers), dtype=torch.int64)
        dst = self._ranks[to]
        with self._sending:
            works = [dist.isend(header, dst=dst, group=self._group, tag=_HEADER_TAG)]
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                works.append(dist.isend(payload, dst=dst, group=self._group, tag=kind))
            self._in_flight = [work for work in self._in_flight if not work.is_completed()] + works
        return works

    def post(self, to: int, kind: int, numbers: Sequence[int] = (), text: str = "") -> bool:
        """Send without waiting; returns whether the send could start (a rank whose process ended
        cannot be reached)."""
        try:
            self.send(to, kind, numbers, text)
        except RuntimeError as error:
            log.debug("chunkmem: rank %d could not be reached: %s", to, error)
            return False
        return True

    def close(self, with_groups: Sequence[Any] = ()) -> None:
        """This rank is done with the channel: tell every other rank, and destroy the channel's group
        and ``with_groups`` once every other rank has closed its end too. Returns at once: the rest
        runs on a thread of its own (a garbage collection inside any call may be what closes it).
        Called once, by the owner."""
        threading.Thread(
            target=self._close, args=(tuple(with_groups),), name="chunkmem-channel-end", daemon=True
        ).start()

    def _close(self, with_groups: tuple[Any, ...]) -> None:
        for to in range(len(self._ranks)):
            if to == self._rank:
                continue
            try:  # received at once: the other rank's listener waits for it before it stops
                for send in self._send(to, _CLOSED, (), ""):
                    send.wait(timeout=_CLOSING_WAIT)
            except Exception as error:  # its process ended, or the user destroyed every group: nothing to tell
                log.debug("chunkmem: rank %d could not be told the channel closed: %s", to, error)
        self._ends.closed_here(with_groups)


def _listen(
    group: Any,
    ranks: Sequence[int],
    rank: int,
    receiver: weakref.WeakMethod[Callable[[Message], None]],
    ends: _Ends,
) -> None:
    """The listener thread: every message to ``receiver`` while it lives, until every other rank
    closed its end or the group failed (see the module docstring)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    open_ends = set(range(len(ranks))) - {rank}
    while open_ends:
        try:
            dist.irecv(header, src=None, group=group, tag=_HEADER_TAG).wait()
            kind, sender, *numbers, length = (int(v) for v in header.tolist())
            text = ""
            if length:
                payload = torch.empty(length, dtype=torch.uint8)
                dist.recv(payload, src=ranks[sender], group=group, tag=kind)
                text = bytes(payload.tolist()).decode()
        except Exception:  # the group is gone (shutdown, a rank's process ended): stop listening
            break
        if kind == _CLOSED:
            open_ends.discard(sender)
            continue
        receive = receiver()
        if receive is None:  # its owner was collected and is closing: the others' messages go unread
            continue
        try:
            receive(Message(kind, sender, tuple(numbers), text))
        except Exception:  # a message that cannot be handled must not stop the listener
            log.exception("chunkmem: handling a message from rank %d failed", sender)
        del receive
    ends.listener_stopped()
