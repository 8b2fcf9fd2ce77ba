"""Channels in memory: payloads relayed piece by piece, in order, to subscribers with bounded buffers.

A channel exists while it has subscribers or publishers attached, and is created by the
first of them: channels need no set-up. A payload travels as pieces, each a message ready
to send and the payload bytes it carries; every subscriber gets the same objects, so
nothing is copied or encoded once per subscriber.

A publisher holds its channel from its payload's first piece to its last (a
:class:`Relay`, under the channel's lock), so the payloads of two publishers never
interleave and every subscriber sees the same order. A relay's recipients are the
subscribers registered when its first piece came: one that subscribes meanwhile starts
with the next payload, never with a tail.

Each subscription buffers at most ``buffer_bytes`` (or one piece of any size when it is
empty), so the memory of a channel does not grow with the size of a payload. A piece that
finds no room makes its publisher wait up to ``timeout`` seconds for the subscriber to
catch up, then the subscriber is dropped: its next read raises :class:`FellBehind`, and
the others carry on. A relay cut off before its last piece (:meth:`Relay.abandon`)
removes its pieces still queued and queues the hub's *abandoned* marker for each
subscriber that has already taken some, so no one mistakes a torn payload for a whole one.

A hub may export what its publishers relay (``exporter``: the channel fabric between
replicas, :mod:`.fabric`): each relay begun by a publisher of this server then also hands
its pieces to an :class:`Outbound`; payloads that come from other replicas are relayed with
``begin(size, export=False)`` and reach only this server's subscribers.

A hub tells its ``traffic`` observer (the metrics) of each whole payload as it moves: the
servicer when one is received from a publisher here (``"in"``, by its transport), the fabric
when one from another replica is relayed here (``"in"``, ``"nats"``), and the subscribers'
senders when a payload's last piece is handed to their transport (``"out"``). A
subscriber's queue marks each payload's last piece (:meth:`Subscription.take`) for that.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Iterator, Protocol

#: A piece of a payload as queued: the message to send and the payload bytes it carries.
Piece = tuple[object, int]


class Outbound(Protocol):
    """Where a relay's pieces go beyond this server (one payload, :mod:`.fabric`)."""

    async def send(self, message: object, nbytes: int, last: bool) -> None:
        """Carry one piece on; raises (a Failure) when it cannot, which abandons the payload."""

    def abandon(self) -> None:
        """The payload is cut off: tell the receivers to forget what they got of it."""


#: Makes the Outbound of a relay: (channel name, payload number, payload size).
Exporter = Callable[[str, int, int], Outbound]

#: Told of each whole payload as it moves: (direction, ``"in"`` or ``"out"``; transport; its bytes).
Traffic = Callable[[str, str, int], None]


def ignore_traffic(direction: str, transport: str, nbytes: int) -> None:
    """The traffic observer of a hub nobody watches."""


class SubscriptionEnded(Exception):
    """A subscription that will receive nothing more; the message says why."""


class FellBehind(SubscriptionEnded):
    """The subscriber's buffer stayed full longer than the publisher's timeout."""


class HubClosed(SubscriptionEnded):
    """The server is shutting down."""


class Subscription:
    """One subscriber's bounded queue of payload pieces."""

    def __init__(self, channel: Channel, bound: int) -> None:
        self.channel = channel
        self.bound = bound
        #: Bytes queued and not yet taken by the subscriber.
        self.buffered = 0
        #: (message, payload bytes, payload number on the channel, the payload's size if this is
        #: its last piece else 0) in the order to send.
        self._queue: deque[tuple[object, int, int, int]] = deque()
        #: Number of the payload the subscriber took its last piece of (0: none yet).
        self._taking = 0
        self._ended: SubscriptionEnded | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        #: Called once when the subscription ends (a data-path subscriber's sending stops at once).
        self.on_end: Callable[[], None] | None = None

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def has_room(self, nbytes: int) -> bool:
        """True when a piece of ``nbytes`` bytes fits; an empty buffer takes any piece."""
        return self.buffered == 0 or self.buffered + nbytes <= self.bound

    def put(self, message: object, nbytes: int, payload: int, completes: int = 0) -> None:
        """Queue one piece of payload number ``payload`` (ignored once the subscription has ended);
        ``completes`` is the payload's size when this is its last piece, else 0."""
        if self._ended is not None:
            return
        self._queue.append((message, nbytes, payload, completes))
        self.buffered += nbytes
        self._readable.set()

    def abandon(self, payload: int, marker: object) -> None:
        """Forget payload number ``payload``, cut off before its last piece.

        Its pieces still queued (the newest ones) are removed at once; if the subscriber
        has taken some already, ``marker`` is queued to tell it to discard them.
        """
        if self._ended is not None:
            return
        while self._queue and self._queue[-1][2] == payload:
            self.buffered -= self._queue.pop()[1]
        if self._taking == payload:
            self._queue.append((marker, 0, payload, 0))
            self._readable.set()
        self._writable.set()

    async def wait_for_room(self, nbytes: int, deadline: float) -> bool:
        """Wait until a piece of ``nbytes`` bytes fits, at the latest until ``deadline``.

        False if it still does not fit then, or if the subscription ended meanwhile.
        """
        try:
            async with asyncio.timeout_at(deadline):
                while not self.ended and not self.has_room(nbytes):
                    self._writable.clear()
                    await self._writable.wait()
        except TimeoutError:
            pass
        return not self.ended and self.has_room(nbytes)

    async def next_piece(self) -> object:
        """The next message to send, waiting for one; SubscriptionEnded once the subscription ended."""
        return (await self.take())[0]

    async def take(self) -> tuple[object, int]:
        """The next message to send and, when it is its payload's last piece, that payload's size
        (else 0), waiting for one; SubscriptionEnded once the subscription ended."""
        while not self._queue:
            if self._ended is not None:
                raise self._ended
            self._readable.clear()
            await self._readable.wait()
        message, nbytes, self._taking, completes = self._queue.popleft()
        self.buffered -= nbytes
        self._writable.set()
        return message, completes

    def end(self, reason: SubscriptionEnded) -> None:
        """End the subscription now: what it buffered is discarded and waiters wake up."""
        if self._ended is None:
            self._ended = reason
            self._queue.clear()
            self.buffered = 0
            if self.on_end is not None:
                self.on_end()
        self._readable.set()
        self._writable.set()


