"""A TCP publisher's payloads, relayed piece by piece as their bytes arrive on the data port.

The publisher sends each payload as an ``entry`` frame (its size) and that many raw bytes,
then ``end``. Each payload's header is checked against the limits (and against the size the
frame announced) before the payload takes the channel; then every :data:`TCP_PIECE` bytes
received become one :class:`~.channel_pieces.Chunk` relayed to every subscriber, so the
server holds at most the subscribers' bounded buffers of a payload, whatever its size, and
never one copy per subscriber.

The same rules as a gRPC publisher's: between payloads the publisher holds nothing and may
wait as long as it likes; inside one, each receive must bring bytes within the channel
timeout, or the payload is abandoned and the call ends DEADLINE_EXCEEDED; a connection that
breaks mid-payload abandons it (subscribers that got some of it are told to discard it).
Once a payload's last byte is in, its last piece is relayed even if the call ends
meanwhile, so a payload is never whole for some subscribers and abandoned for others.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

from tannery_protocol.codec import FormatError, Limits, read_info
from tannery_protocol.datalink import Link, LinkClosed, expect, frame
from tannery_protocol.v1.data_pb2 import DataEnd

from .channel_pieces import Chunk
from ..failures import BadPayload, DeadlineExceeded, Malformed
from ..hub import Channel, Relay
from ..workers import Workers

#: Bytes of a TCP publisher's piece (or the chunk size, if larger): one worker-thread step of
#: each subscriber's sending; a gRPC subscriber gets it as messages of the chunk size.
TCP_PIECE = 4 << 20


async def receive_published(link: Link, channel: Channel, limits: Limits, chunk_size: int, timeout: float,
                            workers: Workers, relay_last: Callable[..., Any]) -> tuple[int, int, int]:
    """Relay every payload a TCP publisher sends, until its ``end``; returns the payloads,
    bytes and subscribers dropped."""
    payloads = total = dropped = 0
    while True:
        link.sock.settimeout(None)  # between payloads: no bound
        received, _ = await workers.run(link.receive)
        if expect(received, "entry", "end") == "end":
            if received.end.entries != payloads or received.end.payload_bytes != total:
                raise Malformed(f"the publisher's end says {received.end.entries} payloads of "
                                f"{received.end.payload_bytes} bytes, {payloads} of {total} arrived")
            await workers.run(link.send, frame(end=DataEnd(entries=payloads, payload_bytes=total)))
            return payloads, total, dropped
        if not received.entry.payload_bytes:
            raise BadPayload(f"payload {payloads + 1} of this call is malformed: an entry frame of 0 bytes")
        link.sock.settimeout(timeout)
        payload = _Payload(link, channel, received.entry.payload_bytes, payloads + 1, chunk_size, timeout, workers)
        dropped += await payload.relay_all(limits, relay_last)
        payloads += 1
        total += payload.size


class _Payload:
    """One payload of a TCP publisher: its bytes received piece by piece and relayed."""

    def __init__(self, link: Link, channel: Channel, size: int, number: int, chunk_size: int, timeout: float,
                 workers: Workers) -> None:
        self.link, self.channel, self.size, self.number = link, channel, size, number
        self.chunk_size, self.timeout, self.workers = chunk_size, timeout, workers
        #: Bytes received so far.
        self.received = 0

    async def relay_all(self, limits: Limits, relay_last: Callable[..., Any]) -> int:
        """Check the header, take the channel, relay every piece; how many subscribers were dropped.
        Whatever stops it before the last piece abandons the payload."""
        first = await self._piece()
        self._check(first, limits)
        relay: Relay | None = await self.channel.begin(self.size)
        dropped = 0
        try:
            piece = first
            while self.received < self.size:
                dropped += await relay.put(piece, piece.nbytes, self.timeout)
                piece = await self._piece()
            # The last piece is relayed even if the call ends meanwhile (shielded, bounded by the timeout).
            last, relay = relay, None
            return dropped + await asyncio.shield(relay_last(last, (piece, piece.nbytes), self.timeout))
        finally:
            if relay is not None:
                relay.abandon()

    async def _piece(self) -> Chunk:
        """The next piece of the payload's bytes, received into memory of its own (shared by every
        subscriber once relayed); DeadlineExceeded when the publisher sends nothing for the timeout."""
        data = bytearray(min(max(self.chunk_size, TCP_PIECE), self.size - self.received))
        try:
            await self.workers.run(self._receive, memoryview(data))
        except socket.timeout:
            raise DeadlineExceeded(
                f"publisher stalled on channel {self.channel.name!r}: no bytes for {self.timeout:g} s in the middle "
                f"of payload {self.number} of this call ({self.received} of {self.size} bytes sent); the payload is "
                "abandoned") from None
        return Chunk(data)

    def _receive(self, view: memoryview) -> None:
        """Fill ``view`` from the connection (a worker thread), counting the bytes in
        :attr:`received` as they come: a stall's message says how many did."""
        while view.nbytes:
            got = self.link.sock.recv_into(view)
            if not got:
                raise LinkClosed(f"data connection closed by the publisher after {self.received} of {self.size} "
                                 f"bytes of payload {self.number}")
            self.received += got
            view = view[got:]

    def _check(self, first: Chunk, limits: Limits) -> None:
        """BadPayload unless the payload's header (in its first piece) is valid, within the limits,
        and says the size its ``entry`` frame announced."""
        try:
            info = read_info(first.data, limits)
        except FormatError as error:
            raise BadPayload(f"payload {self.number} of this call is malformed: {error}") from None
        if info is None or info.size != self.size:
            says = f"a payload of {info.size} bytes" if info is not None else "less than its own header"
            raise BadPayload(f"payload {self.number} of this call is malformed: its entry frame announced "
                             f"{self.size} bytes, its header says {says}")
