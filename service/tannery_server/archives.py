"""The ``Archives`` service: one method per RPC of ``archives.proto``.

Blocking work (files, SQLite) runs on the storage's thread pool, so many calls proceed at
once. Every failure is a :class:`~.failures.Failure` turned into its status here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable

import grpc

from tannery_protocol.v1 import archives_pb2, archives_pb2_grpc

from .archive_info import alias_info, archive_info, move_info, written
from .calllog import current_call
from .auth import Tokens, mover
from .config import Config
from .failures import Cancelled, DeadlineExceeded, Malformed, Missing
from .dataplane.fetch import serve_fetch
from .dataplane import listeners
from .dataplane.plane import DataPlane
from .dataplane.store import SessionSteps, receive_store
from .derive import DeriveSession
from .diffing import diff_archives
from .fetching import check_request
from .handling import Undecodable, add_service, answering_failures
from .paging import ALIAS_PAGE, after_alias, after_name, alias_token, name_token, page_limit
from .storage import AliasPage, AliasRecord, ArchiveLimits, ArchiveRecord, MoveNote, Storage
from .storage import lost_marks
from .storage_failures import failure_of
from .published_store import PublishedStore
from .store_session import StoreSession
from .validation import check_archive_name, check_metadata, check_prefix
from .watching import add_watch
from .workers import Workers
from tannery_protocol.wire import RECEIVED_KEY, parse_store_request, serialize_response

log = logging.getLogger("tannery_server.archives")

#: Aliases a Delete's answer names at most (it counts them all): no answer grows without a bound.
MAX_NAMED_ALIASES = 1000


class ArchivesServicer(archives_pb2_grpc.ArchivesServicer):
    def __init__(self, storage: Storage, config: Config, data_paths: listeners.DataPaths | None = None,
                 tokens: Tokens = Tokens()) -> None:
        self.storage = storage
        self.config = config
        #: The tokens calls come with: who moved an alias, in its history.
        self.tokens = tokens
        self.data_paths = data_paths
        self.workers = Workers(config.io_threads, "tannery-io")
        #: Where the bytes of Store and Fetch move, whatever the transport.
        self.plane = DataPlane(data_paths, self.workers, failure_of=self.failure_of)
        self._run = self.workers.run
        self._limits = ArchiveLimits(config.max_entries, config.max_name_bytes)
        #: The aliases watched (Watch), one catalog reader each; closed as the server stops.
        self.watches = add_watch(self)

    def close(self) -> None:
        self.workers.close()

    def failure_of(self, exc: BaseException) -> BaseException:
        """Storage errors and refusals as the server's failures (what :func:`~.handling.answering_failures` asks)."""
        return failure_of(exc, self.storage)

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
        steps = SessionSteps(self.workers, session)
        received = receive_store(self.plane, steps, first, request_iterator, context)
        return written(await _committed(steps, session, received, context, f"Store of {name!r}"))

    def published_store(self, store_as: Any) -> PublishedStore:
        """The store of a Publish that asks for one (``PublishRequest.store_as``): its payloads
        stored as archive ``store_as.archive`` as they are relayed (Malformed for a bad name or
        metadata, before any payload)."""
        name = self._archive_name(store_as.archive)
        session = StoreSession(self.storage, self.config, name, store_as.replace, check_metadata(store_as.metadata))
        return PublishedStore(session, self.workers, list(store_as.entries), self.failure_of)

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

    @answering_failures
    async def Derive(self, request_iterator: AsyncIterator, context) -> archives_pb2.ArchiveInfo:
        """An archive built from a base and per-entry changes (:mod:`.derive`), committed as a Store is."""
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            await _cancellation_known(context)
            _check_alive(context)
            raise Malformed("Derive sent no message: the first carries begin (the archive and its base)")
        first = _decoded(first)
        if not first.HasField("begin"):
            raise Malformed("the first message of Derive must carry begin (the archive and its base)")
        name = self._archive_name(first.begin.archive)
        base = check_archive_name(first.begin.base, self.config.max_name_bytes)
        current_call().note("base", base)
        derive = DeriveSession(self.storage, self.config, name, base, first.begin.replace,
                               check_metadata(first.begin.metadata))
        steps = SessionSteps(self.workers, derive)  # type: ignore[arg-type]  # a session's steps, as Store's

        async def received() -> None:
            await steps.run(derive.begin)
            await steps.run(derive.message, first, True)
            async for message in requests:
                await steps.run(derive.message, _decoded(message), False)

        return written(await _committed(steps, derive, received(), context, f"Derive of {name!r}"))

    @answering_failures
    async def DataPaths(self, request: archives_pb2.DataPathsRequest, context) -> archives_pb2.DataPathsResponse:
        paths = self.data_paths
        wants, batched = self.storage.blobs.wants_digests, self.config.batched_entries
        if paths is None:
            return archives_pb2.DataPathsResponse(wants_digests=wants, batched_entries=batched)
        return archives_pb2.DataPathsResponse(socket_path=str(paths.socket_path or ""), data_port=paths.data_port,
                                              data_tls=paths.tls, server_id=paths.server_id,
                                              wants_digests=wants, batched_entries=batched)

    @answering_failures
    async def Fetch(self, request: archives_pb2.FetchRequest, context) -> None:
        current_call().note("archive", request.archive)
        check_request(request)
        await serve_fetch(self.plane, self.storage, request, context, self.config.chunk_size,
                          batched=request.batched_entries and self.config.batched_entries)

    @answering_failures
    async def Describe(self, request: archives_pb2.DescribeRequest, context) -> archives_pb2.ArchiveDescription:
        current_call().note("archive", request.archive)
        if request.names and request.no_entries:
            raise Malformed(f"Describe of {request.archive!r}: names ({len(request.names)}) and no_entries ask for "
                            "some entries and for none: give one of them")
        catalog = self.storage.catalog

        def read():
            # One snapshot: the info and the entries are of one version, whatever replaces it meanwhile.
            found = catalog.read_archive(request.archive, list(request.names) if request.names else None,
                                         entries=not request.no_entries)
            if found is None:
                raise Missing(f"archive {request.archive!r} not found")
            return found.record, found.entries, lost_marks.lost_entries(catalog, found.record.name)

        record, entries, lost = await self._run(read)
        current_call().note("described", len(entries))
        return archives_pb2.ArchiveDescription(
            info=archive_info(record),
            metadata=record.metadata,
            entries=[
                archives_pb2.EntryInfo(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes,
                                       payload_bytes=e.payload_bytes, digest=e.digest)
                for e in entries
            ],
            lost_entries=lost,
        )

    @answering_failures
    async def List(self, request: archives_pb2.ListRequest, context) -> archives_pb2.ListResponse:
        limit = page_limit(request.page_size)
        after = after_name(request.page_token)
        records = await self._run(self.storage.catalog.list_archives, request.prefix, after, limit + 1)
        more = len(records) > limit
        records = records[:limit]
        token = name_token(records[-1].name) if more else ""
        return archives_pb2.ListResponse(archives=[archive_info(r) for r in records], next_page_token=token)

    @answering_failures
    async def Delete(self, request: archives_pb2.DeleteRequest, context) -> archives_pb2.DeleteResponse:
        current_call().note("archive", request.archive)
        # Before anything is deleted: a retry after a lost answer may then say the archive is
        # already gone (an attempt that broke off before this reached nothing).
        await context.send_initial_metadata(((RECEIVED_KEY, "delete"),))
        record, collected = await self._run(self.storage.delete, request.archive, request.force,
                                            self._move_note(context))
        if record is None:
            alias = await self._run(self.storage.catalog.alias, request.archive)
            if alias is not None:
                raise Missing(f"archive {request.archive!r} not found: it is an alias (of {alias.archive!r}); "
                              f"remove the alias with tannery untag {request.archive}, or delete {alias.archive!r}")
            raise Missing(f"archive {request.archive!r} not found")
        for alias in record.untagged:
            self.watches.moved(alias)
        return archives_pb2.DeleteResponse(
            deleted=archive_info(record), blobs_removed=collected.blobs, bytes_freed=collected.bytes,
            aliases_removed=record.untagged[:MAX_NAMED_ALIASES], aliases_removed_count=len(record.untagged),
        )

    @answering_failures
    async def Diff(self, request: archives_pb2.DiffRequest, context) -> archives_pb2.DiffResponse:
        """How archive b differs from a (:mod:`.diffing`), read on a worker thread that stops at
        its next window once the call is cancelled or past its deadline."""
        current_call().note("archive", request.a)
        current_call().note("other", request.b)
        for name in (request.a, request.b):
            check_archive_name(name, self.config.max_name_bytes)
        if request.prefix:
            check_prefix(request.prefix, self.config.max_name_bytes)
        answer = await self._run(diff_archives, self.storage, request, lambda: _still_wanted(context, "Diff"))
        current_call().note("bytes_read", answer.summary.bytes_read)
        return answer

    # Aliases ----------------------------------------------------------------------------

    @answering_failures
    async def Tag(self, request: archives_pb2.TagRequest, context) -> archives_pb2.TagResponse:
        alias = self._alias_name(request.alias)
        archive = check_archive_name(request.archive, self.config.max_name_bytes)
        expect = request.expect if request.HasField("expect") else None
        if expect:
            check_archive_name(expect, self.config.max_name_bytes)
        record = await self._run(self.storage.tag, alias, archive, expect, self._move_note(context))
        current_call().note("tagged", record.archive if record.changed else "unchanged")
        if record.changed:
            self.watches.moved(alias)
        return archives_pb2.TagResponse(alias=alias_info(record), previous=record.previous, changed=record.changed)

    @answering_failures
    async def Untag(self, request: archives_pb2.UntagRequest, context) -> archives_pb2.UntagResponse:
        alias = self._alias_name(request.alias)
        record = await self._run(self.storage.untag, alias, self._move_note(context))
        if record is None:
            there = await self._run(self.storage.catalog.archive, alias)
            hint = ": it is an archive (tannery rm deletes archives)" if there is not None else ""
            raise Missing(f"alias {alias!r} not found{hint}")
        self.watches.moved(alias)
        return archives_pb2.UntagResponse(removed=alias_info(record))

    @answering_failures
    async def Resolve(self, request: archives_pb2.ResolveRequest, context) -> archives_pb2.ResolveResponse:
        name = self._alias_name(request.name)

        def read() -> tuple[ArchiveRecord | None, AliasRecord | None]:
            record = self.storage.catalog.lookup(name)
            alias = None if record is None or record.name == name else self.storage.catalog.alias(name)
            return record, alias

        record, alias = await self._run(read)
        if record is None:
            raise Missing(f"no archive or alias {name!r}")
        answer = archives_pb2.ResolveResponse(archive=record.name)
        if alias is not None and alias.archive == record.name:  # (moved again between the two reads: no alias info)
            answer.alias.CopyFrom(alias_info(alias))
        return answer

    @answering_failures
    async def ListAliases(self, request: archives_pb2.ListAliasesRequest, context) -> archives_pb2.ListAliasesResponse:
        limit = page_limit(request.page_size, ALIAS_PAGE, ALIAS_PAGE)
        page = AliasPage(archive_prefix=request.archive_prefix, after=after_alias(request.page_token), limit=limit + 1)
        records = await self._run(self.storage.catalog.aliases, request.prefix, request.archive, page)
        more = len(records) > limit
        records = records[:limit]
        token = alias_token(records[-1].archive, records[-1].alias) if more else ""
        return archives_pb2.ListAliasesResponse(aliases=[alias_info(r) for r in records], next_page_token=token)

    @answering_failures
    async def Watch(self, request: archives_pb2.WatchRequest, context) -> None:
        alias = self._alias_name(request.alias)
        if await self._run(self.storage.catalog.alias, alias) is None:
            there = await self._run(self.storage.catalog.archive, alias)
            if there is not None:
                raise Missing(f"alias {alias!r} not found: it is an archive's name, and an archive never moves "
                              "(watch an alias: tannery tag ALIAS ARCHIVE makes one)")
        await self.watches.serve(alias, context, self.failure_of)

    @answering_failures
    async def History(self, request: archives_pb2.HistoryRequest, context) -> archives_pb2.HistoryResponse:
        alias = self._alias_name(request.alias)
        moves = await self._run(self.storage.catalog.history, alias, request.limit or self.config.alias_history)
        if not moves and await self._run(self.storage.catalog.alias, alias) is None:
            there = await self._run(self.storage.catalog.archive, alias)
            hint = (": it is an archive's name, and an archive never moves" if there is not None
                    else ": tannery tag ALIAS ARCHIVE makes one, and records its moves from then on")
            raise Missing(f"alias {alias!r} not found, and no move of it is recorded{hint}")
        return archives_pb2.HistoryResponse(moves=[move_info(m) for m in moves])

    def _move_note(self, context: grpc.aio.ServicerContext) -> MoveNote:
        """What a call that moves aliases records in their history: who it is, and how many moves are kept."""
        return MoveNote(mover(self.tokens, context.invocation_metadata()), self.config.alias_history)

    def _alias_name(self, name: str) -> str:
        current_call().note("alias", name)
        return check_archive_name(name, self.config.max_name_bytes)


