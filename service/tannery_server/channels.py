"""The ``tannery.v1.Channels`` gRPC service: publish and subscribe to tensor payloads by name.

Publish reads tannic payloads from a stream of chunks with the codec's Deframer (each
header checked against the limits before its buffer is accepted) and relays each payload
whole once its last byte has arrived, so a malformed or truncated payload reaches no one.
The relayed pieces are the chunk objects received (a chunk holding the end of one payload
and the start of the next is sliced), at most ``chunk_size`` bytes each. Each piece
becomes a ``SubscribeResponse`` once, at the publisher, and every subscriber writes that
same message (gRPC serializes it once per subscriber; pre-serializing it once for all was
measured slower for one subscriber and only 20% cheaper for sixteen). The buffering and
ordering rules live in :mod:`tannery_server.hub`.
"""

from __future__ import annotations

import asyncio
import unicodedata
from typing import AsyncIterator, Iterator

import grpc
from tannery.codec import Buffer, Deframer, FormatError, Limits
from tannery.v1 import channels_pb2, channels_pb2_grpc

from .calllog import current_call
from .hub import Channel, FellBehind, Hub, HubClosed, Piece, SubscriptionEnded

#: Longest channel name, in bytes of UTF-8.
MAX_CHANNEL_NAME_BYTES = 255
#: Trailing metadata of a call that failed because the codec refused a payload.
FORMAT_ERROR_METADATA = (("tannery-error", "format"),)

_DEFAULTS = {
    "chunk_size": 1 << 20,
    "max_payload_bytes": 1 << 40,
    "max_rank": 64,
    "channel_buffer_bytes": 64 << 20,
    "channel_timeout_seconds": 10.0,
}


def check_channel_name(name: str) -> None:
    """Raise ValueError naming the problem unless ``name`` is a valid channel name."""
    if not name:
        raise ValueError("channel name is empty")
    size = len(name.encode("utf-8"))
    if size > MAX_CHANNEL_NAME_BYTES:
        raise ValueError(f"channel name is {size} bytes of UTF-8, over the limit of {MAX_CHANNEL_NAME_BYTES}")
    for index, char in enumerate(name):
        if unicodedata.category(char) == "Cc":
            raise ValueError(f"channel name {name!r} has a control character, U+{ord(char):04X}, at index {index}")


def split_piece(data: Buffer, chunk_size: int) -> Iterator[bytes]:
    """``data`` as bytes objects of at most ``chunk_size`` bytes; a bytes chunk that fits is kept as is."""
    if isinstance(data, bytes) and len(data) <= chunk_size:
        yield data
        return
    view = memoryview(data)
    for start in range(0, len(view), chunk_size):
        yield bytes(view[start : start + chunk_size])


class ChannelsServicer(channels_pb2_grpc.ChannelsServicer):
    """Async handlers of ``Channels`` over one in-memory :class:`~tannery_server.hub.Hub`.

    ``config`` supplies ``chunk_size``, ``max_payload_bytes``, ``max_rank``,
    ``channel_buffer_bytes`` and ``channel_timeout_seconds``; missing ones take the
    defaults (1 MiB, 1 TiB, 64, 64 MiB, 10 s).
    """

    def __init__(self, config: object) -> None:
        setting = {name: getattr(config, name, default) for name, default in _DEFAULTS.items()}
        self.chunk_size = int(setting["chunk_size"])
        self.limits = Limits(max_payload=int(setting["max_payload_bytes"]), max_rank=int(setting["max_rank"]))
        self.timeout = float(setting["channel_timeout_seconds"])
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {self.chunk_size}")
        self.hub = Hub(buffer_bytes=int(setting["channel_buffer_bytes"]), timeout=self.timeout)

    def _pieces(self, data: Buffer) -> Iterator[Piece]:
        """The messages a subscriber sends for ``data``, with the payload bytes each carries."""
        for chunk in split_piece(data, self.chunk_size):
            yield channels_pb2.SubscribeResponse(chunk=chunk), len(chunk)

    async def close(self) -> None:
        """End every subscription (UNAVAILABLE: shutting down) and refuse new calls."""
        await self.hub.close(timeout=max(self.timeout, 1.0))

    async def Publish(
        self,
        request_iterator: AsyncIterator[channels_pb2.PublishRequest],
        context: grpc.aio.ServicerContext,
    ) -> channels_pb2.PublishResponse:
        deframer = Deframer(self.limits)
        channel: Channel | None = None
        pieces: list[Piece] = []
        payloads = total = dropped = 0
        try:
            async for request in request_iterator:
                if channel is None:
                    channel = await self._attach(request.channel, context)
                elif request.channel and request.channel != channel.name:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"Publish names its channel in the first message only: got {request.channel!r} "
                        f"after {channel.name!r}",
                    )
                try:
                    for fragment in deframer.feed(request.chunk):
                        pieces.extend(self._pieces(fragment.data))
                        if fragment.last:
                            size = fragment.info.size
                            # Shielded: a payload whose last byte arrived reaches every
                            # subscriber even if this publisher leaves meanwhile.
                            dropped += await asyncio.shield(channel.relay(pieces, size, self.timeout))
                            pieces = []
                            payloads += 1
                            total += size
                except FormatError as error:
                    await self._refuse(context, payloads, error)
            if channel is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Publish got no message naming a channel")
            try:
                deframer.close()
            except FormatError as error:
                await self._refuse(context, payloads, error)
        finally:
            if channel is not None:
                self.hub.detach_publisher(channel)
        return channels_pb2.PublishResponse(payloads=payloads, bytes=total, dropped_subscribers=dropped)

    async def Subscribe(
        self, request: channels_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._check_name(request.channel, context)
        try:
            subscription = self.hub.subscribe(request.channel)
        except HubClosed as closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(closed))
        try:
            # Registered: from here on every relayed payload is queued for this subscriber.
            await context.send_initial_metadata(())
            while True:
                message = await subscription.next_piece()
                try:
                    await context.write(message)
                except grpc.aio.InternalError:
                    # The subscriber left (cancelled or disconnected) before grpc told this
                    # handler; end as cancelled, like grpc does once it knows.
                    raise asyncio.CancelledError() from None
        except FellBehind as behind:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(behind))
        except SubscriptionEnded as ended:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(ended))
        finally:
            self.hub.unsubscribe(subscription)

    async def _check_name(self, name: str, context: grpc.aio.ServicerContext) -> None:
        current_call().note("channel", name)
        try:
            check_channel_name(name)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def _attach(self, name: str, context: grpc.aio.ServicerContext) -> Channel:
        await self._check_name(name, context)
        try:
            return self.hub.attach_publisher(name)
        except HubClosed as closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(closed))
            raise  # unreachable: abort raises

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, payloads: int, error: FormatError) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"payload {payloads + 1} of this call is malformed: {error}",
            trailing_metadata=FORMAT_ERROR_METADATA,
        )

