"""Channels in memory: whole payloads relayed in order to subscribers with bounded buffers.

A channel exists while it has subscribers or publishers attached, and is created by the
first of them: channels need no set-up. Each payload is relayed as a list of pieces, each
a message ready to send and the payload bytes it carries; every subscriber gets the same
objects, so nothing is copied or encoded once per subscriber. Publishers relay one payload at a time per channel, under the channel's lock, so
the payloads of two publishers never interleave and every subscriber sees the same order.

Each subscription buffers at most ``buffer_bytes`` (or one payload of any size when it is
empty). A publisher that finds no room waits up to ``timeout`` seconds for the
subscriber to catch up, then drops it: the subscriber's next read raises
:class:`FellBehind`, and the others carry on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Iterator, Sequence

#: A piece of a payload as queued: the message to send and the payload bytes it carries.
Piece = tuple[object, int]


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
        self._pieces: deque[Piece] = deque()
        self._ended: SubscriptionEnded | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def has_room(self, size: int) -> bool:
        """True when a payload of ``size`` bytes fits; an empty buffer takes any payload."""
        return self.buffered == 0 or self.buffered + size <= self.bound

    def put(self, pieces: Sequence[Piece], size: int) -> None:
        """Queue a payload's pieces (ignored once the subscription has ended)."""
        if self._ended is not None:
            return
        self._pieces.extend(pieces)
        self.buffered += size
        self._readable.set()

    async def wait_for_room(self, size: int, deadline: float) -> bool:
        """Wait until a payload of ``size`` bytes fits, at the latest until ``deadline``.

        False if it still does not fit then, or if the subscription ended meanwhile.
        """
        try:
            async with asyncio.timeout_at(deadline):
                while not self.ended and not self.has_room(size):
                    self._writable.clear()
                    await self._writable.wait()
        except TimeoutError:
            pass
        return not self.ended and self.has_room(size)

    async def next_piece(self) -> object:
        """The next message to send, waiting for one; SubscriptionEnded once the subscription ended."""
        while not self._pieces:
            if self._ended is not None:
                raise self._ended
            self._readable.clear()
            await self._readable.wait()
        message, nbytes = self._pieces.popleft()
        self.buffered -= nbytes
        self._writable.set()
        return message

    def end(self, reason: SubscriptionEnded) -> None:
        """End the subscription now: what it buffered is discarded and waiters wake up."""
        if self._ended is None:
            self._ended = reason
            self._pieces.clear()
            self.buffered = 0
        self._readable.set()
        self._writable.set()


class Channel:
    """The subscribers of one channel name and the lock that orders its payloads."""

    def __init__(self, name: str, on_drop: Callable[[], None] | None = None) -> None:
        self.name = name
        #: Subscriptions in the order they came (a dict as an ordered set).
        self.subscriptions: dict[Subscription, None] = {}
        self.publishers = 0
        self._lock = asyncio.Lock()
        #: Called once for each subscriber dropped for falling behind (the hub counts them).
        self._on_drop = on_drop

    async def relay(self, pieces: Sequence[Piece], size: int, timeout: float) -> int:
        """Queue one whole payload for every current subscriber; returns how many were dropped.

        Subscribers with room get it at once; the others are waited for together, up
        to ``timeout`` seconds from now, and those still full then are dropped.
        """
        async with self._lock:
            waiting = []
            for subscription in list(self.subscriptions):
                if subscription.has_room(size):
                    subscription.put(pieces, size)
                else:
                    waiting.append(subscription)
            if not waiting:
                return 0
            deadline = asyncio.get_running_loop().time() + timeout
            dropped = 0
            for subscription in waiting:
                if await subscription.wait_for_room(size, deadline):
                    subscription.put(pieces, size)
                elif not subscription.ended:
                    subscription.end(
                        FellBehind(
                            f"subscriber fell behind on channel {self.name!r} and was dropped: "
                            f"{subscription.buffered} bytes buffered, the bound is {subscription.bound} bytes, "
                            f"and a payload of {size} bytes found no room within {timeout:g} s"
                        )
                    )
                    self.subscriptions.pop(subscription, None)
                    dropped += 1
                    if self._on_drop is not None:
                        self._on_drop()
            return dropped


class Hub:
    """Every live channel, by name."""

    def __init__(self, buffer_bytes: int, timeout: float) -> None:
        self.buffer_bytes = buffer_bytes
        self.timeout = timeout
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
            channel = self.channels[name] = Channel(name, self._count_drop)
        return channel

    def _forget_if_unused(self, channel: Channel) -> None:
        if not channel.subscriptions and not channel.publishers and self.channels.get(channel.name) is channel:
            del self.channels[channel.name]

    def subscribe(self, name: str) -> Subscription:
        """Register a subscriber: it receives every payload relayed from now on."""
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
