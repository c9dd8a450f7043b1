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

The listener holds what it hands messages to weakly: it waits in a receive for as long as the
process runs, and a strong reference from it would keep the boosted model that owns the channel
(its chunks, its disk tier's scratch files) alive after the user dropped it.
"""

from __future__ import annotations

import datetime
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


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    sender: int
    """The sender's index in the group (its group rank)."""
    numbers: tuple[int, ...]
    text: str


class RankChannel:
    """Messages between the ranks ``ranks`` (global ranks; this process is ``ranks[rank]``). Every
    message received is handed to ``receive`` on the listener thread, which must not block for long."""

    def __init__(
        self, ranks: Sequence[int], rank: int, timeout: datetime.timedelta, receive: Callable[[Message], None]
    ) -> None:
        self._ranks = list(ranks)
        self._rank = rank
        self._group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self._receive = receive
        self._sending = threading.Lock()  # a header and its text leave one after the other
        self._in_flight: list[Any] = []  # sends not waited for, kept until they complete
        self._listener = threading.Thread(
            target=_listen,
            args=(self._group, self._ranks, weakref.WeakMethod(receive)),
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


def _listen(group: Any, ranks: Sequence[int], receiver: weakref.WeakMethod[Callable[[Message], None]]) -> None:
    """The listener thread: every message to ``receiver`` while it lives (see the module docstring)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    while True:
        try:
            dist.irecv(header, src=None, group=group, tag=_HEADER_TAG).wait()
            kind, sender, *numbers, length = (int(v) for v in header.tolist())
            text = ""
            if length:
                payload = torch.empty(length, dtype=torch.uint8)
                dist.recv(payload, src=ranks[sender], group=group, tag=kind)
                text = bytes(payload.tolist()).decode()
        except Exception:  # the group is gone (shutdown, a rank's process ended): stop listening
            return
        receive = receiver()
        if receive is None:  # its model was collected
            return
        try:
            receive(Message(kind, sender, tuple(numbers), text))
        except Exception:  # a message that cannot be handled must not stop the listener
            log.exception("chunkmem: handling a message from rank %d failed", sender)
        del receive
