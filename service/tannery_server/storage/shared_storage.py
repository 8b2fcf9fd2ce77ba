"""Storage that several server replicas share: a PostgreSQL catalog and a bucket of blobs.

No replica keeps anything in memory that another would need. What keeps a blob from
being collected is in the catalog (see :class:`~.base.SharedCatalog` and
``docs/scale-out.md``):

* a Store leases each blob once its bytes are sealed, until its archive commits (which
  checks the leases are still live) or the call ends; this replica renews its leases while
  it runs, so those of a replica killed mid-Store expire;
* an unreferenced blob is collected only after a grace period since it was last touched
  (its last reference went, or its last lease), which also gives a Fetch that was reading
  it when its archive was deleted that long to finish; no Fetch writes to the catalog;
* collection claims the blob row under its lock, deletes the bytes outside any transaction,
  then forgets the row (:meth:`~.base.SharedCatalog.collect_blob`), so it never races a lease
  and never holds a lock while the bucket answers.

A background sweeper collects: Delete and a replacing Store answer at once and free the
bucket's space after the grace period. A blob whose removal fails is skipped and tried again
later with backoff (:class:`~.collect_backoff.CollectBackoff`), so one stuck object never
stops the rest. Leases are renewed by a thread of their own, never behind a collection.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from .base import ArchiveLimits, MoveNote, ArchiveRecord, BlobInfo, BlobStore, EntryRecord, SharedCatalog
from .collect_backoff import CollectBackoff
from .core import Collected, StorageBase
from .integrity import BLOCK_SIZE
from .payload_writer import PayloadWriter

log = logging.getLogger("tannery_server.storage")
T = TypeVar("T")
NS = 1_000_000_000
#: Collectable blobs read from the catalog at a time.
BATCH = 256


class _RemoveFailed(Exception):
    """The bucket's (or disk's) removal of one blob failed: that blob is skipped, not the sweep."""


class SharedStorage(StorageBase):
    """Storage on a shared catalog, the sibling of the embedded :class:`~.catalog_and_blobs.Storage`:
    leases in the catalog, collection by a sweeper, no space reserve (the disk is not ours)."""

    def __init__(self, catalog: SharedCatalog, blobs: BlobStore, *, grace_seconds: float, lease_seconds: float,
                 sweep_seconds: float | None = None, replica: str | None = None, collecting: bool = True) -> None:
        super().__init__(catalog, blobs)
        self.catalog: SharedCatalog = catalog
        #: This process, as its leases name it.
        self.replica = replica or uuid.uuid4().hex
        self.grace_ns = int(grace_seconds * NS)
        self.lease_ns = int(lease_seconds * NS)
        #: How often the lease renewer renews and the sweeper collects (each on its own thread):
        #: often enough that a lease is renewed at least three times before it would expire.
        self.sweep_seconds = sweep_seconds if sweep_seconds is not None else min(lease_seconds / 4, 30.0)
        #: False for a tool (``tannery migrate``, ``scrub``): no sweeper, only lease renewal.
        self.collecting = collecting
        #: The blobs whose removal failed, and when to try each again.
        self.backoff = CollectBackoff(first_seconds=max(self.sweep_seconds, 1.0))
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # Life ---------------------------------------------------------------------------------

    def recover(self) -> None:
        """Nothing is removed at start-up (other replicas are working): the lease renewer and
        (when collecting) the sweeper start, each a thread of its own."""
        if self._threads:
            return
        loops = [("tannery-lease-renewer", self._renew_forever)]
        if self.collecting:
            loops.append(("tannery-sweeper", self._sweep_forever))
        for name, loop in loops:
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []
        super().close()

    # Writing ------------------------------------------------------------------------------

    def new_payload(self, expected: str | None = None, block_size: int = BLOCK_SIZE) -> PayloadWriter:
        """A payload to write; ``expected``: its SHA-256 given ahead, which lets a bucket upload
        it straight to its digest key (no temporary object, no copy). No space reserve is kept:
        the writer checks no room."""
        return PayloadWriter(self.blobs.create(expected), block_size, None, expected)

    def seal(self, writer: PayloadWriter, holder: str | None = None) -> BlobInfo:
        """Lease the payload's blob for ``holder``, then put its bytes under its digest (or find
        them there already). The lease comes first: a collection that got the blob row's
        lock before it has removed the old bytes by the time the lease is taken."""
        blob = writer.finish()
        holder = holder or uuid.uuid4().hex
        try:
            self.catalog.lease(blob, self.replica, holder, time.time_ns() + self.lease_ns)
        except BaseException:
            writer.temp.discard()  # the upload goes now, not after the grace period
            raise
        try:
            writer.temp.seal(blob.digest)
        except BaseException:
            self._drop_leases(holder)
            raise
        return blob

    def adopt(self, blob: BlobInfo, holder: str) -> bool:
        """Lease a blob this store already has (its record and its bytes) for ``holder``, which then
        need not write it again (``tannery migrate`` run again); False when it is not all there."""
        if self.catalog.blob(blob.digest) is None:
            return False
        self.catalog.lease(blob, self.replica, holder, time.time_ns() + self.lease_ns)
        try:
            self.blobs.open(blob.digest).close()  # no size given: a bucket is asked whether it is there
        except FileNotFoundError:
            return False  # the lease stays: the upload that follows is held by it too
        return True

    def reuse(self, digest: str, holder: str) -> bool:
        """Lease blob ``digest`` for ``holder``, whose commit references it (the catalog checks the
        leases of every blob an archive references); False when its record is gone (collected)."""
        info = self.catalog.blob(digest)
        if info is None:
            return False
        # The lease touches the row; it inserts one only when the blob was collected meanwhile.
        return self.catalog.lease(info, self.replica, holder, time.time_ns() + self.lease_ns)

    def commit_archive(self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool,
                       holder: str | None = None, metadata: Mapping[str, str] | None = None,
                       created_ns: int | None = None) -> ArchiveRecord:
        """Commit an archive whose blobs ``holder`` leased (the catalog checks the leases are live),
        created now, or at ``created_ns`` (a migrated archive keeps its creation time)."""
        if holder is None:
            raise ValueError("a shared store commits leased blobs only: pass the holder that sealed them")
        self.blobs.make_durable(b.digest for b in blobs)
        now = time.time_ns()
        created = now if created_ns is None else created_ns
        record, _released = self.catalog.commit_leased(name, entries, replace, created, self.replica, holder, now,
                                                        metadata)
        return record  # what the replaced archive released is collected after the grace period

    def release(self, digests: Iterable[str], collect: bool = False, holder: str | None = None) -> Collected:
        """End a Store's hold (its leases); reads hold nothing. Collection is the sweeper's."""
        if holder is not None:
            self._drop_leases(holder)
        return Collected()

    def _drop_leases(self, holder: str) -> None:
        try:
            self.catalog.drop_leases(self.replica, holder)
        except Exception as exc:  # they expire anyway; the call's own outcome matters more
            log.warning("could not drop the leases of %s (they expire on their own): %s", holder, exc)

    def remove_leak(self, digest: str) -> bool:
        """Delete bytes no catalog row names, beside running replicas: claimed in the catalog
        first, so a Store leasing the same bytes meanwhile waits and uploads them again."""
        return self.catalog.collect_orphan(digest, self.blobs.remove)

    def pinned(self, lookup: Callable[[], T], digests_of: Callable[[T], Iterable[str]]) -> T:
        """A lookup with no pin: the grace period keeps an unreferenced blob for a read under way."""
        return lookup()

    # Collecting ---------------------------------------------------------------------------

    def renew(self, now_ns: int | None = None) -> int:
        """Extend this replica's leases to a lease period from now; how many."""
        now = time.time_ns() if now_ns is None else now_ns
        return self.catalog.renew_leases(self.replica, now + self.lease_ns)

    def sweep(self, now_ns: int | None = None) -> Collected:
        """Remove uploads abandoned longer than the grace period, and collect the blobs that have
        been unreferenced and unleased that long: every candidate is tried once (but those
        waiting out a backoff), whatever the others do."""
        if not self.collecting:
            return Collected()
        now = time.time_ns() if now_ns is None else now_ns
        before = now - self.grace_ns
        abandoned = self.blobs.clear_temporary(before)
        if abandoned:
            log.info("removed %d uploads abandoned for longer than the grace period", abandoned)
        started = time.time_ns()
        waiting = self.backoff.waiting(started)
        tried = set(waiting)
        blobs = freed = 0
        while not self._stopping.is_set():
            digests = self.catalog.collectable(before, now, BATCH, skip=tried)
            for digest in digests:
                size = self._collect_one(digest, before, now)
                if size is not None:
                    blobs, freed = blobs + 1, freed + size
            tried.update(digests)
            if len(digests) < BATCH:
                self.backoff.forget_due_except(tried - waiting, started)
                break
        if blobs:
            log.info("collected %d unreferenced blobs (%d bytes)", blobs, freed)
        return Collected(blobs, freed)

    def _collect_one(self, digest: str, before: int, now: int) -> int | None:
        """Collect one blob: the bytes freed, or None (still in use, or its removal failed: then it
        is logged, counted and skipped until its backoff ends)."""
        sizes: list[int] = []

        def remove(d: str) -> None:
            try:
                sizes.append(self.blobs.remove(d))
            except Exception as exc:
                raise _RemoveFailed(str(exc)) from exc

        try:
            collected = self.catalog.collect_blob(digest, before, now, remove)
        except _RemoveFailed as exc:
            wait = self.backoff.failed(digest, str(exc), time.time_ns())
            log.warning("could not collect blob %s (skipped; tried again in %.0f s): %s", digest, wait, exc)
            return None
        self.backoff.done(digest)
        return sum(sizes) if collected else None

    def _sweep_forever(self) -> None:
        self._every(self.sweep, "sweep")

    def _renew_forever(self) -> None:
        self._every(self.renew, "lease renewal")

    def _every(self, work: Callable[[], object], what: str) -> None:
        """Run ``work`` every :attr:`sweep_seconds` until closed; a failure is logged and tried again."""
        while not self._stopping.is_set():
            try:
                work()
            except Exception as exc:  # the catalog or bucket away: try again at the next round
                log.warning("%s failed (retried in %.0f s): %s", what, self.sweep_seconds, exc)
            self._stopping.wait(self.sweep_seconds)

    # Unions and deletes answer at once; the catalog touches what they release ---------------

    def union(self, target: str, sources: Sequence[tuple[str, str]], replace: bool, limits: ArchiveLimits,
              metadata: Mapping[str, str] | None = None) -> ArchiveRecord:
        record, _released = self.catalog.union(target, sources, replace, time.time_ns(), limits, metadata)
        return record

    def delete(self, name: str, force: bool = False, note: MoveNote = MoveNote()) -> tuple[ArchiveRecord | None, Collected]:
        record, _released = self.catalog.delete_archive(name, force, note)
        return record, Collected()
