"""Channels across replicas through NATS core (nats-py): payloads in chunks, reassembled whole.

Each replica holds one NATS connection (``no_echo``: its own messages never come back to
it). A channel is the subject ``tannery.channel.<base64url of its name>``; a replica
subscribes to it while it has subscribers of that channel, and a ``Subscribe`` is
registered only after that subscription is flushed to the server.

A payload a publisher relays here goes out as NATS messages of at most the server's
``max_payload``, each a :data:`HEADER` and a slice of the payload: (origin replica, the
payload's number on that channel at its origin, chunk index, payload size, flags). A
replica relays one payload per channel at a time (the channel's lock), so a payload's
origin and number say which publisher sent it and in what order.

A receiving replica reassembles per channel and origin: chunks must come in order from
index 0 (a chunk of a payload whose start it did not see is ignored: it subscribed
mid-payload); a payload is relayed to the local subscribers only once whole. An incomplete
payload is dropped when a later one from its origin starts, when its origin abandons it,
or when no chunk of it came for ``channel_timeout_seconds`` (its replica died or lost
NATS): no subscriber ever sees a torn payload. The bytes a channel holds here (being
reassembled, or whole and waiting for the subscribers' buffers) are bounded by
``nats_channel_bytes``.

NATS core gives a publisher no backpressure from other replicas: a subscriber that cannot
keep up is dropped (RESOURCE_EXHAUSTED, saying so): when the bound is reached, those whose
buffers are full; when none is, the payload that does not fit is dropped and every local
subscriber of the channel with it. Lost chunks (a gap in the indexes) end the channel's
local subscribers the same way. Losing NATS ends every subscription here with UNAVAILABLE
(payloads would be missed silently otherwise) and publishes fail with UNAVAILABLE naming
NATS until nats-py has reconnected by itself.

Alias moves are announced on the subject :data:`ALIASES` (the alias's name, UTF-8), so the
Watch calls of every replica hear of a move at once (:mod:`.watching`); an announcement
lost with NATS costs only the poll interval.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import os
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import nats
from nats.aio.client import Client as NatsClient

from .config import Config, without_password
from .failures import Unavailable
from .hub import FellBehind, Hub, Piece, SubscriptionEnded

log = logging.getLogger("tannery_server.nats")

#: Every chunk's header: magic, flags, origin replica (16 bytes), payload number, chunk index, payload size.
HEADER = struct.Struct("!2sB16sQIQ")
MAGIC = b"T1"
#: Flags: the payload's last chunk; the payload is abandoned (no data).
LAST, ABANDON = 1, 2
SUBJECT_PREFIX = "tannery.channel."
#: Seconds between two attempts to reach NATS again after losing it.
RECONNECT_SECONDS = 0.5
#: Seconds the start waits for NATS before giving up.
CONNECT_SECONDS = 10.0
#: Seconds a Subscribe waits for NATS to confirm the replica's interest.
FLUSH_SECONDS = 5.0


#: The subject alias moves are announced on.
ALIASES = "tannery.aliases"


def subject_of(channel: str) -> str:
    """The NATS subject of a channel (any channel name: NATS subjects allow fewer characters)."""
    return SUBJECT_PREFIX + base64.urlsafe_b64encode(channel.encode("utf-8")).decode("ascii").rstrip("=")


class NatsLost(SubscriptionEnded):
    """The replica lost NATS: a subscriber would miss payloads from other replicas."""


@dataclass
class _Partial:
    """A payload from another replica, being reassembled."""

    number: int
    size: int
    chunks: list[bytes] = field(default_factory=list)
    received: int = 0
    touched: float = 0.0


@dataclass
class _Inbox:
    """What one channel holds here of other replicas' payloads."""

    partial: dict[bytes, _Partial] = field(default_factory=dict)
    ready: deque[tuple[list[bytes], int]] = field(default_factory=deque)
    #: Bytes held: partial and ready payloads.
    held: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


