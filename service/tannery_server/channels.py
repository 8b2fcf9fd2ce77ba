"""The ``tannery.v1.Channels`` gRPC service: publish and subscribe to tensor payloads by name.

Publish reads tannic payloads from a stream of chunks with tannery_protocol.framing's Deframer (each
header checked against the limits before its buffer is accepted) and relays each piece as
it arrives, so a channel's memory is its subscribers' bounded buffers whatever the size of
a payload. A publisher holds the channel from its payload's first piece to its last; a
payload cut off before its last piece (publisher cancelled, disconnected, stalled or
malformed) is abandoned, and subscribers that got some of it are told to discard it
(``SubscribeResponse.abandoned``), so no client returns a torn payload.

While it holds the channel, a publisher must send its next message within
``channel_timeout_seconds``, or its payload is abandoned and its call ends with
DEADLINE_EXCEEDED: a publisher stalled mid-payload blocks the others for at most that
long. (The bound is per message: a publisher that keeps sending, however slowly, keeps
the channel.) Between payloads it holds nothing and may wait as long as it likes. Once a
payload's last byte has arrived, its last piece is relayed even if the publisher leaves
meanwhile (waiting at most the timeout for room, as any piece), so a payload is never
whole for some subscribers and abandoned for others.

The relayed pieces are the chunk objects received (a chunk holding the end of one payload
and the start of the next is sliced), at most ``chunk_size`` bytes each, each a
:class:`~.dataplane.channel_pieces.Chunk` that every subscriber shares: its
``SubscribeResponse`` messages are made once, by the first gRPC subscriber, and every gRPC
subscriber writes those same messages (gRPC serializes it once per subscriber: pre-serializing it once
for all did not pay, see docs/benchmarks.md, "Channels" under "Why the code is like this");
data-path subscribers send its bytes. The buffering and ordering rules live in
:mod:`tannery_server.hub`; what joins the channels of several replicas (nothing, or NATS)
in :mod:`tannery_server.fabric`.

A call that asks for a data path (``tannery-transport``: the same-host socket or the TCP
data port) names its channel over gRPC and moves its payloads on its data connection
(:mod:`.dataplane.channel_links`); publishers and subscribers of every path share a channel.

Every whole payload is told to the hub's ``traffic`` observer (the metrics) as it moves: once
its last byte has arrived from a publisher here (``"in"``, by the publisher's transport), and
once its last piece is handed to each subscriber's transport (``"out"``); see :mod:`.hub`.

Every refusal is a :class:`~.failures.Failure`, turned into its status in one place
(:func:`~.handling.answering_failures`). Requests are decoded by deserializers that never
raise: bytes that are not a valid request become an :class:`~.handling.Undecodable`,
refused with INVALID_ARGUMENT by the handler.
"""

from __future__ import annotations

import asyncio
import functools
import unicodedata
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
from tannery_protocol.codec import Buffer, FormatError, Limits
from tannery_protocol.framing import Deframer, Fragment
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc

from .calllog import current_call
from .config import Config
from .failures import BadPayload, Failure, LimitExceeded, Malformed, Unavailable, Unimplemented
from .handling import Undecodable, add_service, answering_failures
from .dataplane.channel_links import relay_publisher, serve_subscriber
from .dataplane.channel_pieces import Chunk, data_of, grpc_messages
from .dataplane.links import LINK_ERRORS, fail, link_failure
from .dataplane.listeners import DataPaths
from .dataplane.plane import DataPlane
from .fabric import open_fabric
from .relay_plan import CLOSING, LEAVE_GRACE_SECONDS, Member, RoutePlanner, relay_address
from .published_store import PublishedStore, Storing, open_store, stored_answer
from .workers import Workers
from .hub import Channel, FellBehind, Hub, HubClosed, Piece, Relay, SubscriptionEnded

#: Longest channel name, in bytes of UTF-8.
MAX_CHANNEL_NAME_BYTES = 255
#: Trailing metadata of a call that failed because the codec refused a payload.
FORMAT_ERROR_METADATA = (("tannery-error", "format"),)
#: What a subscriber receives when the payload in progress was cut off by its publisher.
ABANDONED = channels_pb2.SubscribeResponse(abandoned=True)



