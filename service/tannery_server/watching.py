"""Watch: an alias followed, its current target first, then each move.

Each server reads a watched alias from the catalog every :data:`POLL_SECONDS` (one
:class:`_Poller` per alias, shared by all its watchers, gone with its last watcher), so a
move made on any replica reaches every watcher without any channel between replicas, on
both catalogs. A move is also *announced* (:meth:`AliasWatches.moved`): a Tag or Untag on
this server reads the alias again at once, and :attr:`AliasWatches.announce` tells the
other replicas (through NATS, :mod:`.nats_fabric`), which do the same, so watchers hear of
a move in milliseconds, not a poll later; the poll remains for a lost announcement. A
watcher is sent the latest target whenever it is ready for one: a slow watcher skips the
moves in between instead of piling them up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from tannery_protocol.v1 import archives_pb2

from .failures import Missing, Unavailable
from .storage import AliasRecord

#: How often a watched alias is read from the catalog.
POLL_SECONDS = 0.25

log = logging.getLogger("tannery_server.watching")

#: Reads an alias on a worker thread: ``read(alias)`` gives its record, None when there is none.
Read = Callable[[str], Awaitable[AliasRecord | None]]


class _Poller:
    """One alias read every ``interval`` seconds; its watchers woken when it changes."""

    def __init__(self, alias: str, read: Read, interval: float) -> None:
        self.alias = alias
        self.record: AliasRecord | None = None
        #: Why the last read failed (the storage's error), None when it did not.
        self.failure: BaseException | None = None
        self.known = False
        self.watchers = 0
        self._changed = asyncio.Event()
        self._poked = asyncio.Event()
        self._read, self._interval = read, interval
        self.task = asyncio.create_task(self._run(), name=f"tannery-watch-{alias}")

    def wake(self) -> None:
        """Wake every watcher waiting in :meth:`changed`."""
        self._changed.set()
        self._changed = asyncio.Event()

    def poke(self) -> None:
        """Read the alias now rather than at the next poll (it has moved)."""
        self._poked.set()

    def changed(self) -> asyncio.Event:
        """What the next change sets (taken before looking at :attr:`record`)."""
        return self._changed

    async def _run(self) -> None:
        while True:
            try:
                record, failure = await self._read(self.alias), None
            except Exception as exc:  # the storage's error: told to the watchers, read again next time
                record, failure = None, exc
            moved = record is None or self.record is None or record.archive != self.record.archive
            if not self.known or failure is not None or self.failure is not None or moved:
                self.record, self.failure, self.known = (self.record if failure else record), failure, True
                self.wake()
            try:
                await asyncio.wait_for(self._poked.wait(), self._interval)
            except asyncio.TimeoutError:
                pass
            self._poked.clear()


class AliasWatches:
    """The aliases this server watches, one poller each; :meth:`close` ends every watch."""

    def __init__(self, read: Read, interval: float = POLL_SECONDS) -> None:
        self._read, self._interval = read, interval
        self._pollers: dict[str, _Poller] = {}
        self.closed = False
        #: Tells the other replicas that an alias moved (set by the app when there are any).
        self.announce: Callable[[str], None] | None = None

    def moved(self, alias: str) -> None:
        """``alias`` was tagged or untagged on this server: read it now, and tell the replicas."""
        self.poke(alias)
        if self.announce is not None:
            self.announce(alias)

    def poke(self, alias: str) -> None:
        """``alias`` moved (here or on another replica): its watchers' poller reads it now."""
        poller = self._pollers.get(alias)
        if poller is not None:
            poller.poke()

    def polled(self) -> list[str]:
        """The aliases read now (those somebody watches)."""
        return sorted(self._pollers)

    async def close(self) -> None:
        """End every watch (UNAVAILABLE: the server is shutting down) and stop the pollers."""
        self.closed = True
        for poller in list(self._pollers.values()):
            poller.wake()

    def _join(self, alias: str) -> _Poller:
        poller = self._pollers.get(alias)
        if poller is None:
            poller = self._pollers[alias] = _Poller(alias, self._read, self._interval)
        poller.watchers += 1
        return poller

    def _leave(self, poller: _Poller) -> None:
        poller.watchers -= 1
        if poller.watchers == 0:
            poller.task.cancel()
            if self._pollers.get(poller.alias) is poller:
                del self._pollers[poller.alias]

    async def serve(self, alias: str, context: grpc.aio.ServicerContext,
                    failure_of: Callable[[BaseException], BaseException]) -> None:
        """Write the alias's target to the call, then each new one, until the call ends; the
        failure (NOT_FOUND, UNAVAILABLE) that ends it otherwise is raised."""
        if self.closed:
            raise _shutting_down()
        poller = self._join(alias)
        try:
            sent: str | None = None
            while True:
                changed = poller.changed()
                if self.closed:
                    raise _shutting_down()
                if poller.known:
                    if poller.failure is not None:
                        raise failure_of(poller.failure)
                    if poller.record is None:
                        raise _gone(alias, sent)
                    if poller.record.archive != sent:
                        sent = poller.record.archive
                        await context.write(_response(poller.record))  # a slow watcher waits here: no backlog
                        continue
                await changed.wait()
        finally:
            self._leave(poller)


def _response(record: AliasRecord) -> archives_pb2.WatchResponse:
    moved = Timestamp()
    moved.FromNanoseconds(record.moved_ns)
    return archives_pb2.WatchResponse(archive=record.archive, moved=moved)


def _gone(alias: str, sent: str | None) -> Missing:
    if sent is None:
        return Missing(f"alias {alias!r} not found: there is nothing to watch (tannery tag {alias} ARCHIVE creates it)")
    return Missing(f"alias {alias!r} was removed while watched (it pointed at {sent!r}); the watch is over")


def _shutting_down() -> Unavailable:
    return Unavailable("the server is shutting down: watch again (the clients resume by themselves)")


def add_watch(servicer: Any) -> AliasWatches:
    """The watches of an Archives servicer, reading aliases on its worker threads."""

    async def read(alias: str) -> AliasRecord | None:
        return await servicer.workers.run(servicer.storage.catalog.alias, alias)

    return AliasWatches(read)