class Relay:
    """One payload in flight on a channel, from its first piece to its last.

    It holds the channel's lock until :meth:`finish` or :meth:`abandon`, which are
    synchronous so that a cancelled publisher frees the channel without awaiting.
    """

    def __init__(self, channel: Channel, number: int, size: int, recipients: list[Subscription],
                 outbound: Outbound | None = None, origin: str = "") -> None:
        self.channel = channel
        #: The payload's number on its channel (1 for the first payload ever relayed there).
        self.number = number
        #: Bytes of the whole payload, as its header says.
        self.size = size
        self.recipients = recipients
        self.open = True
        #: Where the pieces also go (other replicas), None when nowhere.
        self.outbound = outbound
        #: Appended to the message of a subscriber dropped while it waited (where the payload came from).
        self.origin = origin
        #: Payload bytes put so far.
        self.put_bytes = 0

    async def put(self, message: object, nbytes: int, timeout: float) -> int:
        """Queue one piece for every recipient; returns how many were dropped for falling behind.

        Recipients with room get it at once; the others are waited for together, up to
        ``timeout`` seconds from now, and those still full then are dropped. The piece goes
        to the outbound first: when it cannot, the error is raised before anyone here got it.
        """
        self.put_bytes += nbytes
        completes = self.size if self.put_bytes >= self.size else 0
        if self.outbound is not None:
            try:
                await self.outbound.send(message, nbytes, completes > 0)
            except BaseException:
                self.abandon()  # here too: no one may take a payload short of this piece for whole
                raise
        self.recipients = [s for s in self.recipients if not s.ended]
        waiting = []
        for subscription in self.recipients:
            if subscription.has_room(nbytes):
                subscription.put(message, nbytes, self.number, completes)
            else:
                waiting.append(subscription)
        if not waiting:
            return 0
        deadline = asyncio.get_running_loop().time() + timeout
        dropped = 0
        for subscription in waiting:
            if await subscription.wait_for_room(nbytes, deadline):
                subscription.put(message, nbytes, self.number, completes)
            elif not subscription.ended:
                self.channel.drop(
                    subscription,
                    FellBehind(
                        f"subscriber fell behind on channel {self.channel.name!r} and was dropped: "
                        f"{subscription.buffered} bytes buffered, the bound is {subscription.bound} bytes, "
                        f"and a piece of {nbytes} bytes of a {self.size}-byte payload found no room "
                        f"within {timeout:g} s{self.origin}"
                    ),
                )
                dropped += 1
        return dropped

    def finish(self) -> None:
        """The last piece is queued for every recipient: let the next payload have the channel."""
        if self.open:
            self.open = False
            self.channel.release()

    def abandon(self) -> None:
        """The payload is cut off: recipients forget it (see :meth:`Subscription.abandon`), the channel is free."""
        if self.open:
            if self.outbound is not None:
                self.outbound.abandon()
            for subscription in self.recipients:
                subscription.abandon(self.number, self.channel.marker)
            self.recipients = []
            self.finish()


