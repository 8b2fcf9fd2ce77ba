"""Relays: a follower passes each version on to other followers as it receives it, so the server
sends a version about once whatever the number of followers (docs/weight-sync.md, "Relays").

A relaying follower listens on a port of its own (:class:`~tannery.dataplane.relay_port.RelayPort`)
and joins its channel's relay plan (the ``Route`` RPC) on a thread of its own. The server answers
its route: take payloads from the server (a Subscribe) or from another member's relay port; and a
new route whenever the plan moves it. Whatever comes from upstream is passed on, piece by piece
as it lands, to the children the server routes here, by :class:`RelayingReader` on the follower's
receiving thread, never on the thread that iterates the follower: a worker busy with its model
still relays.

A parent that cannot be read (killed, a link cut, a key refused) is reported on the next Route
call (``unreachable``): the server routes around it. The version in flight is then taken from
the store, as every version a follower misses on the channel is, so a follower never applies
a partial version whatever happens to its relays.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import grpc

from tannery_protocol import errors
from tannery_protocol.datalink import (
    HANDSHAKE_SECONDS, MAX_HANDSHAKE_FRAME, Link, LinkError, PeerFailed, expect, frame, tune_tcp,
)
from tannery_protocol.v1.data_pb2 import Hello
from tannery_protocol.v1 import channels_pb2
from tannery.calls.running import run as run_blocking
from tannery.client import LinkSubscription, Subscription
from tannery.dataplane.links import coded, next_published
from tannery.dataplane.readers import PayloadReader
from tannery.dataplane.relay_port import PIECE, RELAY_ID, RelayPort, pinned_context
from tannery.dataplane.transports import LocalTransport
from tannery.rpc.connection import rpc_error
from tannery.weights.sources import Pauses

if TYPE_CHECKING:
    from tannery.client import Client

log = logging.getLogger("tannery.weights")

#: Seconds a relaying follower waits for its first route before it subscribes to the server.
ROUTE_WAIT_SECONDS = 5.0


class RelayingReader(PayloadReader):
    """A subscription's reader that passes every piece it receives on to a relay port's children
    before (or while) it makes tensors of them."""

    def __init__(self, port: RelayPort) -> None:
        super().__init__()
        self.port = port

    def receive(self, size: int, read_into: Any) -> list:
        def relayed(view: memoryview) -> None:
            for start in range(0, view.nbytes, PIECE):
                piece = view[start:start + PIECE]
                read_into(piece)
                self.port.piece(piece)

        tensors = super().receive(size, relayed)
        if tensors:
            self.port.payload_done()
        return tensors

    def feed(self, chunk: memoryview) -> list:
        self.port.piece(memoryview(chunk))
        tensors = super().feed(chunk)
        if tensors:
            self.port.payload_done()
        return tensors

    def arrived(self, item: Any) -> Any:
        raise RuntimeError("a relaying follower takes its payloads over TCP or gRPC, not as same-host files")

    def discard(self) -> None:
        super().discard()
        self.port.abandon()


class ParentFeed:
    """The tensors a parent member's relay port passes on: an iterator; ``close()`` ends it."""

    def __init__(self, parent: str, key: bytes, certificate: bytes, reader: PayloadReader, relaying: Relaying) -> None:
        self.parent, self.reader, self._relaying = parent, reader, relaying
        self.closed = False
        self.link: Link | None = None
        self._ready: deque[Any] = deque()
        try:
            self.link = _connect_parent(parent, key, certificate)
        except (OSError, LinkError, ssl.SSLError, ValueError) as exc:
            raise self._unreachable(exc) from None

    def __iter__(self) -> ParentFeed:
        return self

    def __next__(self) -> Any:
        assert self.link is not None
        while not self._ready:
            try:
                self._ready.extend(next_published(self.link, self.reader))
            except Exception as exc:  # noqa: BLE001  (a broken link, or bytes that do not parse: the parent's)
                self.link.close()
                if self.closed:
                    raise StopIteration from None
                if isinstance(exc, PeerFailed) and exc.code == "ABORTED":  # its source changed: start over
                    raise coded(errors.Unavailable, "UNAVAILABLE", f"relay {self.parent}: {exc.message}") from None
                if isinstance(exc, PeerFailed) and exc.code == "RESOURCE_EXHAUSTED":
                    self._relaying.unreachable(self._relaying.seen_address, f"this follower {exc.message}", own=True)
                    raise coded(errors.ResourceExhausted, exc.code, f"relay {self.parent} dropped this follower: "
                                f"{exc.message}; the server is asked to move it to the end") from None
                raise self._unreachable(exc) from None
        return self._ready.popleft()

    def _unreachable(self, exc: BaseException) -> errors.ServiceError:
        self._relaying.unreachable(self.parent, str(exc))
        return coded(errors.Unavailable, "UNAVAILABLE", f"relay {self.parent} could not be read ({exc}); the "
                                                        "server is asked for another route")

    def close(self) -> None:
        self.closed = True
        if self.link is not None:
            self.link.abort()