class Stalled(Failure):
    """A publisher that held its channel mid-payload sent nothing for the channel timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


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

    It reads ``chunk_size``, ``max_payload_bytes``, ``max_rank``, ``channel_buffer_bytes`` and
    ``channel_timeout_seconds`` of the server's :class:`~.config.Config` (whose defaults are
    the only ones). The timeout bounds both a publisher's wait for room for one piece and,
    while it holds its channel, its wait for its next message.
    """

    def __init__(self, config: Config, data_paths: DataPaths | None = None) -> None:
        #: The data paths and their tickets (None: channels over gRPC only).
        self.data_paths = data_paths
        #: Each data-path subscriber holds one while a piece is being sent to it, each publisher one
        #: while its bytes are received.
        self._links = Workers(32, "tannery-channel-link")
        #: Channels take the same-host data path, the TCP data port, or gRPC.
        self.plane = DataPlane(data_paths, self._links, "channels")
        self.chunk_size = config.chunk_size
        self.limits = Limits(max_payload=config.max_payload_bytes, max_rank=config.max_rank)
        self.timeout = config.channel_timeout_seconds
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {self.chunk_size}")
        self.hub = Hub(buffer_bytes=config.channel_buffer_bytes, timeout=self.timeout, abandoned=ABANDONED)
        #: Makes the store of a Publish that asks for one (``store_as``), given by the server
        #: that serves Archives too (None: a Publish that asks is answered with ``store_error``).
        self.published_store: Callable[[Any], PublishedStore] | None = None
        #: What joins this server's channels with other replicas' (:func:`~.fabric.open_fabric`).
        self.fabric = open_fabric(config, self.hub, self.pieces, data_of)
        self.hub.exporter = self.fabric.exporter
        #: The relay plans of this server's channels (None: relays off, ``relay_fanout`` 0).
        self.routes = RoutePlanner(config.relay_fanout) if config.relay_fanout > 0 else None

    async def start(self) -> None:
        """Connect the fabric (a no-op without replicas)."""
        await self.fabric.start()

    def pieces(self, data: Buffer) -> list[Piece]:
        """The pieces relayed for ``data`` (each a :class:`~.dataplane.channel_pieces.Chunk`), with
        the payload bytes each carries."""
        return [(Chunk(chunk), len(chunk)) for chunk in split_piece(data, self.chunk_size)]

    async def close(self) -> None:
        """End every subscription (UNAVAILABLE: shutting down) and refuse new calls."""
        if self.routes is not None:
            self.routes.close()
        await self.hub.close(timeout=max(self.timeout, 1.0))
        await self.fabric.close()
        self._links.close(wait=False)

    @staticmethod
    def failure_of(exc: BaseException) -> BaseException:
        """The failure a hub's SubscriptionEnded is answered with (what
        :func:`~.handling.answering_failures` asks); others pass as they are."""
        if isinstance(exc, FellBehind):
            return LimitExceeded(str(exc))
        if isinstance(exc, SubscriptionEnded):
            return Unavailable(str(exc))
        return exc

    @answering_failures
    async def Publish(
        self,
        request_iterator: AsyncIterator[channels_pb2.PublishRequest | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> channels_pb2.PublishResponse:
        """Relay the payloads of the stream as they arrive; whatever ends the call frees what it held."""
        transport = self.plane.transport(context)
        if transport is not None:
            return await self._publish_link(transport, aiter(request_iterator), context)
        publication = _Publication(self, aiter(request_iterator))
        try:
            await publication.run()
        except BaseException:
            if publication.store is not None:
                await publication.store.abort()
            raise
        finally:
            publication.release()
        return await stored_answer(publication.response(), publication.store)

    @answering_failures
    async def Subscribe(
        self, request: channels_pb2.SubscribeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> None:
        """Send every piece queued for this subscriber until it leaves, falls behind or the server closes."""
        self._check_name(request.channel)
        if self.hub.closed:
            raise Unavailable("the server is shutting down")
        # Interest first: payloads published anywhere once it returns reach this server.
        await self.fabric.join(request.channel)
        try:
            subscription = self.hub.subscribe(request.channel)
        except HubClosed as closed:
            self.fabric.leave(request.channel)
            raise Unavailable(str(closed)) from None
        try:
            transport = self.plane.transport(context)
            if transport is not None:
                await self._subscribe_link(transport, subscription, context)
                return
            # Registered: from here on every payload begun is queued for this subscriber.
            await context.send_initial_metadata(())
            while True:
                message, completes = await subscription.take()
                for each in grpc_messages(message, self.chunk_size):
                    try:
                        await context.write(each)
                    except grpc.aio.InternalError:
                        # The subscriber left (cancelled or disconnected) before grpc told this
                        # handler; end as cancelled, like grpc does once it knows.
                        raise asyncio.CancelledError() from None
                if completes:
                    self.hub.traffic("out", "grpc", completes)
        finally:
            self.hub.unsubscribe(subscription)
            self.fabric.leave(request.channel)

    @answering_failures
    async def Route(
        self, request: channels_pb2.RouteRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> None:
        """Keep this member in its channel's relay plan while the call lasts, telling it its route
        at once and again whenever it changes (:mod:`.relay_plan`)."""
        self._check_name(request.channel)
        if self.routes is None:
            raise Unimplemented("this server's relays are off (--relay-fanout 0): subscribe instead")
        if self.hub.closed or self.routes.closed:
            raise Unavailable("the server is shutting down")
        member = Member(request.member or context.peer(), relay_address(request.address, context.peer()),
                        bytes(request.key), bytes(request.certificate))
        if len(member.key) < 16:
            raise Malformed(f"a relay key of {len(member.key)} bytes: 16 or more")
        replaced = self.routes.join(request.channel, member, request.unreachable)
        if replaced is not None:
            replaced.updates.put_nowait(None)  # its older call ends: this one holds the slot now
        try:
            while (update := await member.updates.get()) is not None:
                if update is CLOSING:
                    raise Unavailable("the server is shutting down: its relay plan goes with it (ask again)")
                await context.write(update)
        finally:  # the slot is kept a moment for the same member calling again (a no-op once it has)
            asyncio.get_running_loop().call_later(LEAVE_GRACE_SECONDS, self.routes.leave, request.channel, member)

    # -- the data paths: the same-host socket, the TCP data port ------------------------------

    async def _publish_link(self, transport: str, requests: AsyncIterator[Any],
                            context) -> channels_pb2.PublishResponse:
        """A Publish whose call names the channel and whose payloads come on its data connection
        (sealed memory files on the same host, raw bytes over TCP)."""
        first = await anext(requests, None)
        if first is None or isinstance(first, Undecodable):
            raise Malformed(f"a {transport} Publish names its channel in its first message")
        channel = self.attach(first.channel)
        store = None
        try:
            store = await open_store(self.published_store, first)
            link = await self.plane.link(transport, context)
            try:
                payloads, nbytes, dropped = await relay_publisher(link, store.channel(channel) if store else channel,
                                                                  self.limits, self.chunk_size, self.timeout,
                                                                  self._links, self.relay_last(transport))
            except LINK_ERRORS as exc:  # the connection's, not a bug: UNAVAILABLE or INVALID_ARGUMENT naming it
                failure = link_failure(transport, exc)
                fail(link, failure)
                raise failure from None
            except BaseException as exc:
                fail(link, exc)
                raise
            finally:
                link.close()
            async for _ in requests:
                raise Malformed(f"a {transport} Publish sends its payloads on its data connection, not in messages")
        except BaseException:
            if store is not None:
                await store.abort()
            raise
        finally:
            self.hub.detach_publisher(channel)
        current_call().note("data_bytes", nbytes)
        answer = channels_pb2.PublishResponse(payloads=payloads, bytes=nbytes, dropped_subscribers=dropped)
        return await stored_answer(answer, store)

    async def _subscribe_link(self, transport: str, subscription, context) -> None:
        """Pass the subscription's payloads on its data connection until it ends."""
        link = await self.plane.link(transport, context)
        try:
            await serve_subscriber(link, subscription, self._links, self.hub.buffer_bytes, self.timeout,
                                   functools.partial(self.hub.traffic, "out", transport))
        except OSError:  # the subscriber closed its connection: as a cancelled gRPC subscriber
            link.abort()
            raise asyncio.CancelledError() from None
        except BaseException as exc:
            fail(link, self.failure_of(exc))  # a subscriber dropped or the server closing says why
            raise
        finally:
            link.close()

    def relay_last(self, transport: str) -> Callable[[Relay, Piece, float], Awaitable[int]]:
        """:func:`_relay_last` for a publisher on ``transport``, telling the hub's traffic observer
        of the payload first (in the shielded part: a payload whose last byte came is counted)."""

        async def relay_last(relay: Relay, piece: Piece, timeout: float) -> int:
            self.hub.traffic("in", transport, relay.size)
            return await _relay_last(relay, piece, timeout)

        return relay_last

    def _check_name(self, name: str) -> None:
        """Note the channel in the call log; Malformed unless it is a valid name."""
        current_call().note("channel", name)
        try:
            check_channel_name(name)
        except ValueError as error:
            raise Malformed(str(error)) from None

    def attach(self, name: str) -> Channel:
        """The channel ``name`` for a publisher (Malformed for a bad name, Unavailable when closing)."""
        self._check_name(name)
        self.fabric.check()
        try:
            return self.hub.attach_publisher(name)
        except HubClosed as closed:
            raise Unavailable(str(closed)) from None


class _Publication:
    """The state of one Publish call: its channel, its deframer, the payload it holds the channel for."""

    def __init__(self, servicer: ChannelsServicer, requests: AsyncIterator[Any]) -> None:
        self.servicer = servicer
        self.requests = requests
        self.deframer = Deframer(servicer.limits)
        self.channel: Channel | None = None
        #: What stores the payloads too (``store_as``), and how a payload takes the channel.
        self.store: Storing | None = None
        self.begin: Callable[[int], Awaitable[Relay]] | None = None
        #: The payload in flight, holding the channel (None between payloads).
        self.relay: Relay | None = None
        self.messages = self.payloads = self.bytes = self.dropped = 0
        #: Bytes of the payload in flight received so far.
        self.received = 0

    def response(self) -> channels_pb2.PublishResponse:
        return channels_pb2.PublishResponse(payloads=self.payloads, bytes=self.bytes, dropped_subscribers=self.dropped)

    async def run(self) -> None:
        """Relay every payload of the stream; a Failure names what is wrong."""
        while (request := await self._next_request()) is not None:
            self.messages += 1
            if isinstance(request, Undecodable):
                raise request.failure(f"message {self.messages} of this Publish call")
            if self.channel is None:
                self.channel = self.servicer.attach(request.channel)
                self.store = await open_store(self.servicer.published_store, request)
                self.begin = self.store.channel(self.channel).begin if self.store else self.channel.begin
            elif request.channel and request.channel != self.channel.name:
                raise Malformed(
                    f"Publish names its channel in the first message only: got {request.channel!r} "
                    f"after {self.channel.name!r}"
                )
            for fragment in self._fragments(request.chunk):
                await self._relay(fragment)
        if self.channel is None:
            raise Malformed("Publish got no message naming a channel")
        try:
            self.deframer.close()
        except FormatError as error:
            raise self._malformed(error) from None

    async def _next_request(self) -> Any:
        """The next request, or None at the end; Stalled if the channel is held and it does not come in time."""
        if self.relay is None:
            return await anext(self.requests, None)
        timeout = self.servicer.timeout
        try:
            async with asyncio.timeout(timeout):
                return await anext(self.requests, None)
        except TimeoutError:
            relay = self.relay
            raise Stalled(
                f"publisher stalled on channel {relay.channel.name!r}: no message for {timeout:g} s in the middle "
                f"of payload {self.payloads + 1} of this call ({self.received} of {relay.size} bytes sent), "
                "while it held the channel; the payload is abandoned"
            ) from None

    def _fragments(self, chunk: bytes) -> Iterator[Fragment]:
        """The deframer's fragments of ``chunk``; BadPayload naming the payload if it is malformed."""
        try:
            yield from self.deframer.feed(chunk)
        except FormatError as error:
            raise self._malformed(error) from None

    def _malformed(self, error: FormatError) -> BadPayload:
        return BadPayload(f"payload {self.payloads + 1} of this call is malformed: {error}")

    async def _relay(self, fragment: Fragment) -> None:
        """Relay one fragment, taking the channel at a payload's first one and freeing it after its last."""
        assert self.channel is not None
        if fragment.first:
            assert self.begin is not None
            self.relay = await self.begin(fragment.info.size)
            self.received = 0
        relay = self.relay
        assert relay is not None
        pieces = self.servicer.pieces(fragment.data)  # never empty: a fragment has bytes
        self.received += sum(nbytes for _, nbytes in pieces)
        timeout = self.servicer.timeout
        for message, nbytes in pieces[:-1] if fragment.last else pieces:
            self.dropped += await relay.put(message, nbytes, timeout)
        if fragment.last:
            # The last piece is relayed even if this publisher leaves meanwhile (shielded,
            # bounded by the timeout): a payload every byte of which arrived reaches every
            # subscriber that has room, never only some of them.
            self.relay = None
            self.dropped += await asyncio.shield(self.servicer.relay_last("grpc")(relay, pieces[-1], timeout))
            self.payloads += 1
            self.bytes += relay.size

    def release(self) -> None:
        """Free what the call holds, at once: the payload in flight is abandoned, the channel detached."""
        if self.relay is not None:
            self.relay.abandon()
            self.relay = None
        if self.channel is not None:
            self.servicer.hub.detach_publisher(self.channel)


async def _relay_last(relay: Relay, piece: Piece, timeout: float) -> int:
    """Queue a payload's last piece and free its channel; how many subscribers were dropped meanwhile."""
    message, nbytes = piece
    try:
        return await relay.put(message, nbytes, timeout)
    finally:
        relay.finish()


def add_to_server(servicer: ChannelsServicer, server: grpc.aio.Server) -> None:
    """Register every RPC of ``channels.proto``, with deserializers that let the handlers refuse undecodable requests."""
    add_service(server, servicer, channels_pb2, "Channels")
