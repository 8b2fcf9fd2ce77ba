"""Channels on the same-host data path: payloads as shared memory, not bytes through sockets.

A same-host publisher passes each payload as one sealed memory file (memfd); the server
maps it, checks its header against the limits, and relays it as one piece, a
:class:`SharedPayload`, through the same hub (order, bounded buffers, dropping a subscriber
that falls behind). A same-host subscriber receives that memory file's descriptor and maps
it: no payload byte is copied between the two processes. A gRPC subscriber of the same
channel gets the payload as messages made from the mapping; a same-host subscriber of a
payload published over gRPC gets its pieces as raw bytes on its connection.

The data connection is blocking, so its reads and writes run on the worker threads given.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import weakref
from collections import deque
from typing import Any, Callable, Iterator

from tannery_protocol.codec import FormatError, Limits, parse
from tannery_protocol.datalink import Link, expect, frame
from tannery_protocol.v1 import channels_pb2
from tannery_protocol.v1.data_pb2 import Abandoned, DataEnd, EntryBytes, MappedEntry

from .links import close_all, sealed_map
from ..failures import BadPayload, Malformed
from ..hub import Channel, FellBehind, Subscription
from ..workers import Workers


class SharedPayload:
    """One whole payload in a sealed memory file, relayed to every subscriber as one piece."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mapped = sealed_map(fd, size, "published payload")
        weakref.finalize(self, os.close, fd)

    def messages(self, chunk_size: int) -> Iterator[channels_pb2.SubscribeResponse]:
        """The payload as the messages of a gRPC subscriber."""
        view = memoryview(self.mapped)
        for start in range(0, self.size, chunk_size):
            yield channels_pb2.SubscribeResponse(chunk=bytes(view[start : start + chunk_size]))


async def publish_over(link: Link, channel: Channel, limits: Limits, timeout: float, workers: Workers,
                       relay_last: Callable[..., Any]) -> tuple[int, int, int]:
    """Relay every payload a same-host publisher passes, until its ``end``; returns the payloads,
    bytes and subscribers dropped."""
    payloads = total = dropped = 0
    while True:
        received, fds = await workers.run(link.receive, 1)
        if expect(received, "piece", "end") == "end":
            close_all(fds)
            if received.end.entries != payloads or received.end.payload_bytes != total:
                raise Malformed(f"the publisher's end says {received.end.entries} payloads of "
                                f"{received.end.payload_bytes} bytes, {payloads} of {total} arrived")
            await workers.run(link.send, frame(end=DataEnd(entries=payloads, payload_bytes=total)))
            return payloads, total, dropped
        if len(fds) != 1:
            close_all(fds)
            raise Malformed(f"payload {payloads + 1}: a piece came without its memory file")
        try:
            payload = SharedPayload(fds[0], received.piece.size)
        except BaseException:
            os.close(fds[0])
            raise
        try:
            parse(memoryview(payload.mapped), limits)
        except FormatError as error:
            raise BadPayload(f"payload {payloads + 1} of this call is malformed: {error}") from None
        relay = await channel.begin(payload.size)
        dropped += await asyncio.shield(relay_last(relay, (payload, payload.size), timeout))
        payloads += 1
        total += payload.size


async def serve_subscriber(link: Link, subscription: Subscription, workers: Workers, window: int,
                           timeout: float) -> None:
    """Pass every piece queued for a same-host subscriber until the subscription ends.

    Shared payloads are acknowledged (``taken``) once mapped; at most ``window`` bytes of them
    stay unacknowledged, and a subscriber that neither takes them nor reads its bytes for
    ``timeout`` seconds is ended as fallen behind.
    """
    unacknowledged: deque[int] = deque()  # sizes of the shared payloads passed, not yet taken
    link.sock.settimeout(timeout)  # a send to a subscriber that reads nothing gives up
    while True:
        message = await subscription.next_piece()
        while unacknowledged and sum(unacknowledged) + _size(message) > window:
            taken = await workers.run(_taken, link, 0.2)
            if taken:
                for _ in range(min(taken, len(unacknowledged))):
                    unacknowledged.popleft()
            elif subscription.ended:
                await subscription.next_piece()  # raises why it ended
        try:
            await workers.run(_send_piece, link, message)
        except socket.timeout:
            raise FellBehind(f"a same-host subscriber read nothing for {timeout:g} s and was dropped") from None
        if isinstance(message, SharedPayload):
            unacknowledged.append(message.size)


def _size(message: Any) -> int:
    return message.size if isinstance(message, SharedPayload) else 0


def _taken(link: Link, wait: float) -> int:
    """Payloads the subscriber says it took since the last call (0 when none within ``wait`` s)."""
    ready, _, _ = select.select([link.sock], [], [], wait)
    if not ready:
        return 0
    received, _ = link.receive()
    expect(received, "taken")
    return received.taken.payloads


def _send_piece(link: Link, message: Any) -> None:
    if isinstance(message, SharedPayload):
        mapped = MappedEntry(offset=0, length=message.size, file_size=message.size)
        link.send(frame(mapped=mapped), [message.fd])
    elif getattr(message, "abandoned", False):
        link.send(frame(abandoned=Abandoned()))
    else:  # a piece of a payload published over gRPC: its bytes
        chunk = message.chunk
        link.send(frame(entry=EntryBytes(payload_bytes=len(chunk))))
        link.send_bytes(chunk)
