"""``tannery.Client``: the synchronous client of a tannery server.

::

    with tannery.Client("localhost:50051") as client:
        client.store("resnet", model)                    # an nn.Module, a dict of tensors, an Archive
        weights = client.archive("resnet")               # one Describe; reads fetch only what is asked
        w = weights.tensor("fc.weight", [10, 512], torch.float32)
        client.load_state_dict(model, "resnet")

Every failure raises a tannery exception with the server's message (``NotFound``,
``ArchiveError``, ``FormatError``, ``Unavailable``, ...; see :mod:`tannery_protocol.errors`); no
``grpc.RpcError`` escapes. The asyncio twin is :mod:`tannery.aio`; the two share
:mod:`tannery.requests` (what is sent), :mod:`tannery.readers` (what is received) and :mod:`tannery.connection`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tannery_protocol import errors
from tannery_protocol._lazy import lazy_module
from .records import ArchiveDescription, ArchiveInfo, Deleted, Published
from .requests import (
    Methods, Progress, archive_to_store, check_tensors, fetch_request, list_request, publish_messages, store_entries,
    store_begin, store_messages, union_request,
)
from .connection import Connection, TLSLike, check_transport, rpc_error
from .retries import RetryPolicy, call_name, resumed_request
from tannery_protocol.v1 import archives_pb2, channels_pb2
from tannery_protocol.wire import ABANDONED, encode_publish_request, encode_store_commit, encode_store_request

if TYPE_CHECKING:  # torch is imported where a tensor is made (tannery.readers, tannery.requests)
    import torch

    from .archive import Archive
    from .readers import EntryReader, PayloadReader, PieceReader, TensorPiece
    from .remote import RemoteArchive
    from .transports import Route

# Imported on first use: catalog calls (tannery ls, show, rm) need none of these.
_archive = lazy_module("tannery.archive")
_readers = lazy_module("tannery.readers")
_remote = lazy_module("tannery.remote")
_state_dict = lazy_module("tannery.state_dict")
_transports = lazy_module("tannery.transports")  # with tannery_protocol.datalink: sockets, ssl

T = TypeVar("T")


class _Guarded:
    """An iterator of messages that remembers the exception it raised: gRPC's sending thread
    swallows it (the call ends CANCELLED), and the caller should see it instead."""

    def __init__(self, messages: Iterator[bytes]) -> None:
        self._messages = messages
        self.error: BaseException | None = None

    def __iter__(self) -> "_Guarded":
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._messages)
        except StopIteration:
            raise
        except BaseException as error:
            self.error = error
            raise


class Client:
    """A connection to a tannery server (a context manager; :meth:`close` when done).

    ``target`` is ``host:port`` (``TANNERY_TARGET``, else ``localhost:50051``); ``token``
    is sent as ``authorization: Bearer <token>`` on every call (``TANNERY_TOKEN``); ``tls``
    is None (insecure unless ``TANNERY_TLS_*`` say otherwise), False (insecure), True
    (the system's roots) or a :class:`tannery.TLS`. ``chunk_size`` is the bytes of tensor
    data per message sent (1 MiB); ``timeout`` the seconds any one call may take (no limit
    by default; subscriptions are never limited). ``transport`` is how Store and Fetch move
    their bytes (``TANNERY_TRANSPORT``, else ``"auto"``): ``"local"`` (the server's Unix
    socket: stored files mapped, no copy through a socket), ``"tcp"`` (its data port),
    ``"grpc"`` (the gRPC streams), or ``"auto"``, the first of these that reaches the server
    (see :mod:`tannery.transports`); it is settled at the first Store or Fetch, and again
    after a retry. ``retries`` is how many times a call that ended UNAVAILABLE (the server
    unreachable or restarting, a connection lost mid-call) is tried again
    (``TANNERY_RETRIES``, else 5; 0 for none; see :mod:`tannery.retries`): reads, Union,
    Delete and Store (sent again from its start), Fetch (resumed after the entries received).
    ``timeout`` applies to each attempt.
    """

    def __init__(self, target: str | None = None, *, token: str | None = None, tls: TLSLike = None,
                 chunk_size: int | None = None, timeout: float | None = None, transport: str | None = None,
                 retries: int | None = None) -> None:
        self._transport = check_transport(transport)
        self._retries = RetryPolicy.resolve(retries)
        self._connection = Connection(target, token=token, tls=tls, chunk_size=chunk_size, timeout=timeout)
        self._channel = self._connection.channel()
        self._methods = Methods(self._channel)
        self._route: Route | None = None
        self._route_known = False
        self._offered: archives_pb2.DataPathsResponse | None = None
        self._offered_known = False
        self._route_lock = threading.Lock()

    @property
    def target(self) -> str:
        return self._connection.target

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"tannery.Client({self._connection!r})"

    # -- plumbing ------------------------------------------------------------------------

    def _options(self, *, timeout: bool = True) -> dict[str, Any]:
        return {"metadata": self._connection.metadata, "timeout": self._connection.timeout if timeout else None}

    @contextmanager
    def _errors(self, sent: _Guarded | None = None) -> Iterator[None]:
        """Raise a failed call's tannery exception (or the exception that stopped its messages).

        For a streaming upload (``sent``), first wait for gRPC's request-sending thread: after
        a refused call it lingers up to 0.1 s, and a program that exits meanwhile aborts inside
        gRPC's C++ code ("terminate called without an active exception").
        """
        started = set(threading.enumerate()) if sent is not None else set()
        try:
            yield
        except grpc.RpcError as error:
            if sent is not None:
                _join_new_grpc_threads(started)
                if sent.error is not None:
                    raise sent.error from None
            raise rpc_error(error, self._connection.target) from None

    def _unary(self, method: Any, request: Any) -> Any:
        return self._retrying(call_name(request), lambda retry: self._unary_once(method, request))

    def _unary_once(self, method: Any, request: Any) -> Any:
        with self._errors():
            return method(request, **self._options())

    def _retrying(self, what: str, attempt: Callable[[int], T]) -> T:
        """``attempt(retry)`` until it succeeds, tried again as :attr:`_retries` says after an
        UNAVAILABLE (``retry`` counts the attempts before it); the last error otherwise."""
        retry = 0
        while True:
            try:
                return attempt(retry)
            except errors.ServiceError as error:
                pause = self._retries.next_delay(retry, what, error)
            retry += 1
            self._retry_after(pause)

    def _retry_after(self, pause: float) -> None:
        """Wait, then forget what the server offered: a restarted one may offer other data paths."""
        time.sleep(pause)
        with self._route_lock:
            self._offered_known = self._route_known = False

    @property
    def transport(self) -> str:
        """The transport Store and Fetch take: "local", "tcp" or "grpc" (settled now if it was not)."""
        route = self._data_route()
        return route.kind if route is not None else "grpc"

    def _data_paths(self) -> archives_pb2.DataPathsResponse | None:
        """What the server offers beside gRPC (its data paths, whether it wants digests), asked
        once; None from a server from before data paths."""
        with self._route_lock:
            if not self._offered_known:
                try:
                    self._offered = self._methods.data_paths(archives_pb2.DataPathsRequest(), **self._options())
                except grpc.RpcError as error:
                    if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
                        raise rpc_error(error, self.target) from None
                self._offered_known = True
            return self._offered

    def _data_route(self) -> Route | None:
        """The data path of this client's Store and Fetch calls (None: the gRPC streams), chosen once."""
        if self._transport == "grpc":
            return None
        offered = self._data_paths()
        with self._route_lock:
            if not self._route_known:
                self._route = _transports.choose(self._transport, offered, self.target, self._connection.tls)
                self._route_known = True
            return self._route

    def _wants_digests(self) -> bool:
        """Whether Store sends each payload's SHA-256 ahead (the server said it spares it a
        copy); False when the server cannot be asked (the digests only save it work)."""
        try:
            offered = self._data_paths()
        except errors.ServiceError:
            return False
        return offered is not None and offered.wants_digests

    def _over(self, route: Route) -> dict[str, Any]:
        return {"metadata": (*self._connection.metadata, (_transports.TRANSPORT_KEY, route.kind)),
                "timeout": self._connection.timeout}

    def _broken(self, call: Any, exc: BaseException, route: Route) -> Exception:
        """The error of a call whose data connection broke: the call's own failure when it has one."""
        if not (isinstance(exc, _transports.PeerFailed) and exc.code == "PERMISSION_DENIED"):
            deadline = time.monotonic() + _transports.STATUS_WAIT
            while not call.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            if call.done() and call.code() is not grpc.StatusCode.OK:
                return rpc_error(call, self.target)
        return _transports.link_failure(exc, route)

    def _entries(self, request: archives_pb2.FetchRequest, reader: EntryReader | PieceReader) -> Iterator[Any]:
        """What ``reader`` makes of a Fetch's messages, as they arrive; leaving early cancels the
        call. A call that ends UNAVAILABLE is resumed after the entries that came whole."""
        done: list[str] = []
        asked, retry = request, 0
        while True:
            try:
                for item in self._entries_once(asked, reader):
                    whole = reader.whole(item)
                    if whole is not None:
                        done.append(whole)
                    yield item
                return
            except errors.ServiceError as error:
                pause = self._retries.next_delay(retry, f"Fetch of {request.archive!r}", error)
            retry += 1
            self._retry_after(pause)
            reader.restart()
            listed = None if request.entries else [e.name for e in self.describe(request.archive).entries]
            asked = resumed_request(request, done, listed)
            if asked is None:
                return

    def _entries_once(self, request: archives_pb2.FetchRequest, reader: EntryReader | PieceReader
                      ) -> Iterator[Any]:
        """One Fetch call's entries (:meth:`_entries`), on the data path or the gRPC stream."""
        route = self._data_route()
        if route is not None:
            yield from self._entries_over(route, request, reader)
            return
        call = self._methods.fetch(request, **self._options())
        try:
            with self._errors():
                for message in call:
                    yield from reader.feed(message)
            reader.close()
        finally:
            call.cancel()  # a no-op once the call is over; ends it if reading stopped early or failed

    def _entries_over(self, route: Route, request: archives_pb2.FetchRequest, reader: Any) -> Iterator[Any]:
        """A Fetch checked over gRPC, its entries received on the data path."""
        call = self._methods.fetch(request, **self._over(route))
        link = None
        try:
            with self._errors():
                ticket = _transports.ticket_of(call.initial_metadata())
                if ticket is None:  # the call failed before any byte: its status says why
                    for _ in call:
                        pass
                    raise errors.ServiceError("the server answered a data-path Fetch without a ticket")
            link = _transports.connect_call(route, ticket)  # the call is cancelled (finally) when it fails
            try:
                for item in _transports.receive_fetch(link, pieces=reader.pieces, pool=reader.pool):
                    yield from reader.arrived(item)
            except (_transports.LinkError, OSError) as exc:
                raise self._broken(call, exc, route) from None
            with self._errors():
                for _ in call:  # the status: OK, or what stopped the transfer
                    pass
        finally:
            if link is not None:
                link.close()
            call.cancel()

    def _fetch(self, request: archives_pb2.FetchRequest, progress: Progress) -> list[tuple[str, torch.Tensor]]:
        return list(self._entries(request, _readers.EntryReader(progress)))

    def _transfer(self, archive: str, progress: Progress):
        def transfer(asks: Sequence[archives_pb2.EntryAsk]) -> list[torch.Tensor]:
            got = self._fetch(archives_pb2.FetchRequest(archive=archive, entries=asks), progress)
            return _readers.check_fetched([ask.name for ask in asks], got)

        return transfer

    # -- archives ------------------------------------------------------------------------

    def store(self, name: str, value: Any, *, prefix: str = "", replace: bool = False,
              progress: Progress = None, metadata: Mapping[str, str] | None = None,
              skip_non_tensors: bool = False, allow_empty: bool = False) -> ArchiveInfo:
        """Store ``value`` as archive ``name``: an Archive, a mapping of names to tensors, an
        ``nn.Module`` (its state_dict) or a structure ``Archive.of_value`` takes, each entry
        named under ``prefix``.

        Entries stream one at a time, each tensor's bytes copied once, into its messages.
        The archive appears whole or not at all. Without ``replace``, a name that already holds
        exactly this content (entries, bytes and metadata) is no error: the server stores
        nothing and the info returned says ``already_stored`` (so a store whose answer was lost
        may be sent again); other content under that name raises AlreadyExists naming the
        first entry (or metadata key) that differs.
        ``progress`` is called with the tensor bytes (payload bytes) of each message sent.
        ``metadata``, a small mapping of str to str (safetensors' ``__metadata__``), is kept
        with the archive and returned by :meth:`describe`.

        Nothing vanishes silently: a leaf of ``value`` that is not a tensor (a step count,
        None) is a TypeError naming its path unless ``skip_non_tensors`` (then it is left
        out), and an archive of no entries is an ArchiveError unless ``allow_empty``.
        """
        archive, rest = archive_to_store(name, value, prefix, skip_non_tensors=skip_non_tensors,
                                         allow_empty=allow_empty)
        return self._retrying(f"Store of {name!r}",
                              lambda retry: self._store_once(name, archive, rest, replace, progress, metadata))

    def _store_once(self, name: str, archive: Archive, rest: str, replace: bool, progress: Progress,
                    metadata: Mapping[str, str] | None) -> ArchiveInfo:
        """One Store call of the whole archive, on the data path or the gRPC stream."""
        route = self._data_route()
        if route is not None:
            return self._store_over(route, name, archive, rest, replace, progress, metadata)
        messages = _Guarded(store_messages(name, archive, rest, replace, self._connection.chunk_size, progress,
                                           metadata, self._wants_digests()))
        with self._errors(messages):
            return ArchiveInfo.of(self._methods.store(messages, **self._options()))

    def _store_over(self, route: Route, name: str, archive: Archive, prefix: str, replace: bool,
                    progress: Progress, metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """A Store whose call carries begin and commit, its payloads sent on the data path."""
        begin = store_begin(name, replace, metadata)
        answer = self._upload_over(
            route, self._methods.store, encode_store_request(begin=begin),
            lambda link: _transports.send_store(link, store_entries(archive, prefix, self._wants_digests()),
                                                progress),
            lambda sent: encode_store_commit(*sent))
        return ArchiveInfo.of(answer)

    def _upload_over(self, route: Route, method: Any, first: bytes, transfer: Callable[[Any], tuple[int, int]],
                     last: Callable[[tuple[int, int]], bytes] | None = None) -> Any:
        """A client-streaming call (Store, Publish) whose ``first`` message opens it and whose
        payloads ``transfer`` sends on the data path; ``last(sent)`` is its final message (not
        sent after a failed transfer: the server then keeps nothing). The call's answer."""
        sent: list[tuple[int, int]] = []
        finished = threading.Event()
        consumer: list[threading.Thread] = []  # gRPC's thread that sends this call's messages

        def messages() -> Iterator[bytes]:
            consumer.append(threading.current_thread())
            yield first
            finished.wait()
            if sent and last is not None:
                yield last(sent[0])

        future = method.future(messages(), **self._over(route))
        broken: BaseException | None = None
        try:
            ticket = _transports.ticket_of(future.initial_metadata())
            if ticket is not None:
                link = _transports.connect_call(route, ticket)  # the call is cancelled (below) when it fails
                try:
                    with link:
                        sent.append(transfer(link))
                except (_transports.LinkError, OSError) as exc:
                    broken = exc
        except BaseException:
            future.cancel()
            raise
        finally:
            finished.set()
        try:
            with self._errors():
                if broken is not None:
                    raise self._broken(future, broken, route)
                return future.result()
        finally:
            # That thread outlives the call briefly; a program that exits meanwhile aborts in
            # gRPC's C++ code. Only this call's: other threads' calls are theirs to wait for.
            for thread in consumer:
                if thread is not threading.current_thread():
                    thread.join(2.0)

    def archive(self, name: str, *, progress: Progress = None) -> RemoteArchive:
        """The archive ``name`` as a :class:`RemoteArchive` (one Describe; reads fetch only what
        they return). ``progress`` is called with the payload bytes of each message received."""
        return _remote.RemoteArchive(self.describe(name), self._transfer(name, progress))

    def fetch(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
              progress: Progress = None) -> Archive:
        """Entries of archive ``name`` in memory: those named (NotFound for one it lacks), or
        those ``prefix`` owns, or all of them; in one call."""
        got = self._fetch(fetch_request(name, names, prefix), progress)
        return _archive.MemoryArchive(dict(got))

    def fetch_iter(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                   progress: Progress = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The entries :meth:`fetch` would return, as ``(name, tensor)`` pairs while they arrive,
        in the order the server sends them (``names``' order, else by name), in one call.

        Each tensor is yielded once its last byte is in, so only the entry being received is
        held: to write a checkpoint larger than memory, or to start on the first entries
        early. Stopping early (``break``, ``close()``) cancels the call; a failure midway
        raises where it happens, after the entries that came whole.
        """
        return self._entries(fetch_request(name, names, prefix), _readers.EntryReader(progress))

    def fetch_pieces(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                     progress: Progress = None) -> Iterator[TensorPiece]:
        """The entries :meth:`fetch_iter` would yield, as the pieces of their tensor bytes that
        each message brings (:class:`~tannery.readers.TensorPiece`: name, dtype and shape,
        offset, bytes), viewing the received messages: nothing is gathered or copied, so
        an entry of any size can be written to a file while only one message is held.
        """
        return self._entries(fetch_request(name, names, prefix), _readers.PieceReader(progress))

    def union(self, target: str, sources: Mapping[str, str] | Sequence[str], *, replace: bool = False,
              metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """A new archive ``target`` of the entries of ``sources``: a mapping of prefix to archive
        name, or a list of names. No tensor bytes are copied (on the server either). Without
        ``replace``, a ``target`` that already holds exactly what the union gives is returned
        with ``already_stored``; other content there raises AlreadyExists naming the entry."""
        return ArchiveInfo.of(self._unary(self._methods.union, union_request(target, sources, replace, metadata)))

    def describe(self, name: str) -> ArchiveDescription:
        """The archive's info and every entry's name, dtype, shape, sizes and digest."""
        return ArchiveDescription.of(self._unary(self._methods.describe, archives_pb2.DescribeRequest(archive=name)))

    def list(self, prefix: str = "") -> list[ArchiveInfo]:
        """Every archive whose name starts with ``prefix``, sorted by name (all pages)."""
        archives: list[ArchiveInfo] = []
        token = ""
        while True:
            page = self._unary(self._methods.list, list_request(prefix, token))
            archives += (ArchiveInfo.of(info) for info in page.archives)
            token = page.next_page_token
            if not token:
                return archives

    def delete(self, name: str) -> Deleted:
        """Remove archive ``name`` (NotFound if there is none) and the blobs only it used.

        When an attempt's answer was lost (UNAVAILABLE) and the retry finds the archive gone,
        the lost attempt deleted it: the result says so (``already_gone``), with no counts."""
        request = archives_pb2.DeleteRequest(archive=name)

        def attempt(retry: int) -> Deleted:
            try:
                return Deleted.of(self._unary_once(self._methods.delete, request))
            except errors.NotFound:
                if retry:
                    return Deleted.gone(name)
                raise

        return self._retrying(f"Delete of {name!r}", attempt)

    def load_state_dict(self, module: torch.nn.Module, name: str, prefix: str = "", strict: bool = True,
                        *, progress: Progress = None) -> Any:
        """Fill ``module`` from archive ``name`` (its entries under ``prefix``), as torch's
        ``load_state_dict`` does, fetching only the entries the module has keys for, in one
        call. Everything is checked first (ArchiveError naming the entries); returns torch's
        ``(missing_keys, unexpected_keys)``."""
        plan = _state_dict.plan_state_dict(module, self.describe(name), prefix, strict)
        tensors = self._transfer(name, progress)(plan.asks) if plan.asks else []
        return plan.load(module, tensors, strict)

    # -- channels ------------------------------------------------------------------------

    def publish(self, channel: str, tensors: Iterable[Any], *, progress: Progress = None) -> Published:
        """Publish ``tensors`` (torch tensors or numpy arrays, any iterable, read as sent) on
        ``channel``, in one stream; returns what was published."""
        check_tensors(tensors)
        route = self._data_route()
        if route is not None and route.kind == "local":
            return self._publish_over(route, channel, tensors, progress)
        chunk_size = self._connection.chunk_size

        def messages() -> Iterator[bytes]:
            first = True
            for index, tensor in enumerate(tensors):
                yield from publish_messages(tensor, channel if first else None, chunk_size, progress, index)
                first = False
            if first:  # no tensor: the call still names its channel
                yield from _channel_only(channel)

        sent = _Guarded(messages())
        with self._errors(sent):
            return Published.of(self._methods.publish(sent, **self._options()))

    def _publish_over(self, route: Route, channel: str, tensors: Iterable[Any], progress: Progress) -> Published:
        """A Publish whose call names the channel, its payloads passed as sealed memory files."""
        answer = self._upload_over(route, self._methods.publish, encode_publish_request(channel, []),
                                   lambda link: _transports.publish_over(link, tensors, progress))
        return Published.of(answer)

    def subscribe(self, channel: str, *, progress: Progress = None) -> "Subscription":
        """Subscribe to ``channel``: an iterator of the tensors published from now on.

        Returns once the server has registered the subscription, so everything published
        afterwards arrives. ``close()`` it (or leave its ``with`` block) to end it.
        """
        route = self._data_route()
        if route is not None and route.kind == "local":
            return self._subscribe_over(route, channel, progress)
        call = self._methods.subscribe(channels_pb2.SubscribeRequest(channel=channel),
                                       **self._options(timeout=False))
        with self._errors():
            call.initial_metadata()  # sent by the server once the subscription is registered
            if call.done() and call.code() is not grpc.StatusCode.OK:
                raise call  # the RpcError of a refused subscription
        return Subscription(call, _readers.PayloadReader(progress), self._connection.target)

    def _subscribe_over(self, route: Route, channel: str, progress: Progress) -> "LinkSubscription":
        """A subscription registered over gRPC whose payloads come on the same-host connection."""
        metadata = (*self._connection.metadata, (_transports.TRANSPORT_KEY, route.kind))
        call = self._methods.subscribe(channels_pb2.SubscribeRequest(channel=channel), metadata=metadata)
        try:
            with self._errors():
                ticket = _transports.ticket_of(call.initial_metadata())
                if ticket is None:
                    for _ in call:
                        pass
                    raise errors.ServiceError("the server answered a same-host Subscribe without a ticket")
            link = _transports.connect_call(route, ticket)
        except BaseException:
            call.cancel()
            raise
        return LinkSubscription(self, call, link, route, _readers.PayloadReader(progress))


def _join_new_grpc_threads(started: set[threading.Thread], timeout: float = 2.0) -> None:
    """Wait (bounded) for the gRPC threads that were not running in ``started`` to end."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if thread not in started and (getattr(target, "__module__", None) or "").startswith("grpc"):
            thread.join(max(0.0, deadline - time.monotonic()))


def _channel_only(channel: str) -> Iterator[bytes]:
    yield encode_publish_request(channel, [])


class Subscription:
    """The tensors published on a channel, in order (an iterator and a context manager)."""

    def __init__(self, call: Any, reader: PayloadReader, target: str) -> None:
        self._call = call
        self._reader = reader
        self._target = target
        self._ready: deque[torch.Tensor] = deque()
        self._closed = threading.Event()

    def __iter__(self) -> "Subscription":
        return self

    def __next__(self) -> torch.Tensor:
        while not self._ready:
            if self._closed.is_set():
                raise StopIteration
            try:
                chunk = next(self._call)
            except StopIteration:
                raise
            except grpc.RpcError as error:
                if self._closed.is_set():
                    raise StopIteration from None
                raise rpc_error(error, self._target) from None
            if chunk is ABANDONED:
                self._reader.discard()  # a torn payload is never returned
            else:
                self._ready.extend(self._reader.feed(chunk))
        return self._ready.popleft()

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self._closed.set()
        self._call.cancel()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LinkSubscription(Subscription):
    """A subscription whose payloads come on the same-host data path: each one published there
    is a memory file mapped here (the tensor shares it, nothing is copied between processes)."""

    def __init__(self, client: Client, call: Any, link: Any, route: Route, reader: PayloadReader) -> None:
        super().__init__(call, reader, client.target)
        self._client = client
        self._link = link
        self._route = route

    def __next__(self) -> torch.Tensor:
        while not self._ready:
            if self._closed.is_set():
                raise StopIteration
            try:
                self._ready.extend(_transports.next_published(self._link, self._reader))
            except (_transports.LinkError, OSError) as exc:
                if self._closed.is_set():
                    raise StopIteration from None
                raise self._client._broken(self._call, exc, self._route) from None
        return self._ready.popleft()

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self._closed.set()
        self._link.abort()
        self._call.cancel()
        self._link.close()


__all__ = ["Client", "LinkSubscription", "Subscription"]
