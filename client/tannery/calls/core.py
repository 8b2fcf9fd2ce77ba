"""The call core: what ``tannery.Client`` and ``tannery.aio.Client`` do, written once.

:class:`CallCore` is the base of both clients. Each call is a generator of steps
(:mod:`tannery.rpc.waits`): which transport Store, Fetch, Publish and Subscribe take (asked of
the server once, chosen once, forgotten after a retry), the requests built
(:mod:`tannery.rpc.requests`), the status of a failed call turned into a tannery exception
(:func:`tannery.rpc.connection.rpc_error`), and what to do after an UNAVAILABLE
(:mod:`tannery.rpc.retries`: wait and try again, a Fetch resumed after its whole entries, a
Delete whose answer was lost reported ``already_gone``). The bytes move on the chosen
:class:`~tannery.dataplane.transports.Transport`. A client drives these steps, blocking
(:mod:`tannery.client`) or awaiting (:mod:`tannery.aio`); that is all it adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from tannery_protocol import errors
from tannery_protocol._lazy import lazy_module
from tannery.rpc.connection import Calls, Connection, TLSLike, check_transport, received, rpc_error
from tannery.records import (
    Alias, ArchiveDescription, ArchiveInfo, Deleted, Pruned, Published, Tagged, Untagged, is_kept_entry, values_prefix,
)
from tannery.rpc.requests import (LARGEST_PAGE, Methods, Progress, aliases_request, describe_request, list_request,
                                  union_request)
from tannery.rpc.retries import RetryPolicy, call_name, resumed_request
from tannery.rpc.waits import Acquire, Blocking, Rpc, Send, Sleep, Steps
from tannery_protocol.v1 import archives_pb2

if TYPE_CHECKING:
    import torch

    from tannery.calls.diff import ArchiveDiff
    from tannery.calls.history import AliasMove
    from tannery.calls.watches import Watched
    from tannery.dataplane.transports import Feed, Transport
    from tannery.dataplane.memory_files import MemoryFiles
    from tannery_protocol.v1 import channels_pb2

# Imported on first use: catalog calls (tannery ls, show, rm) need none of these.
_archive_files = lazy_module("tannery.calls.archive_files")
_archive_values = lazy_module("tannery.calls.archive_values")
_derives = lazy_module("tannery.calls.derive")
_diffs = lazy_module("tannery.calls.diff")
_histories = lazy_module("tannery.calls.history")
_readers = lazy_module("tannery.dataplane.readers")
_state_dict = lazy_module("tannery.calls.state_dict")
_transports = lazy_module("tannery.dataplane.transports")  # with tannery_protocol.datalink: sockets, ssl
_messages = lazy_module("tannery.dataplane.messages")
_retention = lazy_module("tannery.calls.retention")
_watches = lazy_module("tannery.calls.watches")


class CallCore:
    """The state and the calls of a client; subclasses open the channel, make the lock and wait."""

    #: How ``repr`` names the client.
    _NAME = "tannery.Client"

    def __init__(self, target: str | None = None, *, token: str | None = None, tls: TLSLike = None,
                 chunk_size: int | None = None, timeout: float | None = None, transport: str | None = None,
                 retries: int | RetryPolicy | None = None) -> None:
        self._transport = check_transport(transport)
        self._retries = RetryPolicy.resolve(retries)
        self._connection = Connection(target, token=token, tls=tls, chunk_size=chunk_size, timeout=timeout)
        self._channel = self._open(self._connection)
        self._methods = Methods(self._channel)
        self._calls = Calls(self._connection, self._methods)
        self._offered: archives_pb2.DataPathsResponse | None = None
        self._offered_known = False
        self._chosen: Transport | None = None  # None: not chosen yet, or forgotten after a retry
        self._lock = self._new_lock()

    def _open(self, connection: Connection) -> Any:
        raise NotImplementedError

    def _new_lock(self) -> Any:
        raise NotImplementedError

    @property
    def target(self) -> str:
        return self._connection.target

    def __repr__(self) -> str:
        return f"{self._NAME}({self._connection!r})"

    # -- the data plane ------------------------------------------------------------------

    def _offered_paths(self) -> Steps[archives_pb2.DataPathsResponse | None]:
        """What the server offers beside gRPC (its data paths, whether it wants digests), asked
        once; None from a server from before data paths."""
        if self._offered_known:
            return self._offered
        yield Acquire(self._lock)
        try:
            if not self._offered_known:
                try:
                    self._offered = yield Rpc(self._methods.data_paths, archives_pb2.DataPathsRequest(),
                                              **self._calls.options())
                    self._retries.contact.reached = True
                except grpc.RpcError as error:
                    if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
                        raise rpc_error(error, self.target) from None
                self._offered_known = True
            return self._offered
        finally:
            self._lock.release()

    def _transport_now(self) -> Steps[Transport]:
        """The transport of this client's Store, Fetch, Publish and Subscribe, chosen once
        (:func:`tannery.dataplane.transports.choose`)."""
        if self._transport == "grpc":
            return _transports.GRPC
        if self._chosen is not None:
            return self._chosen
        offered = yield from self._offered_paths()
        yield Acquire(self._lock)
        try:
            if self._chosen is None:
                self._chosen = yield Blocking(_transports.choose, self._transport, offered, self.target,
                                              self._connection.tls)
            return self._chosen
        finally:
            self._lock.release()

    def _transport_kind(self) -> Steps[str]:
        return (yield from self._transport_now()).kind

    def _digests_wanted(self) -> Steps[bool]:
        """Whether Store sends each payload's SHA-256 ahead (the server said it spares it a
        copy); False when the server cannot be asked (the digests only save it work)."""
        try:
            offered = yield from self._offered_paths()
        except errors.ServiceError:
            return False
        return offered is not None and offered.wants_digests

    def _wants_digests(self) -> Any:
        """:meth:`_digests_wanted`, waited as the client waits (a hook: tests answer it)."""
        raise NotImplementedError

    def _batches_stores(self) -> Steps[bool]:
        """Whether Store may send small entries several to a message (``StoreRequest.entries``):
        only to a server that said it reads them. An older server would ignore the field and
        store an archive without those entries; one that cannot be asked gets one per message."""
        try:
            offered = yield from self._offered_paths()
        except errors.ServiceError:
            return False
        return offered is not None and offered.batched_entries

    # -- retries -------------------------------------------------------------------------

    def _retrying(self, what: str, attempt: Callable[[int], Steps[Any]]) -> Steps[Any]:
        """``attempt(retry)`` until it succeeds, tried again as :attr:`_retries` says after an
        UNAVAILABLE (``retry`` counts the attempts before it); the last error otherwise."""
        retry = 0
        while True:
            try:
                done = yield from attempt(retry)
                self._retries.contact.reached = True
                return done
            except errors.ServiceError as error:
                pause = self._retries.next_delay(retry, what, error)
            retry += 1
            yield from self._forget(pause)

    def _forget(self, pause: float) -> Steps[None]:
        """Wait, then forget what the server offered: a restarted one may offer other data paths."""
        yield Sleep(pause)
        yield Acquire(self._lock)
        try:
            self._offered_known, self._chosen = False, None
        finally:
            self._lock.release()

    def _unary(self, method: Any, request: Any) -> Steps[Any]:
        return self._retrying(call_name(request), lambda retry: self._unary_once(method, request))

    def _unary_once(self, method: Any, request: Any) -> Steps[Any]:
        try:
            answer = yield Rpc(method, request, **self._calls.options())
        except grpc.RpcError as error:
            failure = rpc_error(error, self.target)
            failure.reached = received(error)  # type: ignore[attr-defined]
            raise failure from None
        self._retries.contact.reached = True
        return answer

    # -- archives ------------------------------------------------------------------------

    def _store(self, name: str, value: Any, prefix: str, replace: bool, progress: Progress,
               metadata: Mapping[str, str] | None, skip_non_tensors: bool, allow_empty: bool,
               files: Mapping[str, bytes] | None = None) -> Steps[ArchiveInfo]:
        archive, rest = _messages.archive_to_store(name, value, prefix, skip_non_tensors=skip_non_tensors,
                                         allow_empty=allow_empty or bool(files))
        where = f"Client.store({name!r})"
        _archive_files.refuse_file_names(archive, where)
        _archive_values.refuse_values_names(archive, where)
        archive = _archive_values.with_values(archive, where)
        if files:
            archive = _archive_files.with_files(archive, rest, prefix, _archive_files.check_files(files, where))

        def attempt(retry: int) -> Steps[ArchiveInfo]:  # the whole archive, sent again from its start
            transport = yield from self._transport_now()
            digests = yield Rpc(self._wants_digests)
            batched = yield from self._batches_stores()  # asked again after a retry: the server may be another
            answer = yield from transport.store(self._calls, name, archive, rest, replace, progress, metadata, digests,
                                                batched=batched)
            return ArchiveInfo.of(answer)

        return (yield from self._retrying(f"Store of {name!r}", attempt))

    def _entries(self, request: archives_pb2.FetchRequest, reader: Any, keep: bool = False,
                 values: bool = False) -> Steps[Any]:
        """What ``reader`` makes of a Fetch's entries, yielded as they arrive (leaving early
        cancels the call), or with ``keep`` returned in a list. A call that ends UNAVAILABLE
        is resumed after the entries that came whole. The server may send small entries
        several to a message (every reader reads them; a server from before them ignores the
        ask). With ``values``, a Fetch of every entry keeps those of the plain values too."""
        request.batched_entries = True
        noted = _Noted(reader, keep, hide_files=not request.entries, keep_values=values)  # every entry: the tensors
        retry = 0
        while True:
            try:
                asked = request if not noted.done else (yield from self._rest_of(request, noted.done, noted.version))
                if asked is None:
                    return noted.kept
                transport = yield from self._transport_now()
                yield from transport.fetch(self._calls, asked, noted)
                self._retries.contact.reached = True
                return noted.kept
            except errors.ServiceError as error:
                if noted.done:  # entries came: the server was reached
                    self._retries.contact.reached = True
                pause = self._retries.next_delay(retry, f"Fetch of {request.archive!r}", error)
            retry += 1
            yield from self._forget(pause)
            reader.restart()

    def _rest_of(self, request: archives_pb2.FetchRequest, done: Sequence[str], version: str
                 ) -> Steps[archives_pb2.FetchRequest | None]:
        """The Fetch of what ``request`` asks but the entries ``done``, pinned to ``version`` of
        the archive (the server refuses it if the archive was replaced meanwhile); a request by
        prefix learns the archive's names from one Describe, tried once (it is part of the
        Fetch's attempt: the Fetch's retries cover it); names of another version are harmless,
        since the pinned Fetch is then refused."""
        yield from self._refuse_resuming_an_alias(request.archive, len(done))
        listed = None
        if not request.entries:
            described = yield from self._unary_once(self._methods.describe,
                                                    archives_pb2.DescribeRequest(archive=request.archive))
            listed = [entry.name for entry in described.entries]
        return resumed_request(request, done, listed, version)

    def _refuse_resuming_an_alias(self, name: str, done: int) -> Steps[None]:
        """AliasError when ``name`` is an alias: the Fetch cut off asked for what it pointed at
        then, which the rest could no longer be taken from if it moved (one version, never a
        mix). A server from before aliases has none."""
        try:
            target = (yield Rpc(self._methods.resolve, archives_pb2.ResolveRequest(name=name),
                                **self._calls.options())).archive
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                return
            raise rpc_error(error, self.target) from None
        if target != name:
            raise errors.AliasError(
                f"Fetch of {name!r} was cut off after {done} whole entries, and {name!r} is an alias (of "
                f"{target!r} now): the rest is not fetched, since the alias may have moved meanwhile and the "
                f"entries would mix two versions; fetch again, or fetch the archive itself ({target!r})")

    def _fetched(self, request: archives_pb2.FetchRequest, progress: Progress, values: bool = False
                 ) -> Steps[list[tuple[str, torch.Tensor]]]:
        return (yield from self._entries(request, _readers.EntryReader(progress), keep=True, values=values))

    def _fetched_archive(self, request: archives_pb2.FetchRequest, progress: Progress) -> Steps[Any]:
        """An in-memory Archive of what ``request`` fetches, with the plain values it covers."""
        pairs = yield from self._fetched(request, progress, values=True)
        return _archive_values.fetched_archive(pairs, f"Client.fetch({request.archive!r})")

    def _transferred(self, archive: str, asks: Sequence[archives_pb2.EntryAsk], progress: Progress
                     ) -> Steps[list[torch.Tensor]]:
        """The tensors of ``asks``, in one Fetch (what a remote archive's reads take)."""
        got = yield from self._fetched(archives_pb2.FetchRequest(archive=archive, entries=asks), progress)
        return _readers.check_fetched([ask.name for ask in asks], got)

    def _files(self, name: str, prefix: str, progress: Progress) -> Steps[dict[str, bytes]]:
        """The files kept with archive ``name`` under ``prefix``, each checked against its digest."""
        kept = [file for file in (yield from self._describe(name)).files if file.prefix == prefix]
        asks = [archives_pb2.EntryAsk(name=file.entry, dtype="uint8", shape=archives_pb2.Shape(dims=[file.size]))
                for file in kept]
        tensors = (yield from self._transferred(name, asks, progress)) if asks else []
        return {file.name: _archive_files.file_bytes(file, tensor) for file, tensor in zip(kept, tensors)}

    def _union(self, target: str, sources: Mapping[str, str] | Sequence[str], replace: bool,
               metadata: Mapping[str, str] | None) -> Steps[ArchiveInfo]:
        request = union_request(target, sources, replace, metadata)
        return ArchiveInfo.of((yield from self._unary(self._methods.union, request)))

    def _derive(self, archive: str, base: str, changes: Iterable[Any], metadata: Mapping[str, str] | None,
                replace: bool) -> Steps[ArchiveInfo]:
        """Archive ``archive`` built on the server from archive ``base`` and ``changes``, each
        ``(name, kind, crc32c, tensors)`` (:mod:`tannery.calls.derive`): only the changes
        travel, on gRPC whatever the transport. Committed as a Store is (``replace`` and an
        existing name alike); retried from its start after an UNAVAILABLE."""
        changes = _derives.check_changes(changes, f"Derive of {archive!r}")

        def attempt(retry: int) -> Steps[ArchiveInfo]:
            messages = _derives.derive_messages(archive, base, changes, replace, metadata,
                                                self._connection.chunk_size)
            # Serializing a tensor may take a while: in asyncio, not on the event loop.
            return ArchiveInfo.of((yield Send(self._methods.derive, messages, self._calls.options(), self.target,
                                              off_loop=True)))

        return (yield from self._retrying(f"Derive of {archive!r}", attempt))

    def _describe(self, name: str, names: Iterable[str] | None = None) -> Steps[ArchiveDescription]:
        request = describe_request(name, names)
        return ArchiveDescription.of((yield from self._unary(self._methods.describe, request)))

    def _diff(self, a: str, b: str, names: Iterable[str] | None, prefix: str | None, same: bool
              ) -> Steps[ArchiveDiff]:
        request = _diffs.diff_request(a, b, names, prefix, same)
        return _diffs.ArchiveDiff.of((yield from self._unary(self._methods.diff, request)))

    def _list(self, prefix: str, limit: int | None = None) -> Steps[list[ArchiveInfo]]:
        """The archives under ``prefix``, in the server's largest pages; the first ``limit`` only
        (None: all)."""
        archives: list[ArchiveInfo] = []
        token = ""
        while True:
            size = LARGEST_PAGE if limit is None else min(LARGEST_PAGE, limit - len(archives))
            if size <= 0:
                return archives
            page = yield from self._unary(self._methods.list, list_request(prefix, token, size))
            archives += (ArchiveInfo.of(info) for info in page.archives)
            token = page.next_page_token
            if not token:
                return archives

    def _delete(self, name: str, force: bool = False) -> Steps[Deleted]:
        request = archives_pb2.DeleteRequest(archive=name, force=force)

        reached = False  # an earlier attempt broke off after the server had it (and may have deleted)

        def attempt(retry: int) -> Steps[Deleted]:
            nonlocal reached
            try:
                return Deleted.of((yield from self._unary_once(self._methods.delete, request)))
            except errors.NotFound as error:
                if reached:  # the attempt whose answer was lost deleted it
                    return Deleted.gone(name)
                if retry:
                    error.args = (f"{error.args[0]} (no earlier attempt of this Delete was seen to reach the server)",
                                  *error.args[1:])
                raise
            except errors.Unavailable as error:
                reached = reached or bool(getattr(error, "reached", False))
                raise

        return (yield from self._retrying(f"Delete of {name!r}", attempt))

    def _load_state_dict(self, module: torch.nn.Module, name: str, prefix: str, strict: bool,
                         progress: Progress) -> Steps[Any]:
        description = yield from self._describe(name)
        plan = _state_dict.plan_state_dict(module, description, prefix, strict)
        # The archive the Describe found (an alias resolved once): no move mixes two versions.
        archive = description.name or name
        tensors = (yield from self._transferred(archive, plan.asks, progress)) if plan.asks else []
        return plan.load(module, tensors, strict)

    # -- aliases and retention -----------------------------------------------------------

    def _tag(self, alias: str, archive: str, expect: str | None) -> Steps[Tagged]:
        request = archives_pb2.TagRequest(alias=alias, archive=archive)
        if expect is not None:
            request.expect = expect
        # Retried as it is: a Tag whose lost attempt moved the alias finds it there and answers OK.
        return Tagged.of((yield from self._retrying(f"Tag of {alias!r}",
                                                    lambda retry: self._unary_once(self._methods.tag, request))))

    def _history(self, alias: str, limit: int | None) -> Steps[list[AliasMove]]:
        request = _histories.history_request(alias, limit)
        return [_histories.AliasMove.of(m) for m in (yield from self._unary(self._methods.history, request)).moves]

    def _tag_back(self, alias: str) -> Steps[Tagged]:
        """Move ``alias`` to its target before its last move, compare-and-set against its target now."""
        previous, current = _histories.back_move(alias, (yield from self._history(alias, 1)))
        try:
            return (yield from self._tag(alias, previous, current))
        except errors.NotFound as error:
            raise errors.NotFound(f"alias {alias!r} cannot go back from {current!r} to {previous!r}: {error}; tag it "
                                  "to another archive by name") from None

    def _untag(self, alias: str) -> Steps[Untagged]:
        request = archives_pb2.UntagRequest(alias=alias)

        def attempt(retry: int) -> Steps[Untagged]:
            try:
                return Untagged(Alias.of((yield from self._unary_once(self._methods.untag, request)).removed))
            except errors.NotFound:
                if retry:  # the attempt whose answer was lost removed it
                    return Untagged.gone(alias)
                raise

        return (yield from self._retrying(f"Untag of {alias!r}", attempt))

    def _resolve(self, name: str) -> Steps[str]:
        return (yield from self._unary(self._methods.resolve, archives_pb2.ResolveRequest(name=name))).archive

    def _aliases(self, prefix: str, archive: str | None, archive_prefix: str | None = None) -> Steps[list[Alias]]:
        """The aliases asked for, every page (by name; by archive, then name, with ``archive`` or
        ``archive_prefix``)."""
        found: list[Alias] = []
        token = ""
        while True:
            request = aliases_request(prefix, archive, archive_prefix, token)
            page = yield from self._unary(self._methods.list_aliases, request)
            # A server from before archive_prefix ignores it (and answers every alias): kept out here.
            found += (Alias.of(a) for a in page.aliases if a.archive.startswith(archive_prefix or ""))
            token = page.next_page_token
            if not token:
                return found

    def _watched(self, alias: str, notify: Callable[[], None]) -> Watched:
        """A Watch of ``alias`` (not open yet: its ``pump`` opens it), retried as this client retries."""
        return _watches.Watched(self._calls, alias, self._retries, notify)

    def _prune(self, prefix: str, keep_last: int, dry_run: bool) -> Steps[Pruned]:
        keep_last = _retention.check_prune(prefix, keep_last)
        archives = yield from self._list(prefix)
        plan = _retention.plan_prune(archives, (yield from self._aliases("", None, prefix)), keep_last)
        if dry_run:
            return Pruned(plan.delete, plan.keep, plan.aliased, dry_run=True)
        deleted, kept, aliased = [], list(plan.keep), dict(plan.aliased)
        for info in plan.delete:
            try:
                yield from self._delete(info.name)
                deleted.append(info)
            except errors.NotFound:  # deleted by someone else meanwhile: gone all the same
                deleted.append(info)
            except errors.AliasError:  # an alias reached it after the List: kept, as aliased ones are
                kept.append(info)
                aliased[info.name] = tuple(a.alias for a in (yield from self._aliases("", info.name)))
        return Pruned(tuple(deleted), tuple(sorted(kept, key=lambda i: (i.created, i.name), reverse=True)), aliased)

    # -- channels ------------------------------------------------------------------------

    def _publish(self, channel: str, tensors: Iterable[Any], progress: Progress,
                 store_as: channels_pb2.StoreAs | None = None, files: MemoryFiles | None = None) -> Steps[Published]:
        """Publish ``tensors`` on ``channel``; with ``store_as``, the server stores them as that
        archive too (``Published.stored``, or ``store_error`` saying why not). ``files``: on the
        same host, memory files made ready for the payloads (a publisher sending versions)."""
        _messages.check_tensors(tensors)
        transport = yield from self._transport_now()
        stored = store_as.SerializeToString() if store_as is not None else b""
        return Published.of((yield from transport.publish(self._calls, channel, tensors, progress, stored, files)))

    def _subscribe(self, channel: str, progress: Progress, reader: _readers.PayloadReader | None = None
                   ) -> Steps[Feed]:
        """A subscription the server has registered (everything published afterwards arrives);
        ``reader`` makes its tensors (a relaying follower's passes its pieces on as well)."""
        transport = yield from self._transport_now()
        return (yield from transport.subscribe(self._calls, channel, reader or _readers.PayloadReader(progress)))


class _Noted:
    """A Fetch's reader, noting the entries that come whole (a resumed Fetch skips them) and,
    for a Fetch returned whole, keeping what it makes instead of handing it on."""

    def __init__(self, reader: Any, keep: bool, hide_files: bool = False, keep_values: bool = False) -> None:
        self.reader, self.pieces, self.pool = reader, reader.pieces, reader.pool
        self.done: list[str] = []
        #: The version of the archive the entries done were read from (initial metadata): what
        #: a resumed Fetch sends back, pinned to it; "" until known (or from an older server).
        self.version = ""
        self.kept: list[Any] | None = [] if keep else None
        #: Leave out the files and plain values kept with the archive (a Fetch of every entry gives the tensors).
        self.hide_files = hide_files
        #: ... but keep those of the plain values (``Client.fetch`` lifts them out of the entries).
        self.keep_values = keep_values

    def began(self, version: str) -> None:
        """An attempt began on ``version`` of the archive. Kept while no entry came whole (the
        next attempt asks for everything again, of whatever version is there then); after, a
        resumed attempt is pinned to it, so it is given the same version or fails."""
        if not self.done:
            self.version = version

    def feed(self, message: Any) -> Sequence[Any]:
        return self._noted(self.reader.feed(message))

    def arrived(self, item: Any) -> Sequence[Any]:
        return self._noted(self.reader.arrived(item))

    def close(self) -> None:
        self.reader.close()

    def _noted(self, items: list[Any]) -> Sequence[Any]:
        for item in items:
            whole = self.reader.whole(item)
            if whole is not None:
                self.done.append(whole)
        if self.hide_files:
            items = [item for item in items if not self._hidden(_item_name(item))]
        if self.kept is None:
            return items
        self.kept.extend(items)
        return ()

    def _hidden(self, name: str) -> bool:
        return is_kept_entry(name) and not (self.keep_values and values_prefix(name) is not None)


def _item_name(item: Any) -> str:
    """The entry name of what a reader made: a ``(name, tensor)`` pair or a TensorPiece."""
    name = getattr(item, "name", None)
    return item[0] if name is None else name


__all__ = ["CallCore"]
