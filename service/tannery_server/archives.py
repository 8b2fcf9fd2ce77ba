"""The ``Archives`` service: one method per RPC of ``archives.proto``.

Blocking work (files, SQLite) runs on the storage's thread pool, so many calls proceed at
once. Every failure is a :class:`~.failures.Failure` turned into its status here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from tannery_protocol.datalink import TICKET_KEY
from tannery_protocol.v1 import archives_pb2, archives_pb2_grpc

from .calllog import current_call
from .config import Config
from .failures import Cancelled, DeadlineExceeded, Malformed, Missing
from . import data_paths as data_path_listeners
from .data_paths import DataPathOff, requested_transport
from .data_transfer import LINK_ERRORS, fail, link_failure, receive_store, send_fetch
from .fetching import FetchStream, check_request, digests, resolve
from .handling import add_service, answering_failures
from .storage import ArchiveLimits, ArchiveRecord, Storage
from .store_session import StoreSession
from .validation import check_archive_name, check_metadata, check_prefix
from tannery_protocol.wire import parse_store_request, serialize_response

T = TypeVar("T")
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: Bytes of messages a Fetch prepares per trip to a worker thread (one more batch is read ahead).
FETCH_BATCH_BYTES = 4 << 20


def archive_info(record: ArchiveRecord) -> archives_pb2.ArchiveInfo:
    created = Timestamp()
    created.FromNanoseconds(record.created_ns)
    return archives_pb2.ArchiveInfo(
        name=record.name, entries=record.entries, nbytes=record.nbytes, payload_bytes=record.payload_bytes,
        created=created, already_stored=record.already_stored,
    )


def written(record: ArchiveRecord) -> archives_pb2.ArchiveInfo:
    """The answer of a Store or Union; the call's log line says when it found the archive
    already holding exactly its content (and stored nothing)."""
    if record.already_stored:
        current_call().note("already_stored", True)
    return archive_info(record)


class ArchivesServicer(archives_pb2_grpc.ArchivesServicer):
    def __init__(self, storage: Storage, config: Config, data_paths: data_path_listeners.DataPaths | None = None) -> None:
        self.storage = storage
        self.config = config
        self.data_paths = data_paths
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tannery-io")
        self._limits = ArchiveLimits(config.max_entries, config.max_name_bytes)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run_future(fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def failure_of(self, exc: BaseException) -> BaseException:
        """Storage errors as the server's failures (what :func:`~.handling.answering_failures` asks)."""
        return self.storage.failure_of(exc)

    def _archive_name(self, name: str) -> str:
        current_call().note("archive", name)
        return check_archive_name(name, self.config.max_name_bytes)

    @answering_failures
    async def Store(self, request_iterator: AsyncIterator, context) -> archives_pb2.ArchiveInfo:
        first = await anext(aiter(request_iterator), None)
        if first is None:  # a client cancelled before its first message, or one that sent none
            await _cancellation_known(context)
            _check_alive(context)
        if first is None or first.begin is None:
            raise Malformed("the first message of Store must carry begin (the archive name)")
        name = self._archive_name(first.begin.archive)
        metadata = check_metadata(first.begin.metadata)
        session = StoreSession(self.storage, self.config, name, first.begin.replace, metadata)
        pending: asyncio.Future | None = None
        transport = self._transport(context)
        try:
            await self._run(session.check_existing)
            # Each message is written by a worker thread while the next one is received.
            # Shielded: a cancelled call must not abandon a thread still writing the session.
            pending = self._run_future(session.feed, first, True)
            if transport is not None:
                # The payloads come on the data connection; the call brings begin and commit.
                await asyncio.shield(pending)
                await self._over_data_path(transport, context, receive_store, session)
                current_call().note("data_bytes", session.bytes_received)
            messages = aiter(request_iterator)
            # Compared with an archive there, any message may be refused: say so at once.
            watch = session.existing is not None
            while (message := await _next_request(messages, pending, watch)) is not None:
                await asyncio.shield(pending)
                pending = self._run_future(session.feed, message)
            await asyncio.shield(pending)
            # grpc.aio ends the requests of a cancelled call as if the client were done, and
            # says it was cancelled only a moment later.
            if not session.committed:
                await _cancellation_known(context)
            await _cancellation_landed(context)
            _check_alive(context)
            pending = self._run_future(session.finish)
            record = await asyncio.shield(pending)
        except BaseException:
            await asyncio.shield(self._abort_store(session, pending))
            if session.stored:  # cancelled after the client's half-close, while the commit ran
                current_call().note("stored", "yes")
            raise
        return written(record)

    async def _abort_store(self, session: StoreSession, pending: asyncio.Future | None) -> None:
        """Wait for the thread writing the session (it must be done with it), then remove what it wrote."""
        await _settle(pending)
        await self._run(session.abort)

    def _run_future(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        try:
            return loop.run_in_executor(self._executor, fn, *args)
        except RuntimeError:
            # Closed: a call cancelled at shutdown still releases its pins and files (on the
            # loop's default threads) after the pool stopped taking work.
            return loop.run_in_executor(None, fn, *args)

    @answering_failures
    async def Union(self, request: archives_pb2.UnionRequest, context) -> archives_pb2.ArchiveInfo:
        target = self._archive_name(request.target)
        sources = []
        for source in request.sources:
            check_archive_name(source.archive, self.config.max_name_bytes)
            sources.append((source.archive, check_prefix(source.prefix, self.config.max_name_bytes)))
        metadata = check_metadata(request.metadata)
        record = await self._run(self.storage.union, target, sources, request.replace, self._limits, metadata)
        return written(record)

    def _transport(self, context) -> str | None:
        """The data path a Store or Fetch asks for (None: the gRPC stream); DataPathOff when it is off."""
        transport = requested_transport(context)
        if transport is not None:
            current_call().note("transport", transport)
            if self.data_paths is None:
                raise DataPathOff(f"this server offers no {transport} data path: ask for transport 'grpc'")
            self.data_paths.require(transport)
        return transport

    async def _over_data_path(self, transport: str, context, move: Callable[..., Any], *args: Any) -> Any:
        """Give the call a ticket, wait for its data connection, run ``move(link, *args)`` on a
        worker thread. A cancelled call breaks the connection and waits for the thread."""
        assert self.data_paths is not None
        ticket = self.data_paths.ticket(transport)
        try:
            await context.send_initial_metadata(((TICKET_KEY, ticket.hex),))
            link = await ticket.connection()
        finally:
            ticket.withdraw()
        job = self._run_future(move, link, *args)
        try:
            return await asyncio.shield(job)
        except BaseException as exc:
            if isinstance(exc, LINK_ERRORS):  # the connection's, not the storage's: no "storage error"
                failure: BaseException = link_failure(transport, exc)
            else:
                failure = exc if not isinstance(exc, asyncio.CancelledError) else Cancelled("the call was cancelled")
            fail(link, failure)
            await _settle(job)
            # The transfer's frames hold its buffers (mapped memory files, receive windows):
            # let them go now, not when gRPC drops the aborted call (a dead client's, later).
            traceback.clear_frames(exc.__traceback__)
            if isinstance(exc, LINK_ERRORS):
                raise failure from None
            raise
        finally:
            link.close()

    @answering_failures
    async def DataPaths(self, request: archives_pb2.DataPathsRequest, context) -> archives_pb2.DataPathsResponse:
        paths = self.data_paths
        if paths is None:
            return archives_pb2.DataPathsResponse(wants_digests=self.storage.blobs.wants_digests)
        return archives_pb2.DataPathsResponse(socket_path=str(paths.socket_path or ""), data_port=paths.data_port,
                                              data_tls=paths.tls, server_id=paths.server_id,
                                              wants_digests=self.storage.blobs.wants_digests)

    @answering_failures
    async def Fetch(self, request: archives_pb2.FetchRequest, context) -> None:
        current_call().note("archive", request.archive)
        check_request(request)
        transport = self._transport(context)
        if transport is not None:
            plans = await self._run(resolve, self.storage, request)
            try:
                sent = await self._over_data_path(transport, context, send_fetch, self.storage, plans)
                current_call().note("data_bytes", sent)
            finally:
                await asyncio.shield(self._run(self.storage.release, digests(plans)))
            return
        # One trip resolves the request and reads the first batch; a fetch that fits in it
        # is over (blobs closed, pins released) when the trip returns.
        opening = self._run_future(FetchStream.open, self.storage, request, self.config.chunk_size,
                                   FETCH_BATCH_BYTES)
        try:
            stream, batch = await asyncio.shield(opening)
        except asyncio.CancelledError:
            await asyncio.shield(self._close_opening(opening))
            raise
        ahead: asyncio.Future | None = None
        try:
            while True:
                # The next batch is read while this one is sent.
                ahead = None if stream.done else self._run_future(stream.next_batch, FETCH_BATCH_BYTES)
                for message in batch:
                    await _write(context, message)
                if ahead is None:
                    return
                # Shielded: a cancelled call must not close the stream under the thread reading it.
                batch = await asyncio.shield(ahead)
        finally:
            if not stream.done or ahead is not None:
                await asyncio.shield(self._close_fetch(stream, ahead))

    async def _close_opening(self, opening: asyncio.Future) -> None:
        """Close the stream a cancelled Fetch was opening, once the thread has opened it."""
        await _settle(opening)
        if not opening.cancelled() and opening.exception() is None:
            stream, _ = opening.result()
            if not stream.done:
                await self._run(stream.close)

    async def _close_fetch(self, stream: FetchStream, ahead: asyncio.Future | None) -> None:
        """Wait for the thread reading ahead, then close the stream (its blobs and pins) if it is not over."""
        await _settle(ahead)
        if not stream.done:  # cancelled or failed midway: close it on a worker thread
            await self._run(stream.close)

    @answering_failures
    async def Describe(self, request: archives_pb2.DescribeRequest, context) -> archives_pb2.ArchiveDescription:
        current_call().note("archive", request.archive)

        def read():
            record = self.storage.catalog.archive(request.archive)
            if record is None:
                raise Missing(f"archive {request.archive!r} not found")
            return record, self.storage.catalog.entries_under(request.archive, "")

        record, entries = await self._run(read)
        return archives_pb2.ArchiveDescription(
            info=archive_info(record),
            metadata=record.metadata,
            entries=[
                archives_pb2.EntryInfo(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes,
                                       payload_bytes=e.payload_bytes, digest=e.digest)
                for e in entries
            ],
        )

    @answering_failures
    async def List(self, request: archives_pb2.ListRequest, context) -> archives_pb2.ListResponse:
        limit = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        after = _decode_token(request.page_token)
        records = await self._run(self.storage.catalog.list_archives, request.prefix, after, limit + 1)
        more = len(records) > limit
        records = records[:limit]
        token = _encode_token(records[-1].name) if more else ""
        return archives_pb2.ListResponse(archives=[archive_info(r) for r in records], next_page_token=token)

    @answering_failures
    async def Delete(self, request: archives_pb2.DeleteRequest, context) -> archives_pb2.DeleteResponse:
        current_call().note("archive", request.archive)
        record, collected = await self._run(self.storage.delete, request.archive)
        if record is None:
            raise Missing(f"archive {request.archive!r} not found")
        return archives_pb2.DeleteResponse(
            deleted=archive_info(record), blobs_removed=collected.blobs, bytes_freed=collected.bytes
        )


async def _next_request(messages: AsyncIterator, pending: asyncio.Future, watch: bool) -> Any:
    """The call's next request (None at its end), received while a worker thread feeds the one
    before (``pending``). With ``watch``, a refusal of that one is raised as soon as it comes,
    without waiting for the next request (a client whose entry is refused at its name or its
    digest hears it before it sends the payload)."""
    if not watch or pending.done():
        return await anext(messages, None)
    receiving = asyncio.ensure_future(anext(messages, None))
    try:
        await asyncio.wait((receiving, pending), return_when=asyncio.FIRST_COMPLETED)
        if not receiving.done() and not pending.cancelled() and pending.exception() is not None:
            raise pending.exception()
        return await receiving
    finally:
        if not receiving.done():
            receiving.cancel()


async def _settle(future: asyncio.Future | None) -> None:
    """Wait until a worker thread's ``future`` is over, its failure taken (the call's own
    failure, or its cancellation, is what the client hears about)."""
    if future is None:
        return
    if not future.done():
        await asyncio.wait([future])
    if not future.cancelled():
        future.exception()


async def _write(context: grpc.aio.ServicerContext, message: Any) -> None:
    """Send one response message; CancelledError when the client has gone (grpc.aio would log
    a traceback for the failed write of a yielded message)."""
    try:
        await context.write(message)
    except grpc.aio.InternalError:
        raise asyncio.CancelledError() from None


async def _cancellation_known(context: grpc.aio.ServicerContext, wait: float = 0.25) -> None:
    """Give a call whose requests ended without ``commit`` a moment to show it was cancelled (no
    client that completed ends so, so only a broken client waits): it is then answered and
    logged CANCELLED, not INVALID_ARGUMENT."""
    deadline = asyncio.get_running_loop().time() + wait
    while not context.cancelled() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


async def _cancellation_landed(context: grpc.aio.ServicerContext) -> None:
    """Make a cancellation that ended the requests raise CancelledError here, before a commit.

    grpc.aio ends the requests of a cancelled call (or of a client that went away) exactly as
    a client's half-close ends them, and cancels the handler from a second event of gRPC's
    core, which may reach the event loop after the first. One more read goes through the core
    and back (it answers at once: no message follows the end) behind that event, and the
    yield after it lets the cancellation land. A Store whose client cancelled with its
    request stream still open thus stores nothing, even when its ``commit`` had arrived.
    """
    await context.read()
    await asyncio.sleep(0)


def _check_alive(context: grpc.aio.ServicerContext) -> None:
    """Cancelled or DeadlineExceeded when the call is over for its client."""
    if context.cancelled():
        raise Cancelled("the call was cancelled before it was done: nothing was stored")
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it was done: nothing was stored")


def _encode_token(last_name: str) -> str:
    return base64.urlsafe_b64encode(b"v1:" + last_name.encode()).decode()


def _decode_token(token: str) -> str:
    if not token:
        return ""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if raw.startswith(b"v1:"):
            return raw[3:].decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise Malformed(f"page_token {token[:40]!r} is not one this server gave")


#: Hand-written (de)serializers of the hot messages: Store's requests and Fetch's responses are
#: read and written without copying tensor bytes (tannery_protocol.wire).
_HAND_WRITTEN = {"Store": {"request_deserializer": parse_store_request},
                 "Fetch": {"response_serializer": serialize_response}}


def add_to_server(servicer: ArchivesServicer, server: grpc.aio.Server) -> None:
    """Register every RPC of ``archives.proto``, reading Store requests and writing Fetch responses without copies."""
    add_service(server, servicer, archives_pb2, "Archives", _HAND_WRITTEN)
