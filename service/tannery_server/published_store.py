"""A Publish that stores what it relays (``PublishRequest.store_as``): a publisher's bytes
written once, for the followers on the channel and for the store.

A weight version goes to the running followers on a channel and into the store as an
archive. Sent twice, it costs the publisher a second write of every byte and the server a
second receive, while the followers are still being served. With ``store_as``, the server
writes the payloads it relays into a :class:`~.store_session.StoreSession`, one entry per
named payload, as they pass: the same checks, hashing, deduplication and whole-or-nothing
commit as a Store.

The store never holds up the channel for long and never fails it:

- each relayed piece is queued (a reference, no copy) and written on worker threads, in
  order, while the channel goes on; only when :data:`BACKLOG_BYTES` are waiting does the
  relay wait for the writes;
- a store that fails (a name taken, a full disk, a payload abandoned) stops storing and
  removes what it wrote; the payloads are published all the same, and the call's answer
  says why nothing was stored (``store_error``), so the publisher stores them itself;
- the archive is committed only when the call's last payload has arrived whole and every
  named payload with it; a call cut off or cancelled stores nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from tannery_protocol.v1 import channels_pb2

from .archive_info import written
from .calllog import current_call
from .dataplane.channel_pieces import data_of
from .dataplane.store import SessionSteps
from .failures import Failure, Malformed, Unavailable
from .hub import Channel, Outbound, Relay
from .storage import ArchiveRecord
from .store_session import StoreSession
from .workers import Workers

log = logging.getLogger("tannery_server.published_store")

#: Bytes of relayed pieces waiting to be stored before the relay waits for the writes.
BACKLOG_BYTES = 256 << 20


class PublishedStore:
    """The archive one Publish call stores: payload ``i`` of the call is entry ``names[i]``
    (``""``: not stored)."""

    def __init__(self, session: StoreSession, workers: Workers, names: list[str],
                 failure_of: Callable[[BaseException], BaseException], backlog: int = BACKLOG_BYTES) -> None:
        self.session = session
        #: Storage errors as the server's failures (what a Store would answer).
        self.failure_of = failure_of
        self.steps = SessionSteps(workers, session)
        self.names = names
        self.backlog = backlog
        #: Why nothing will be stored (None while it may be).
        self.failure: BaseException | None = None
        self._payload = -1
        self._entries = self._bytes = 0
        self._queue: asyncio.Queue[tuple[Callable[..., Any], tuple, int] | None] = asyncio.Queue()
        self._queued = 0
        self._room = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._record: ArchiveRecord | None = None

    @property
    def archive(self) -> str:
        return self.session.archive

    async def start(self) -> None:
        """Check the name before the first payload (an alias there, other content): a refusal
        stops the storing, not the Publish."""
        try:
            await self.steps.run(self.session.check_existing)
        except Exception as exc:
            self._fail(exc)
        self._writer = asyncio.ensure_future(self._write())

    def channel(self, channel: Channel) -> "StoringChannel":
        """``channel`` as this call's publisher sees it: each payload it begins is stored too."""
        return StoringChannel(channel, self)

    def outbound(self, relay: Relay) -> Outbound:
        """What takes the pieces of the payload ``relay`` carries (the next of this call)."""
        self._payload += 1
        name = self.names[self._payload] if self._payload < len(self.names) else ""
        if name and self.failure is None:
            self._put(self.session.begin_entry, (name,), 0)
        return _Entry(self, name, relay.size, relay.outbound)

    async def finish(self) -> ArchiveRecord:
        """Every payload arrived: commit the archive once its bytes are written. Raises why
        nothing was stored (then nothing is)."""
        missing = [name for name in self.names[self._payload + 1:] if name]
        if missing and self.failure is None:
            self._fail(Malformed(f"store_as names {len(self.names)} payloads, {self._payload + 1} were published "
                                 f"(entry {missing[0]!r} never came)"))
        if self.failure is None:
            self._put(self.session.commit, (self._entries, self._bytes), 0)
            self._put(self.session.finish, (), 0)
        self._queue.put_nowait(None)
        if self._writer is not None:
            await asyncio.shield(self._writer)
        if self.failure is not None:
            raise self.failure
        assert self._record is not None
        return self._record

    async def abort(self) -> None:
        """The call failed or was cancelled: stop, then remove what was written."""
        self._fail(Malformed("the Publish was cut off"))
        self._queue.put_nowait(None)
        if self._writer is not None:
            await asyncio.shield(self._writer)

    def _put(self, step: Callable[..., Any], args: tuple, nbytes: int) -> None:
        self._queued += nbytes
        self._queue.put_nowait((step, args, nbytes))

    async def _piece(self, message: object, nbytes: int) -> None:
        if self.failure is not None:
            return
        self._put(self._write_piece, (message,), nbytes)
        while self._queued > self.backlog and self.failure is None and nbytes < self._queued:
            self._room.clear()
            await self._room.wait()

    def _write_piece(self, message: object) -> None:
        """One relayed piece's bytes into the entry (on a worker thread: read, not copied)."""
        self.session.write(memoryview(data_of(message)))

    async def _write(self) -> None:
        """The steps, one at a time, until the end; after a failure, the rest dropped and
        what was written removed."""
        while (item := await self._queue.get()) is not None:
            step, args, nbytes = item
            if self.failure is None:
                try:
                    result = await self.steps.run(step, *args)
                    if step == self.session.finish:  # the last step: the archive committed
                        self._record = result
                except Exception as exc:
                    self._fail(exc)
            self._queued -= nbytes
            self._room.set()
        if self.failure is not None:
            try:
                await self.steps.abort()
            except Exception:
                log.exception("storing the payloads published as %r: removing what was written failed",
                              self.archive)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = self.failure_of(exc)
            self._room.set()