async def _committed(steps: SessionSteps, session: Any, received: Awaitable[None], context, call: str) -> Any:
    """The record a Store-like ``session`` commits once ``received`` has taken every message, or,
    on any failure (a cancellation included), what it wrote removed and the failure raised."""
    try:
        await received
        # grpc.aio ends the requests of a cancelled call as if the client were done, and
        # says it was cancelled only a moment later.
        if not session.committed:
            await _cancellation_known(context)
        await _cancellation_landed(context)
        _check_alive(context)
        return await steps.run(session.finish)
    except BaseException:
        try:
            await asyncio.shield(steps.abort())
        except Exception:  # the call's own failure is what the client hears about
            log.exception("%s: removing what the call wrote failed", call)
        if session.stored:  # cancelled after the client's half-close, while the commit ran
            current_call().note("stored", "yes")
        raise


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
    try:
        await context.read()
    except Exception:  # the server is stopping (grpc.aio refuses the read): the call is over
        raise Cancelled("the server stopped before the Store was done: nothing was stored") from None
    await asyncio.sleep(0)


def _decoded(message):
    """A streamed request, refused (INVALID_ARGUMENT) when its bytes were not a valid message."""
    if isinstance(message, Undecodable):
        raise message.failure("a Derive request")
    return message


def _check_alive(context: grpc.aio.ServicerContext) -> None:
    """Cancelled or DeadlineExceeded when the call is over for its client."""
    if context.cancelled():
        raise Cancelled("the call was cancelled before it was done: nothing was stored")
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it was done: nothing was stored")


def _still_wanted(context: grpc.aio.ServicerContext, call: str) -> None:
    """Cancelled or DeadlineExceeded once a read-only call's client no longer waits for it (what a
    long read checks between its steps, from its worker thread)."""
    if context.cancelled():
        raise Cancelled(f"the {call} was cancelled before it was done")
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded(f"the {call}'s deadline passed before it was done: ask again with a longer timeout")


#: Hand-written (de)serializers of the hot messages: Store's requests and Fetch's responses are
#: read and written without copying tensor bytes (tannery_protocol.wire).
_HAND_WRITTEN = {"Store": {"request_deserializer": parse_store_request},
                 "Fetch": {"response_serializer": serialize_response}}


def add_to_server(servicer: ArchivesServicer, server: grpc.aio.Server) -> None:
    """Register every RPC of ``archives.proto``, reading Store requests and writing Fetch responses without copies."""
    add_service(server, servicer, archives_pb2, "Archives", _HAND_WRITTEN)
