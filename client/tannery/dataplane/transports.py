"""The client's data plane: one :class:`Transport` per way of moving a call's bytes, chosen in one place.

A ``tannery.Client`` moves the bytes of Store and Fetch one of four ways (``transport=``):

- ``"local"``: the server's Unix socket, on its host. A Fetch receives the stored blob files
  themselves (descriptors passed with SCM_RIGHTS) and maps them: the tensors are views of
  the page cache, each block checked against its checksum first. A Store writes each
  payload into sealed memory files the server reads, hashes and stores. Publish and
  Subscribe pass their payloads as sealed memory files too.
- ``"tcp"``: a direct TCP connection to the server's data port (TLS when gRPC is), the
  server sending from its files with ``sendfile``, the client receiving straight into the
  tensors' memory. Publish sends each payload's bytes from the tensor's memory, and a
  subscriber receives them straight into its tensors' buffers; the server relays each piece
  to every subscriber from one shared buffer.
- ``"grpc"``: the gRPC streams (every server offers them).
- ``"auto"`` (the default): local when the server's socket is reachable from here and
  leads to the same server, else tcp when the server offers a data port that answers,
  else grpc.

:func:`choose` makes the choice; the call core (:mod:`tannery.calls.core`) then calls the chosen
transport's ``fetch``, ``store``, ``publish`` and ``subscribe``, each a generator of steps
(:mod:`tannery.rpc.waits`) that either client drives. Every call on a data path is checked over
gRPC first (token, names, every ask), then moves its bytes on the data connection
(:mod:`tannery.dataplane.links`) with the call's one-time ticket; the call's status is the outcome.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import AsyncIterable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import grpc

from tannery_protocol import errors
from tannery.rpc.connection import TRANSPORTS, Calls, check_transport, rpc_error, service_error
from tannery_protocol.datalink import TICKET_KEY, TRANSPORT_KEY, LinkError, PeerFailed
from tannery.dataplane.links import Route, coded, connect_call, link_failure, next_published, publish_over, receive_fetch, send_store
from tannery.dataplane.messages import publish_stream, store_begin, store_entries, store_messages
from tannery.rpc.requests import Progress
from tannery.rpc.waits import END, Blocking, Read, Rpc, Send, Status, Steps, Upload
from tannery_protocol.v1 import archives_pb2, channels_pb2
from tannery_protocol.wire import ABANDONED, VERSION_KEY, encode_publish_request, encode_store_commit, encode_store_request

if TYPE_CHECKING:
    from tannery.archive import Archive
    from tannery.rpc.connection import TLS
    from tannery.dataplane.memory_files import MemoryFiles
    from tannery.dataplane.readers import PayloadReader
    from tannery_protocol.v1.archives_pb2 import DataPathsResponse

#: Seconds to wait for a call's status after its data connection broke.
STATUS_WAIT = 10.0


def choose(transport: str, offered: "DataPathsResponse | None", target: str, tls: "TLS | None") -> "Transport":
    """The transport ``transport`` names, given what the server offers (:data:`GRPC` when
    ``"auto"`` finds no data path that answers).

    ``"auto"`` tries each data path (a connection and the server's welcome) and takes the
    first that answers as this server; ``"local"`` and ``"tcp"`` raise Unavailable, saying
    why, when theirs does not.
    """
    route = _route(transport, offered, target, tls)
    if route is None:
        return GRPC
    return LocalTransport(route) if route.kind == "local" else LinkTransport(route)


def _route(transport: str, offered: "DataPathsResponse | None", target: str, tls: "TLS | None") -> Route | None:
    """The data path of ``transport`` given what the server offers (None: the gRPC streams).

    ``"auto"`` tries each data path (a connection and the server's welcome) and takes the
    first that answers as this server; ``"local"`` and ``"tcp"`` raise Unavailable, saying
    why, when theirs does not.
    """
    if transport == "grpc":
        return None
    offered_id = offered.server_id if offered is not None else ""
    candidates: list[tuple[str, Route | str]] = []
    if transport in ("auto", "local"):
        if offered is None or not offered.socket_path:
            candidates.append(("local", "the server offers no same-host socket (its --socket is off, or it predates "
                                        "data paths)"))
        else:
            candidates.append(("local", Route("local", offered_id, socket_path=offered.socket_path)))
    if transport in ("auto", "tcp"):
        host = _host_of(target)
        if offered is None or not offered.data_port:
            candidates.append(("tcp", "the server offers no data port (its --data-port is off, or it predates data "
                                      "paths)"))
        elif host is None:
            candidates.append(("tcp", f"the target {target!r} is not host:port"))
        elif offered.data_tls != (tls is not None):
            candidates.append(("tcp", "the data port's TLS does not match this client's"))
        else:
            candidates.append(("tcp", Route("tcp", offered_id, host=host, port=offered.data_port, tls=tls)))
    reasons = []
    for kind, route in candidates:
        if isinstance(route, str):
            reasons.append(route)
            continue
        try:
            route.open(timeout=2.0).close()
            return route
        except (OSError, LinkError, ssl.SSLError) as exc:
            where = ("another host or mount namespace, or a socket this user may not open?" if kind == "local"
                     else "a firewall?")
            reasons.append(f"the {route.describe()} does not answer as this server ({exc}; {where})")
    if transport == "auto":
        return None
    refusal = coded(errors.Unavailable, "UNAVAILABLE", f"transport {transport!r} is not available: "
                    f"{'; '.join(reasons)}; use transport='auto' (or --transport auto) to fall back to what is")
    refusal.retryable = False  # type: ignore[attr-defined]  # a setting to change: waiting will not help
    raise refusal


def _host_of(target: str) -> str | None:
    """The host of a ``host:port`` target (``[::1]:50051`` too), None for other forms (``dns:///...``)."""
    if "://" in target or target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def ticket_of(metadata: Sequence[tuple[str, object]] | None) -> str | None:
    """The ticket in a call's initial metadata (None: the call ended before it gave one)."""
    for key, value in metadata or ():
        if key == TICKET_KEY:
            return str(value)
    return None


def version_of(metadata: Sequence[tuple[str, object]] | None) -> str:
    """The archive version a Fetch's initial metadata names ("" from a server from before it)."""
    for key, value in metadata or ():
        if key == VERSION_KEY:
            return str(value)
    return ""


class Transport(Protocol):
    """How Store, Fetch, Publish and Subscribe move their bytes. Each method is a generator of
    steps (:mod:`tannery.rpc.waits`) given the client's :class:`~tannery.rpc.connection.Calls`."""

    kind: str  # "grpc", "local" or "tcp"

    def fetch(self, calls: Calls, request: archives_pb2.FetchRequest, reader: Any) -> Steps[None]:
        """Yields what ``reader`` makes of the entries as they arrive; leaving early ends the call.
        ``reader.began(version)`` is told the archive's version first (initial metadata)."""

    def store(self, calls: Calls, name: str, archive: Archive, prefix: str, replace: bool, progress: Progress,
              metadata: Mapping[str, str] | None, digests: bool, *, batched: bool = False) -> Steps[Any]:
        """The StoreResponse of one Store call of the whole archive (``batched``: the server
        reads small entries several to a gRPC message)."""

    def publish(self, calls: Calls, channel: str, tensors: Iterable[Any], progress: Progress,
                store_as: bytes = b"", files: MemoryFiles | None = None) -> Steps[Any]:
        """The PublishResponse of one Publish call (``store_as``: a serialized ``StoreAs``, the
        archive the server stores the payloads as too; b"" for none; ``files``: memory files
        made ready for the same host's sealed payloads, and made ready again for the next call)."""

    def subscribe(self, calls: Calls, channel: str, reader: PayloadReader) -> Steps[Feed]:
        """A subscription the server has registered."""


class GrpcTransport:
    """The gRPC streams: every byte in the calls' messages."""

    kind = "grpc"

    def fetch(self, calls: Calls, request: archives_pb2.FetchRequest, reader: Any) -> Steps[None]:
        call = calls.methods.fetch(request, **calls.options())
        try:
            try:
                reader.began(version_of((yield Rpc(call.initial_metadata))))
                while (message := (yield Read(call))) is not END:
                    yield from reader.feed(message)
            except grpc.RpcError as error:
                raise rpc_error(error, calls.target) from None
            reader.close()
        finally:
            call.cancel()  # a no-op once the call is over; ends it if reading stopped early or failed

    def store(self, calls: Calls, name: str, archive: Archive, prefix: str, replace: bool, progress: Progress,
              metadata: Mapping[str, str] | None, digests: bool, *, batched: bool = False) -> Steps[Any]:
        messages = store_messages(name, archive, prefix, replace, calls.connection.chunk_size, progress, metadata,
                                  digests, batched)
        # A message may wait for its entry's hash: in asyncio, not on the event loop.
        return (yield Send(calls.methods.store, messages, calls.options(), calls.target, off_loop=digests))

    def publish(self, calls: Calls, channel: str, tensors: Iterable[Any], progress: Progress,
                store_as: bytes = b"", files: MemoryFiles | None = None) -> Steps[Any]:
        messages = publish_stream(channel, tensors, calls.connection.chunk_size, progress, store_as)
        return (yield Send(calls.methods.publish, messages, calls.options(), calls.target))

    def subscribe(self, calls: Calls, channel: str, reader: PayloadReader) -> Steps[Feed]:
        call = calls.methods.subscribe(channels_pb2.SubscribeRequest(channel=channel), **calls.options(timeout=False))
        yield from _registered(call, calls.target)
        return Feed(call, reader, calls.target)


#: The gRPC streams (what ``"auto"`` falls back to).
GRPC = GrpcTransport()


class LinkTransport:
    """A data path (``route``: its kind, "tcp" here and "local" in :class:`LocalTransport`):
    Store, Fetch, Publish and Subscribe move their bytes on a data connection."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.kind = route.kind

    def _options(self, calls: Calls, *, timeout: bool = True) -> dict[str, Any]:
        return calls.options(timeout=timeout, metadata=((TRANSPORT_KEY, self.kind),))

    def fetch(self, calls: Calls, request: archives_pb2.FetchRequest, reader: Any) -> Steps[None]:
        """A Fetch checked over gRPC, its entries received on the data path."""
        call = calls.methods.fetch(request, **self._options(calls))
        link = None
        try:
            try:
                metadata = yield Rpc(call.initial_metadata)
            except grpc.RpcError as error:
                raise rpc_error(error, calls.target) from None
            ticket = ticket_of(metadata)
            if ticket is None:  # the call failed before any byte: its status says why
                yield from _ended(call, calls.target)
                raise errors.ServiceError("the server answered a data-path Fetch without a ticket")
            reader.began(version_of(metadata))
            # Unavailable at once when the connection cannot be made; the call is cancelled (finally).
            link = yield Blocking(connect_call, self.route, ticket)
            try:
                items = receive_fetch(link, pieces=reader.pieces, pool=reader.pool)
                while (item := (yield Blocking(next, items, None))) is not None:
                    yield from reader.arrived(item)
            except (LinkError, OSError) as exc:
                raise (yield from broken(call, exc, self.route, calls.target)) from None
            yield from _ended(call, calls.target)  # the status: OK, or what stopped the transfer
        finally:
            if link is not None:
                link.abort()  # a worker thread still reading returns at once
                link.close()
            call.cancel()

    def store(self, calls: Calls, name: str, archive: Archive, prefix: str, replace: bool, progress: Progress,
              metadata: Mapping[str, str] | None, digests: bool, *, batched: bool = False) -> Steps[Any]:
        """A Store whose call carries begin and commit, its payloads sent on the data path
        (``batched``: the server reads small payloads inline on a same-host connection too)."""
        return (yield from self._upload(
            calls, calls.methods.store, encode_store_request(begin=store_begin(name, replace, metadata)),
            lambda link: send_store(link, store_entries(archive, prefix, digests), progress, inline=batched),
            lambda sent: encode_store_commit(*sent)))

    def _upload(self, calls: Calls, method: Any, first: bytes, transfer: Any, last: Any = None) -> Steps[Any]:
        """A client-streaming call (Store, Publish) whose ``first`` message opens it and whose
        payloads ``transfer(link)`` sends on the data path; ``last(sent)`` is its final message
        (not sent after a failed transfer: the server then keeps nothing). The call's answer."""
        upload = yield Upload(method, first, last, self._options(calls), calls.target)
        try:
            sent = failure = link = None
            try:
                ticket = ticket_of((yield Rpc(upload.initial_metadata)))
                if ticket is not None:
                    # Unavailable at once when the connection cannot be made; the call is cancelled (below).
                    link = yield Blocking(connect_call, self.route, ticket)
                    try:
                        sent = yield Blocking(_transferred, link, transfer)
                    except (LinkError, OSError) as exc:
                        failure = exc
            except BaseException:
                if link is not None:
                    link.abort()  # a worker thread still sending (a cancelled asyncio call) stops now
                upload.cancel()
                raise
            finally:
                upload.finish(sent)
            try:
                if failure is not None:
                    raise (yield from broken(upload.call, failure, self.route, calls.target))
                return (yield Rpc(upload.result))
            except grpc.RpcError as error:
                raise upload.error(error) from None
        finally:
            upload.close()

    def publish(self, calls: Calls, channel: str, tensors: Iterable[Any], progress: Progress,
                store_as: bytes = b"", files: MemoryFiles | None = None) -> Steps[Any]:
        """A Publish whose call names the channel, its payloads sent on the data path: sealed
        memory files on the same host, raw bytes over TCP (an async iterable of tensors is
        gathered first: the sending runs on a worker thread)."""
        if isinstance(tensors, AsyncIterable):
            tensors = yield Rpc(_gathered, tensors)
        return (yield from self._upload(calls, calls.methods.publish, encode_publish_request(channel, [], store_as),
                                        lambda link: publish_over(link, tensors, progress, files)))

    def subscribe(self, calls: Calls, channel: str, reader: PayloadReader) -> Steps[Feed]:
        """A subscription registered over gRPC whose payloads come on the data connection."""
        request = channels_pb2.SubscribeRequest(channel=channel)
        call = calls.methods.subscribe(request, **self._options(calls, timeout=False))
        try:
            ticket = ticket_of((yield from _registered(call, calls.target)))
            if ticket is None:
                raise errors.ServiceError(f"the server answered a {self.kind} Subscribe without a ticket")
            link = yield Blocking(connect_call, self.route, ticket)
        except BaseException:
            call.cancel()  # the server would wait for the connection until its ticket expires
            raise
        return Feed(call, reader, calls.target, link, self.route)


class LocalTransport(LinkTransport):
    """The same-host data path: Fetch maps the stored files, Store and Publish pass sealed memory files."""


class Feed:
    """A subscription, whichever client holds it: its call, the data connection its payloads
    come on (None: they come in the call's messages), and the tensors ready."""

    def __init__(self, call: Any, reader: PayloadReader, target: str, link: Any = None,
                 route: Route | None = None) -> None:
        self.call, self.reader, self.target = call, reader, target
        self.link, self.route = link, route
        self.closed = False
        self._ready: deque[Any] = deque()

    def next_tensor(self) -> Steps[Any]:
        """The next tensor published, :data:`~tannery.rpc.waits.END` once the subscription is over."""
        while not self._ready:
            if self.closed:
                if self.link is not None:
                    self.link.close()
                return END
            try:
                if self.link is not None:
                    self._ready.extend((yield Blocking(next_published, self.link, self.reader)))
                    continue
                message = yield Read(self.call)
            except grpc.RpcError as error:
                if self.closed:
                    return END
                raise rpc_error(error, self.target) from None
            except (LinkError, OSError) as exc:
                self.link.close()  # the reader's own step: no thread reads it any more
                if self.closed:
                    return END
                raise (yield from broken(self.call, exc, self.route, self.target)) from None
            if message is END:
                return END
            if message is ABANDONED:
                self.reader.discard()  # a torn payload is never returned
            else:
                self._ready.extend(self.reader.feed(message))
        return self._ready.popleft()

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self.closed = True
        if self.link is not None:
            self.link.abort()  # a thread reading it returns
        self.call.cancel()


def broken(call: Any, exc: BaseException, route: Route, target: str) -> Steps[Exception]:
    """The error of a call whose data connection broke: the call's own failure when it has one."""
    if not (isinstance(exc, PeerFailed) and exc.code == "PERMISSION_DENIED"):
        status = yield Status(call, STATUS_WAIT)
        if status is not None and status[0] is not grpc.StatusCode.OK:
            return service_error(*status, target)
    return link_failure(exc, route)


def _registered(call: Any, target: str) -> Steps[Any]:
    """A Subscribe's initial metadata, sent once the server has registered the subscription;
    the tannery exception of a refused one."""
    try:
        metadata = yield Rpc(call.initial_metadata)
    except grpc.RpcError as error:
        raise rpc_error(error, target) from None
    if call.done():
        status = yield Status(call, 0.0)
        if status is not None and status[0] is not grpc.StatusCode.OK:
            raise service_error(*status, target)
    return metadata


def _ended(call: Any, target: str) -> Steps[None]:
    """Read a call to its end: the tannery exception of its failure."""
    try:
        while (yield Read(call)) is not END:
            pass
    except grpc.RpcError as error:
        raise rpc_error(error, target) from None


def _transferred(link: Any, transfer: Any) -> Any:
    with link:
        return transfer(link)


async def _gathered(items: AsyncIterable[Any]) -> list[Any]:
    return [item async for item in items]


__all__ = ["GRPC", "TRANSPORTS", "Feed", "GrpcTransport", "LinkTransport", "LocalTransport", "STATUS_WAIT", "Transport",
           "broken", "check_transport", "choose", "ticket_of"]