@dataclass
class _Interest:
    count: int = 0
    subscription: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class _Outbound:
    """One payload of a publisher here, going out to NATS in chunks (a :class:`~.hub.Outbound`)."""

    def __init__(self, fabric: NatsFabric, channel: str, number: int, size: int) -> None:
        self.fabric = fabric
        self.subject = subject_of(channel)
        self.number = number
        self.size = size
        self.index = 0

    def _header(self, flags: int) -> bytes:
        return HEADER.pack(MAGIC, flags, self.fabric.origin, self.number, self.index, self.size)

    async def send(self, message: object, nbytes: int, last: bool) -> None:
        fabric = self.fabric
        fabric.check()
        data = memoryview(fabric.data_of(message)).cast("B")
        step = max(1, fabric.nc.max_payload - HEADER.size)
        try:
            for start in range(0, len(data), step):
                end = min(start + step, len(data))
                flags = LAST if last and end == len(data) else 0
                await fabric.nc.publish(self.subject, self._header(flags) + data[start:end])
                self.index += 1
        except Exception as exc:
            raise Unavailable(f"{fabric.name} did not take a chunk of payload {self.number} on this channel "
                              f"({type(exc).__name__}: {exc}); the payload is abandoned, publish again once "
                              "NATS is back (the replica reconnects by itself)") from None
        fabric.bytes_out += len(data)
        if last:
            fabric.payloads_out += 1

    def abandon(self) -> None:
        if self.index and self.fabric.connected:
            self.fabric.spawn(self.fabric.nc.publish(self.subject, self._header(ABANDON)))