class Channel:
    """The subscribers of one channel name and the lock that orders its payloads."""

    def __init__(self, name: str, marker: object, on_drop: Callable[[], None] | None = None,
                 exporter: Exporter | None = None) -> None:
        self.name = name
        #: The message telling a subscriber that the payload it was receiving was abandoned.
        self.marker = marker
        #: Subscriptions in the order they came (a dict as an ordered set).
        self.subscriptions: dict[Subscription, None] = {}
        self.publishers = 0
        #: Payloads begun on this channel so far (each relay's number).
        self.payloads = 0
        self._lock = asyncio.Lock()
        #: Called once for each subscriber dropped for falling behind (the hub counts them).
        self._on_drop = on_drop
        self._exporter = exporter

    @property
    def busy(self) -> bool:
        """True while a publisher holds the channel for a payload."""
        return self._lock.locked()

    async def begin(self, size: int, export: bool = True, origin: str = "") -> Relay:
        """Wait for the channel, then hold it for one payload of ``size`` bytes, to today's subscribers
        (and to other replicas when the hub exports and ``export`` is true; ``origin`` says where a
        payload from elsewhere came from, for messages)."""
        await self._lock.acquire()
        self.payloads += 1
        try:
            outbound = self._exporter(self.name, self.payloads, size) if export and self._exporter else None
        except BaseException:
            self._lock.release()
            raise
        return Relay(self, self.payloads, size, list(self.subscriptions), outbound, origin)

    def release(self) -> None:
        self._lock.release()

    def drop(self, subscription: Subscription, reason: FellBehind) -> None:
        """End a subscriber that fell behind and take it off the channel."""
        subscription.end(reason)
        self.subscriptions.pop(subscription, None)
        if self._on_drop is not None:
            self._on_drop()


class Hub:
    """Every live channel, by name.

    ``abandoned`` is the message queued for a subscriber whose payload in progress was
    cut off by its publisher.
    """

    def __init__(self, buffer_bytes: int, timeout: float, abandoned: object = "abandoned",
                 exporter: Exporter | None = None) -> None:
        self.buffer_bytes = buffer_bytes
        self.timeout = timeout
        self.abandoned = abandoned
        #: What publishers' relays are also handed to (None: this server only).
        self.exporter = exporter
        #: Told of each whole payload received here or handed to a subscriber (the metrics set it).
        self.traffic: Traffic = ignore_traffic
        self.channels: dict[str, Channel] = {}
        self.closed = False
        #: Subscribers dropped for falling behind since the hub was made (for the metrics).
        self.dropped_subscribers = 0
        self._subscriptions = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def subscribers(self) -> int:
        """Subscriptions registered now, on every channel."""
        return self._subscriptions

    def _count_drop(self) -> None:
        self.dropped_subscribers += 1

    def _channel(self, name: str) -> Channel:
        channel = self.channels.get(name)
        if channel is None:
            channel = self.channels[name] = Channel(name, self.abandoned, self._count_drop, self.exporter)
        return channel

    def _forget_if_unused(self, channel: Channel) -> None:
        if not channel.subscriptions and not channel.publishers and self.channels.get(channel.name) is channel:
            del self.channels[channel.name]

    def subscribe(self, name: str) -> Subscription:
        """Register a subscriber: it receives every payload whose first piece is relayed from now on."""
        if self.closed:
            raise HubClosed("the server is shutting down")
        channel = self._channel(name)
        subscription = Subscription(channel, self.buffer_bytes)
        channel.subscriptions[subscription] = None
        self._subscriptions += 1
        self._idle.clear()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Remove a subscriber at once (it left, or its call ended); no publisher waits on it."""
        subscription.end(SubscriptionEnded("unsubscribed"))
        channel = subscription.channel
        channel.subscriptions.pop(subscription, None)
        self._forget_if_unused(channel)
        self._subscriptions -= 1
        if self._subscriptions == 0:
            self._idle.set()

    def attach_publisher(self, name: str) -> Channel:
        """The channel a publisher relays to; it stays alive until :meth:`detach_publisher`."""
        if self.closed:
            raise HubClosed("the server is shutting down")
        channel = self._channel(name)
        channel.publishers += 1
        return channel

    def detach_publisher(self, channel: Channel) -> None:
        channel.publishers -= 1
        self._forget_if_unused(channel)

    def end_all(self, reason: SubscriptionEnded) -> int:
        """End every subscription now with ``reason`` (their calls then leave); how many there were."""
        ended = list(self._all_subscriptions())
        for subscription in ended:
            subscription.end(reason)
        return len(ended)

    async def close(self, timeout: float) -> None:
        """End every subscription and wait up to ``timeout`` seconds for their calls to finish."""
        self.closed = True
        for subscription in list(self._all_subscriptions()):
            subscription.end(HubClosed("the server is shutting down"))
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            pass

    def _all_subscriptions(self) -> Iterator[Subscription]:
        for channel in self.channels.values():
            yield from channel.subscriptions