class _Entry:
    """One payload's pieces, on their way to the store (and to ``then``, the relay's own
    outbound: other replicas, when there are)."""

    def __init__(self, store: PublishedStore, name: str, size: int, then: Outbound | None) -> None:
        self.store, self.name, self.size, self.then = store, name, size, then

    async def send(self, message: object, nbytes: int, last: bool) -> None:
        if self.then is not None:
            await self.then.send(message, nbytes, last)
        if self.name:
            await self.store._piece(message, nbytes)
            if last:
                self.store._entries += 1
                self.store._bytes += self.size

    def abandon(self) -> None:
        if self.then is not None:
            self.then.abandon()
        if self.name:
            self.store._fail(Malformed(f"the payload of entry {self.name!r} was cut off by its publisher"))


class StoringChannel:
    """A channel as one storing publisher sees it: what it begins is stored as well."""

    def __init__(self, channel: Channel, store: PublishedStore) -> None:
        self._channel = channel
        self._store = store

    @property
    def name(self) -> str:
        return self._channel.name

    async def begin(self, size: int, export: bool = True, origin: str = "") -> Relay:
        relay = await self._channel.begin(size, export, origin)
        relay.outbound = self._store.outbound(relay)
        return relay


class NotStoring:
    """The store of a Publish on a server that serves no Archives: it stores nothing, says so."""

    def __init__(self, archive: str) -> None:
        self.archive = archive

    def channel(self, channel: Channel) -> Channel:
        return channel

    async def finish(self) -> ArchiveRecord:
        raise Unavailable("this server serves no Archives: the payloads were published, not stored")

    async def abort(self) -> None:
        pass


#: What stores a Publish's payloads (or says why it does not).
Storing = PublishedStore | NotStoring


async def open_store(factory: Callable[[Any], PublishedStore] | None, first: Any) -> Storing | None:
    """The store a Publish asks for in its first message (``store_as``), started; None when it
    asks for none. ``factory`` (the Archives servicer's) raises Malformed for a bad archive name or
    metadata, before any payload."""
    if not first.HasField("store_as"):
        return None
    current_call().note("store_as", first.store_as.archive)
    if factory is None:
        return NotStoring(first.store_as.archive)
    store = factory(first.store_as)
    await store.start()
    return store


async def stored_answer(answer: channels_pb2.PublishResponse, store: Storing | None) -> channels_pb2.PublishResponse:
    """A Publish's answer with the archive its store committed, or why there is none (the
    payloads were published all the same)."""
    if store is None:
        return answer
    try:
        answer.stored.CopyFrom(written(await store.finish()))
    except Failure as failure:
        log.warning("Publish stored nothing as %r (the payloads were published): %s", store.archive, failure)
        answer.store_error = str(failure)
    return answer


__all__ = ["BACKLOG_BYTES", "NotStoring", "PublishedStore", "Storing", "StoringChannel", "open_store",
           "stored_answer"]