def _connect_parent(parent: str, key: bytes, certificate: bytes) -> Link:
    """A connection to a parent's relay port that it has welcomed as a relay, its key presented;
    over TLS, trusting only the certificate the server handed (``certificate``), when there is one."""
    host, _, port = parent.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_SECONDS)
    try:
        tune_tcp(sock)
        if certificate:
            sock = pinned_context(certificate).wrap_socket(sock)
        link = Link(sock, local=False)
        welcome, _ = link.receive(limit=MAX_HANDSHAKE_FRAME)
        expect(welcome, "welcome")
        if welcome.welcome.server_id != RELAY_ID:
            raise LinkError(f"{parent} answers, but not as a relay port (its welcome names another service)")
        link.send(frame(hello=Hello(ticket=key)))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return link


class Relaying:
    """A sync follower's relay: its port, its place in the channel's plan, and its current route."""

    def __init__(self, client: Client, channel: str, host: str | None = None, port: int = 0) -> None:
        self.client, self.channel = client, channel
        host = host if host is not None else _host_toward(client._calls.target)
        self.port = RelayPort(host or "", port, tls=client._calls.connection.tls is not None)
        self.address = f"{host}:{self.port.port}" if host else f":{self.port.port}"
        if ":" in (host or "") and host:
            self.address = f"[{host}]:{self.port.port}"
        self.member = uuid.uuid4().hex
        self.closed = False
        self._changed = threading.Condition()
        #: The route: None until the first answer; then (parent, key, certificate), parent "" for the server.
        self.route: tuple[str, bytes, bytes] | None = None
        self.off: str | None = None  # why this follower does not relay (the server's relays are off)
        self._unreachable = ""
        self._call: Any = None
        self._source: Any = None
        self._source_route: tuple[str, bytes, bytes] | None = None
        #: Where the server sees this member's port (what it names in a report of itself).
        self.seen_address = self.address
        self._thread = threading.Thread(target=self._route_all, daemon=True, name=f"tannery-route-{channel}")
        self._thread.start()

    # -- the receiving side -----------------------------------------------------------------

    def open_source(self) -> Any:
        """The source of this follower's payloads by its current route (waiting for the first one
        for at most :data:`ROUTE_WAIT_SECONDS`): a subscription to the server, or a parent's relay
        port; either passes on what it brings to this follower's children."""
        with self._changed:
            self._changed.wait_for(lambda: self.route is not None or self.off is not None or self.closed,
                                   ROUTE_WAIT_SECONDS)
            route = self.route or ("", b"", b"")
        parent, key, certificate = route
        self.port.restart()  # children start over with this source: none mixes two streams in one version
        reader = RelayingReader(self.port)
        if parent:
            source: Any = ParentFeed(parent, key, certificate, reader, self)
        else:
            feed = run_blocking(self.client._subscribe(self.channel, None, reader))
            source = LinkSubscription(feed) if feed.link is not None else Subscription(feed)
        with self._changed:
            self._source, self._source_route = source, route
            if self.route is not None and self.route != route:  # moved meanwhile
                source.close()
        return source

    def unreachable(self, parent: str, why: str, own: bool = False) -> None:
        """Report ``parent`` to the server (the Route call is made again, naming it); ``own``: this
        follower's own address, when it fell behind its parent (the server moves it to the end)."""
        with self._changed:
            if not own and (self.route is None or self.route[0] != parent):
                return  # already moved elsewhere
            self._unreachable = parent
            if not own:
                self.route = None  # the next source waits for the route around it
            call = self._call
        log.warning("%s: relay %s could not be read (%s); asking the server for another route", self.channel, parent,
                    why)
        if call is not None:
            call.cancel()

    # -- the route --------------------------------------------------------------------------

    def _route_all(self) -> None:
        pauses = Pauses()
        while not self.closed:
            with self._changed:
                if self.closed:
                    return
                request = channels_pb2.RouteRequest(channel=self.channel, address=self.address, key=self.port.key,
                                                    member=self.member, unreachable=self._unreachable,
                                                    certificate=self.port.certificate)
                call = self._call = self.client._calls.methods.route(request, wait_for_ready=True,
                                                                     **self.client._calls.options(timeout=False))
            try:
                for update in call:
                    pauses.reset()
                    with self._changed:
                        if self._unreachable == request.unreachable:
                            self._unreachable = ""
                    self._moved(update)
            except grpc.RpcError as error:
                if self.closed:
                    return
                code = error.code()
                if code is grpc.StatusCode.CANCELLED and self._unreachable:
                    continue  # made again at once, naming the parent that failed
                if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.INVALID_ARGUMENT):
                    self._stop_relaying(str(rpc_error(error, self.client._calls.target)))
                    return
            if not self.closed:
                threading.Event().wait(pauses.take())

    def _moved(self, update: channels_pb2.RouteUpdate) -> None:
        """Take the route the server gave; a source opened for another route ends (the receiving
        loop opens the new one)."""
        route = (update.parent, bytes(update.parent_key), bytes(update.parent_certificate))
        with self._changed:
            self.seen_address = update.address or self.seen_address
            if route == self.route:
                return
            self.route = route
            source = self._source if self._source_route != route else None
            self._changed.notify_all()
        log.info("%s: route %s (children %d, plan %d)", self.channel, update.parent or "from the server",
                 update.children, update.generation)
        if source is not None:
            source.close()

    def _stop_relaying(self, why: str) -> None:
        log.warning("%s: this follower does not relay (%s); it subscribes to the server", self.channel, why)
        with self._changed:
            self.off, self.route = why, ("", b"", b"")
            self._changed.notify_all()
        self.port.close()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            call, source = self._call, self._source
            self._changed.notify_all()
        if call is not None:
            call.cancel()
        self.port.close()
        self._thread.join(5)


