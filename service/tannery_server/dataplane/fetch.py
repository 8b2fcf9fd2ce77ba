"""Fetch, whatever the transport: :func:`serve_fetch`.

On a data path the plans are resolved, then sent on the data connection
(:mod:`.fetch_link`). On the gRPC stream, :class:`FetchStream` runs in a worker thread
and yields encoded ``FetchResponse`` messages of exactly ``chunk_size`` bytes of payload
(the last of each entry shorter), every one made from checked blocks
(:class:`~.blocks.VerifiedBlob`); the call sends one batch while the next one is read.
When the request says ``batched_entries``, consecutive small entries served as stored go
whole, several to a message of up to ``chunk_size`` bytes (``FetchResponse.entries``).
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Iterator, Sequence

import grpc

from tannery_protocol.v1 import archives_pb2
from tannery_protocol.wire import BATCHED_BELOW, FETCH_ENTRIES, VERSION_KEY, EntryBatch, encode_fetch_response, split_parts

from ..calllog import current_call
from ..fetching import Plan, digests, fetch_version, resolve
from ..storage import Damaged, Storage
from ..workers import Workers, settle
from ..storage.block_reader import BlobShelf
from .blocks import VerifiedBlob
from .fetch_link import send_fetch
from .plane import DataPlane

#: Bytes of messages a Fetch prepares per trip to a worker thread (one more batch is read ahead).
FETCH_BATCH_BYTES = 4 << 20


async def serve_fetch(plane: DataPlane, storage: Storage, request: archives_pb2.FetchRequest, context,
                      chunk_size: int, batched: bool = False) -> None:
    """Send what a checked Fetch request asks for, on the transport its call asks for (on
    gRPC, small entries several to a message with ``batched``)."""
    transport = plane.transport(context)
    if transport is None:
        await _stream(plane.workers, storage, request, context, chunk_size, batched)
        return
    resolving = plane.workers.start(resolve, storage, request)
    try:
        plans = await asyncio.shield(resolving)
    except asyncio.CancelledError:  # the thread pins the blobs it resolves: release them once it is done
        await asyncio.shield(_release_resolved(plane, storage, resolving))
        raise
    try:
        sent = await plane.over_link(transport, context, send_fetch, storage, plans, batched,
                                     metadata=version_metadata(plans))
        current_call().note("data_bytes", sent)
    finally:
        await asyncio.shield(plane.workers.run(storage.release, digests(plans)))


def version_metadata(plans: Sequence[Plan]) -> tuple[tuple[str, str], ...]:
    """The initial metadata naming the version of the archive a Fetch reads (none for no plans):
    what a resumed Fetch sends back, so that it never mixes two versions."""
    version = fetch_version(plans)
    return ((VERSION_KEY, version),) if version else ()


async def _release_resolved(plane: DataPlane, storage: Storage, resolving: asyncio.Future) -> None:
    """Release the pins of plans a cancelled Fetch was resolving, once the thread has them."""
    await settle(resolving)
    if not resolving.cancelled() and resolving.exception() is None:
        await plane.workers.run(storage.release, digests(resolving.result()))


async def _stream(workers: Workers, storage: Storage, request: archives_pb2.FetchRequest, context,
                  chunk_size: int, batched: bool) -> None:
    """The Fetch on its gRPC stream, one batch of messages sent while the next is read."""
    # One trip resolves the request and reads the first batch; a fetch that fits in it
    # is over (blobs closed, pins released) when the trip returns.
    opening = workers.start(FetchStream.open, storage, request, chunk_size, FETCH_BATCH_BYTES, batched)
    try:
        stream, batch = await asyncio.shield(opening)
    except asyncio.CancelledError:
        await asyncio.shield(_close_opening(workers, opening))
        raise
    ahead: asyncio.Future | None = None
    try:
        await context.send_initial_metadata(version_metadata(stream.plans))
        while True:
            # The next batch is read while this one is sent.
            ahead = None if stream.done else workers.start(stream.next_batch, FETCH_BATCH_BYTES)
            for message in batch:
                await _write(context, message)
            if ahead is None:
                return
            # Shielded: a cancelled call must not close the stream under the thread reading it.
            batch = await asyncio.shield(ahead)
    finally:
        if not stream.done or ahead is not None:
            await asyncio.shield(_close_fetch(workers, stream, ahead))


async def _close_opening(workers: Workers, opening: asyncio.Future) -> None:
    """Close the stream a cancelled Fetch was opening, once the thread has opened it."""
    await settle(opening)
    if not opening.cancelled() and opening.exception() is None:
        stream, _ = opening.result()
        if not stream.done:
            await workers.run(stream.close)


async def _close_fetch(workers: Workers, stream: "FetchStream", ahead: asyncio.Future | None) -> None:
    """Wait for the thread reading ahead, then close the stream (its blobs and pins) if it is not over."""
    await settle(ahead)
    if not stream.done:  # cancelled or failed midway: close it on a worker thread
        await workers.run(stream.close)


async def _write(context: grpc.aio.ServicerContext, message: bytes) -> None:
    """Send one response message; CancelledError when the client has gone (grpc.aio would log
    a traceback for the failed write of a yielded message)."""
    try:
        await context.write(message)
    except grpc.aio.InternalError:
        raise asyncio.CancelledError() from None


class FetchStream:
    """The encoded response messages of a fetch, produced by a worker thread in batches.

    It knows its end: the batch that holds the last message says so (:attr:`done`), and
    the stream has closed its blob and released its pins by then, so a fetch that fits in
    one batch takes one trip to a worker thread (:meth:`open`), resolving included.
    """

    def __init__(self, storage: Storage, plans: Sequence[Plan], chunk_size: int, batched: bool = False) -> None:
        self.storage = storage
        self.plans = plans
        self.chunk_size = chunk_size
        #: Small entries served as stored go whole, several to a message (the client reads them).
        self.batched = batched
        self.done = False
        self._messages = self._all()
        self._next: bytes | None = None  # a message read to learn whether the stream ends
        self._error: Exception | None = None  # raised once the messages before it are out
        self._released = False
        #: A pack stays open (with its last checked block) while consecutive entries read it.
        self._shelf = BlobShelf(storage.open_blob)

    @classmethod
    def open(cls, storage: Storage, request: archives_pb2.FetchRequest, chunk_size: int, max_bytes: int,
             batched: bool = False) -> tuple["FetchStream", list[bytes]]:
        """Resolve a request (pinning its blobs) and produce the first batch, in one go."""
        stream = cls(storage, resolve(storage, request), chunk_size, batched)
        try:
            return stream, stream.next_batch(max_bytes)
        except BaseException:
            stream.close()
            raise

    def next_batch(self, max_bytes: int) -> list[bytes]:
        """The next messages, about ``max_bytes`` of them; the last batch sets :attr:`done`
        and closes the stream. A failure is raised after the messages before it were
        returned (by the next call, if this batch has some)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        batch: list[bytes] = []
        size = 0
        if self._next is not None:
            batch.append(self._next)
            size, self._next = len(self._next), None
        try:
            for message in self._messages:
                if size >= max_bytes:
                    self._next = message
                    return batch
                batch.append(message)
                size += len(message)
        except Exception as error:
            if not batch:
                raise
            self._error = error
            return batch
        self.close()
        return batch

    def close(self) -> None:
        """Stop reading (closing the blob being read) and unpin the blobs; idempotent."""
        self.done = True
        self._next = None
        self._messages.close()
        self._shelf.close()
        if not self._released:
            self._released = True
            self.storage.release(digests(self.plans))

    def _all(self) -> Iterator[bytes]:
        if not self.batched:
            for plan in self.plans:
                yield from self._entry(plan)
            return
        batch = EntryBatch(FETCH_ENTRIES, self.chunk_size)
        try:
            for plan in self.plans:
                name = plan.entry.name.encode("utf-8")
                cost = batch.cost(name, plan.entry.payload_bytes)
                if plan.prefix is None and plan.entry.payload_bytes < BATCHED_BELOW and cost <= self.chunk_size:
                    if batch.full_for(cost):
                        yield batch.take()
                    self._add_whole(batch, plan, name)
                    continue
                if batch.count:
                    yield batch.take()
                yield from self._entry(plan)
        except Exception:
            if batch.count:  # the entries checked before the failure go out first
                yield batch.take()
            raise
        if batch.count:
            yield batch.take()

    def _add_whole(self, batch: EntryBatch, plan: Plan, name: bytes) -> None:
        """A small entry served as stored, whole, into ``batch``: read in checked blocks
        (:meth:`VerifiedBlob.pieces`), views kept while their memory outlives the blob."""
        with VerifiedBlob(self.storage, plan, self._shelf) as blob:
            parts = [_kept(piece) for piece in blob.pieces(self.chunk_size)]
            got = sum(len(part) for part in parts)
            if got != plan.entry.payload_bytes:
                raise Damaged(f"entry {plan.entry.name!r}: {got} bytes read of a payload of "
                              f"{plan.entry.payload_bytes} bytes")
        batch.add(name, parts, got)

    def _entry(self, plan: Plan) -> Iterator[bytes]:
        with VerifiedBlob(self.storage, plan, self._shelf) as blob:
            if plan.prefix is None:
                yield from blob.messages(self.chunk_size)
                return
            # Each block is checked as it is read, before any of its bytes reach a message.
            yield from _messages(plan.entry.name, blob.pieces(self.chunk_size), self.chunk_size)


def _kept(piece: memoryview) -> memoryview | bytes:
    """``piece`` when it views a ``bytes`` (which no one changes or frees), else its bytes: a
    view of a map would not outlive its blob, closed before the batch is sent."""
    return piece if isinstance(piece.obj, bytes) else bytes(piece)


def _messages(name: str, pieces: Iterable[memoryview], chunk_size: int) -> Iterator[bytes]:
    """Messages of exactly ``chunk_size`` payload bytes (the last shorter), the first naming the entry."""
    first = True
    for parts in split_parts(pieces, chunk_size):
        yield encode_fetch_response(name if first else None, parts)
        first = False
    if first:  # no bytes at all: the entry is still announced
        yield encode_fetch_response(name, [])