class NatsFabric:
    """Channels joined across replicas through NATS (see the module's docstring)."""

    def __init__(self, config: Config, hub: Hub, pieces: Callable[[bytes], list[Piece]],
                 data_of: Callable[[object], Any]) -> None:
        self.urls = [url.strip() for url in config.nats.split(",") if url.strip()]
        #: What messages call NATS: its URLs without passwords.
        self.name = "NATS at " + ",".join(without_password(url) for url in self.urls)
        self.creds = str(config.nats_creds) if config.nats_creds else None
        self.hub = hub
        self.pieces = pieces
        self.data_of = data_of
        self.timeout = config.channel_timeout_seconds
        self.bound = config.nats_channel_bytes
        self.origin = os.urandom(16)
        self.nc: NatsClient | None = None
        self.connected = False
        self.payloads_out = self.bytes_out = self.payloads_in = self.bytes_in = 0
        #: Incomplete payloads dropped, and subscribers dropped for cross-replica reasons.
        self.incomplete = self.dropped = 0
        self._interests: dict[str, _Interest] = {}
        self._inboxes: dict[str, _Inbox] = {}
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self.alias_moved: Callable[[str], None] | None = None

    @property
    def exporter(self):
        return lambda channel, number, size: _Outbound(self, channel, number, size)

    def stats(self) -> dict[str, Any]:
        return {"connected": self.connected, "payloads_out": self.payloads_out, "bytes_out": self.bytes_out,
                "payloads_in": self.payloads_in, "bytes_in": self.bytes_in, "incomplete": self.incomplete,
                "dropped": self.dropped}

    def spawn(self, coroutine) -> None:
        """Run ``coroutine`` in the background, its errors logged, never raised."""

        async def guarded() -> None:
            try:
                await coroutine
            except Exception as exc:
                log.debug("%s: %s", self.name, exc)

        task = asyncio.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- connection ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (OSError naming NATS if it does not answer within CONNECT_SECONDS)."""
        options: dict[str, Any] = dict(
            servers=self.urls, no_echo=True, allow_reconnect=True, max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_SECONDS, connect_timeout=2, name="tannery",
            error_cb=self._on_error, disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
            closed_cb=self._on_disconnected)
        if self.creds:
            options["user_credentials"] = self.creds
        try:
            self.nc = await asyncio.wait_for(nats.connect(**options), CONNECT_SECONDS)
        except (Exception, asyncio.TimeoutError) as exc:
            raise OSError(f"cannot reach {self.name} ({type(exc).__name__}: {exc}): start nats-server there, or "
                          "correct --nats / TANNERY_NATS") from None
        self.connected = True
        await self.nc.subscribe(ALIASES, cb=self._on_alias)
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("channels across replicas through %s (max_payload %d bytes)", self.name, self.nc.max_payload)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for inbox in self._inboxes.values():
            if inbox.task is not None:
                inbox.task.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self.nc is not None:
            self.connected = False
            try:
                await self.nc.close()
            except Exception:
                pass

    def check(self) -> None:
        if not self.connected:
            raise Unavailable(f"{self.name} is unreachable: channels across replicas are down on this replica "
                              "(it reconnects by itself); try again shortly")

    def announce(self, alias: str) -> None:
        if self.connected and self.nc is not None:
            self.spawn(self.nc.publish(ALIASES, alias.encode()))

    async def _on_alias(self, msg: Any) -> None:
        if self.alias_moved is not None:
            self.alias_moved(msg.data.decode(errors="replace"))

    async def _on_error(self, exc: Exception) -> None:
        log.warning("%s: %s", self.name, exc or type(exc).__name__)

    async def _on_disconnected(self) -> None:
        if not self.connected:
            return
        self.connected = False
        for inbox in self._inboxes.values():
            self._discard_all(inbox)
        ended = self.hub.end_all(NatsLost(f"this replica lost {self.name}: payloads from other replicas would be "
                                          "missed, so the subscription ends; subscribe again once NATS is back "
                                          "(the replica reconnects by itself)"))
        self.dropped += ended
        log.warning("lost %s: %d subscriptions ended; reconnecting", self.name, ended)

    async def _on_reconnected(self) -> None:
        self.connected = True
        log.info("reconnected to %s", self.name)

    # -- interest --------------------------------------------------------------------------

    async def join(self, channel: str) -> None:
        self.check()
        interest = self._interests.setdefault(channel, _Interest())
        interest.count += 1
        try:
            async with interest.lock:
                if interest.subscription is None:
                    assert self.nc is not None
                    subscription = await self.nc.subscribe(
                        subject_of(channel), cb=functools.partial(self._on_message, channel),
                        pending_bytes_limit=self.bound + 16 * (1 << 20))
                    interest.subscription = subscription
                    await self.nc.flush(FLUSH_SECONDS)
        except Exception as exc:
            self.leave(channel)
            raise Unavailable(f"{self.name} did not confirm this replica's interest in channel {channel!r} "
                              f"({type(exc).__name__}: {exc}); try again shortly") from None

    def leave(self, channel: str) -> None:
        interest = self._interests.get(channel)
        if interest is None:
            return
        interest.count -= 1
        if interest.count > 0:
            return
        del self._interests[channel]
        if interest.subscription is not None:
            self.spawn(interest.subscription.unsubscribe())
        inbox = self._inboxes.pop(channel, None)
        if inbox is not None and inbox.task is not None:
            inbox.task.cancel()

    # -- reassembly ------------------------------------------------------------------------

    async def _on_message(self, channel: str, msg: Any) -> None:
        data: bytes = msg.data
        if len(data) < HEADER.size:
            return
        magic, flags, origin, number, index, size = HEADER.unpack_from(data)
        if magic != MAGIC or origin == self.origin or channel not in self._interests:
            return
        inbox = self._inboxes.get(channel)
        if inbox is None:
            inbox = self._inboxes[channel] = _Inbox()
        partial = inbox.partial.get(origin)
        if partial is not None and partial.number != number:
            self._discard(inbox, origin)  # a later payload from that origin: the earlier one is cut off
            partial = None
        if flags & ABANDON:
            return
        if partial is None:
            if index != 0:
                return  # the tail of a payload begun before this replica listened, or already dropped
            partial = inbox.partial[origin] = _Partial(number, size)
        elif index != len(partial.chunks):
            self._discard(inbox, origin)
            self._drop_subscribers(channel, f"chunks of a payload from another replica were lost in NATS "
                                   f"(chunk {index} came after {len(partial.chunks) - 1}: a slow consumer here?)")
            return
        chunk = data[HEADER.size:]
        if inbox.held + len(chunk) > self.bound and not self._make_room(channel, inbox, origin, size, len(chunk)):
            return
        partial.chunks.append(chunk)
        partial.received += len(chunk)
        partial.touched = time.monotonic()
        inbox.held += len(chunk)
        if flags & LAST:
            del inbox.partial[origin]
            if partial.received != partial.size:
                inbox.held -= partial.received
                self.incomplete += 1
                return
            inbox.ready.append((partial.chunks, partial.size))
            inbox.wake.set()
            if inbox.task is None:
                inbox.task = asyncio.create_task(self._deliver(channel, inbox))

    def _make_room(self, channel: str, inbox: _Inbox, origin: bytes, size: int, nbytes: int) -> bool:
        """The bound is reached: drop the subscribers whose buffers are full (the delivery is
        waiting for them); when none is, drop the incoming payload and every local subscriber."""
        live = self.hub.channels.get(channel)
        full = [s for s in (live.subscriptions if live else ()) if not s.has_room(nbytes)]
        note = (f"payloads from other replicas of channel {channel!r} arrived faster than it took them: "
                f"{inbox.held} bytes held here, the bound is {self.bound} bytes (--nats-channel-bytes); NATS "
                "gives publishers on other replicas no backpressure")
        if full and live is not None:
            for subscription in full:
                live.drop(subscription, FellBehind("subscriber fell behind and was dropped: " + note))
                self.dropped += 1
            return True
        self._discard(inbox, origin)
        self._drop_subscribers(channel, f"a {size}-byte payload did not fit: " + note)
        return False

    def _drop_subscribers(self, channel: str, why: str) -> None:
        live = self.hub.channels.get(channel)
        for subscription in list(live.subscriptions if live else ()):
            live.drop(subscription, FellBehind(f"subscriber of channel {channel!r} dropped: {why}"))
            self.dropped += 1

    def _discard(self, inbox: _Inbox, origin: bytes) -> None:
        partial = inbox.partial.pop(origin, None)
        if partial is not None:
            inbox.held -= partial.received
            self.incomplete += 1

    def _discard_all(self, inbox: _Inbox) -> None:
        for origin in list(inbox.partial):
            self._discard(inbox, origin)

    async def _sweep(self) -> None:
        """Drop incomplete payloads whose origin sent nothing for the channel timeout."""
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.timeout / 4)))
            stale = time.monotonic() - self.timeout
            for inbox in list(self._inboxes.values()):
                for origin, partial in list(inbox.partial.items()):
                    if partial.touched < stale:
                        self._discard(inbox, origin)

    async def _deliver(self, channel: str, inbox: _Inbox) -> None:
        """Relay the channel's whole payloads from other replicas to its subscribers here, in order."""
        note = (f" (a payload from another replica, through NATS: its publisher is not held back by subscribers "
                f"here)")
        while True:
            while not inbox.ready:
                inbox.wake.clear()
                await inbox.wake.wait()
            chunks, size = inbox.ready[0]
            try:
                live = self.hub.attach_publisher(channel)
            except SubscriptionEnded:
                return
            try:
                if live.subscriptions:
                    relay = await live.begin(size, export=False, origin=note)
                    try:
                        for chunk in chunks:
                            for message, nbytes in self.pieces(chunk):
                                await relay.put(message, nbytes, self.timeout)
                    finally:
                        relay.abandon() if relay.put_bytes < size else relay.finish()
                self.payloads_in += 1
                self.bytes_in += size
                self.hub.traffic("in", "nats", size)
            finally:
                self.hub.detach_publisher(live)
                inbox.ready.popleft()
                inbox.held -= size