class ThreadedSource:
    """A blocking source (a subscription, a parent's feed) read from asyncio on worker threads."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __aiter__(self) -> ThreadedSource:
        return self

    async def __anext__(self) -> Any:
        item = await asyncio.to_thread(next, self.source, _END)
        if item is _END:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        self.source.close()


_END = object()


def sync_twin(client: Any) -> Client:
    """A blocking client with ``client``'s settings (target, token, TLS, transport, retries): an
    asyncio follower's relay runs on threads of its own over it."""
    from tannery.client import Client

    connection = client._calls.connection
    twin = Client(connection.target, tls=connection.tls or False, chunk_size=connection.chunk_size,
                  timeout=connection.timeout, transport=client._transport, retries=client._retries)
    twin._calls.connection.metadata = connection.metadata  # its token, as the original holds it
    return twin


def relays_possible(client: Client) -> bool:
    """Whether a follower of ``client`` can relay: when its payloads come from another host (the
    TCP data port, or gRPC), not on the same-host path, where every follower maps the same memory
    file (nothing to pass on; the payloads come as files, not bytes). So it relays by default."""
    try:
        return not isinstance(run_blocking(client._transport_now()), LocalTransport)
    except errors.ServiceError:
        return False


def _host_toward(target: str) -> str | None:
    """The local address this host reaches the server's host from (where other followers reach it
    too), None when the target names no host."""
    host, sep, port = target.rpartition(":")
    if not sep or "://" in target or target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host = host.strip("[]")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # no packet is sent: the kernel only picks the route
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None


__all__ = ["ParentFeed", "Relaying", "RelayingReader", "ThreadedSource", "relays_possible", "sync_twin"]
