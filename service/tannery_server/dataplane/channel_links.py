"""Channels on the data paths: a publisher's payloads and a subscriber's pieces on a data connection.

Same host: a publisher passes each payload as one sealed memory file (memfd); the server
maps it, checks its header against the limits, and relays it as one piece, a
:class:`~.channel_pieces.SharedPayload`, through the same hub (order, bounded buffers,
dropping a subscriber that falls behind). A same-host subscriber receives that memory
file's descriptor and maps it: no payload byte is copied between the two processes.

TCP (the data port): a publisher sends each payload's raw bytes after an ``entry`` frame,
relayed piece by piece as they arrive (:mod:`.channel_tcp`); a TCP subscriber receives every
piece as an ``entry`` frame and its raw bytes, sent from the one object every subscriber
shares (``sendall`` of a view, or ``sendfile`` from a same-host publisher's memory file).

Whatever the publisher's path, every subscriber's path gets every payload: a gRPC subscriber
as messages, a same-host subscriber of bytes as ``entry`` frames too. A payload cut off by
its publisher is an ``abandoned`` frame to a data-path subscriber that got some of it.

The data connection is blocking, so its reads and writes run on the worker threads given.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
from collections import deque
from typing import Any, Callable

from tannery_protocol.codec import FormatError, Limits, parse
from tannery_protocol.datalink import Link, expect, frame
from tannery_protocol.v1.data_pb2 import Abandoned, DataEnd, EntryBytes, MappedEntry

from .channel_pieces import Chunk, SharedPayload
from .channel_tcp import receive_published
from .links import close_all
from ..failures import BadPayload, Malformed
from ..hub import Channel, FellBehind, Subscription
from ..workers import Workers


async def relay_publisher(link: Link, channel: Channel, limits: Limits, chunk_size: int, timeout: float,
                          workers: Workers, relay_last: Callable[..., Any]) -> tuple[int, int, int]:
    """Relay every payload a data-path publisher sends, until its ``end`` (sealed memory files on
    the same host, raw bytes over TCP); returns the payloads, bytes and subscribers dropped."""
    if link.local:
        return await publish_over(link, channel, limits, timeout, workers, relay_last)
    return await receive_published(link, channel, limits, chunk_size, timeout, workers, relay_last)


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
                           timeout: float, sent: Callable[[int], None]) -> None:
    """Pass every piece queued for a data-path subscriber until the subscription ends; ``sent`` is
    told the size of each payload whose last piece was handed to the connection (on the same
    host, a payload passed as a memory file: its whole size, though no byte of it crossed the socket).

    Same host: shared payloads are acknowledged (``taken``) once mapped; at most ``window``
    bytes of them stay unacknowledged. Over TCP the socket's buffers are all that is not
    yet read. A subscriber that neither takes its payloads nor reads its bytes for
    ``timeout`` seconds (four times that over TCP, where a publisher waiting on it drops it
    first) is ended as fallen behind.
    """
    unacknowledged: deque[int] = deque()  # sizes of the shared payloads passed, not yet taken
    # A send to a subscriber that reads nothing gives up. Over TCP the socket's buffers hold
    # megabytes: the send waits four times the timeout, so that a publisher waiting on this
    # subscriber's full buffer drops it first (and counts it), as it would a gRPC one; a
    # subscriber dropped (or the server closing) in the middle of a send has its connection
    # broken at once (what it has read stays whole or is discarded; its status says why).
    send_timeout = timeout if link.local else 4 * timeout
    link.sock.settimeout(send_timeout)
    subscription.on_end = lambda: link.abort() if link.in_payload else None
    while True:
        message, completes = await subscription.take()
        while link.local and unacknowledged and sum(unacknowledged) + _size(message) > window:
            taken = await workers.run(_taken, link, 0.2)
            if taken:
                for _ in range(min(taken, len(unacknowledged))):
                    unacknowledged.popleft()
            elif subscription.ended:
                await subscription.next_piece()  # raises why it ended
        try:
            await workers.run(_send_piece, link, message)
        except OSError as error:
            if subscription.ended:  # dropped by a publisher (or the server closing) meanwhile: why
                await subscription.next_piece()
            if not isinstance(error, socket.timeout):
                raise
            kind = "same-host" if link.local else "TCP"
            raise FellBehind(f"a {kind} subscriber of channel {subscription.channel.name!r} read nothing for "
                             f"{send_timeout:g} s and was dropped") from None
        if link.local and isinstance(message, SharedPayload):
            unacknowledged.append(message.size)
        if completes:
            sent(completes)


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
    """One piece on a subscriber's connection: a memory file's descriptor (same host, a shared
    payload), else an ``entry`` frame and its bytes, or the ``abandoned`` frame."""
    if isinstance(message, SharedPayload) and link.local:
        mapped = MappedEntry(offset=0, length=message.size, file_size=message.size)
        link.send(frame(mapped=mapped), [message.fd])
        return
    if not isinstance(message, (SharedPayload, Chunk)):  # the hub's marker: the payload was cut off
        link.send(frame(abandoned=Abandoned()))
        return
    link.in_payload = True  # from the entry frame on: a failure frame would be read as payload bytes
    if isinstance(message, SharedPayload):  # a same-host publisher's memory file, to a TCP subscriber
        link.send(frame(entry=EntryBytes(payload_bytes=message.size)))
        link.send_file(message.fd, 0, message.size)
    else:
        link.send(frame(entry=EntryBytes(payload_bytes=message.nbytes)))
        link.send_bytes(memoryview(message.data))
    link.in_payload = False
