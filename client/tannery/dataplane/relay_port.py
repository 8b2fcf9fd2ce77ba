"""A follower's relay port: the payloads it receives, passed on to the followers it feeds, piece
by piece as they arrive (docs/weight-sync.md, "Relays").

The port speaks the data connection's frames (``data.proto``) as the server's TCP data port does
to a subscriber: ``welcome``, then the child's ``hello`` with the key the server handed it (a
wrong key is answered ``failure`` PERMISSION_DENIED), then ``entry`` frames each followed by one
piece of a payload, ``abandoned`` when the payload in progress was cut off upstream. A child
that connects mid-payload gets its first bytes at the next payload's start, never a tail.

Each child is sent to by a thread of its own from a queue bounded in bytes (:data:`CHILD_BUFFER`):
the receiving thread only queues views of the bytes it received (no copy), so a child as fast
as the link keeps the pipeline moving, and one whose queue stays full for :data:`CHILD_TIMEOUT`
is dropped (told ``failure`` RESOURCE_EXHAUSTED after the piece in flight), so a slow child
never stalls its parent and everyone upstream: it asks the server to move it to the end of the
plan. A child whose parent broke asks the server for a route around it.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import os
import socket
import ssl
import tempfile
import threading
import time
from collections import deque
from typing import Any

from tannery_protocol.datalink import HANDSHAKE_SECONDS, MAX_HANDSHAKE_FRAME, Link, LinkError, expect, frame, tune_tcp
from tannery_protocol.v1.data_pb2 import Abandoned, DataFailure, EntryBytes, Welcome

log = logging.getLogger("tannery.weights")

#: The id a relay port says in its welcome (a child checks it: another service on that port is not a relay).
RELAY_ID = "tannery-relay"
#: Bytes of one relayed piece: a child gets a payload's bytes this much after its parent does.
PIECE = 1 << 20
#: Bytes queued for one child at most before its parent waits for it.
CHILD_BUFFER = 64 << 20
#: Seconds a parent waits for a full child before it drops it (less than the server's channel
#: timeout, so a slow child is dropped before its parent is).
CHILD_TIMEOUT = 5.0
#: Connections that have not said hello yet, at most (each closes after HANDSHAKE_SECONDS).
MAX_GREETING = 64

_ABANDONED = object()
_RESTART = object()
#: Children one port feeds at most (the plan gives it its fan-out; more are refused).
MAX_CHILDREN = 64


class _Child:
    """One follower fed by this port: its connection, its queue, and the thread that sends it."""

    def __init__(self, link: Link, peer: str, dropped: Any) -> None:
        self.link, self.peer = link, peer
        self._dropped = dropped
        self._queue: deque[Any] = deque()
        self._bytes = 0
        self._room = threading.Condition()
        self.alive = True
        #: Dropped for keeping its queue full (told so, then closed).
        self.behind = False
        self.thread = threading.Thread(target=self._send_all, daemon=True, name=f"tannery-relay-to-{peer}")
        self.thread.start()

    def put(self, item: Any, nbytes: int, deadline: float | None = None) -> bool:
        """Queue ``item`` (a piece's bytes, :data:`_ABANDONED` or :data:`_RESTART`); False once the
        child is gone, or dropped for keeping its queue full until ``deadline`` (by default
        :data:`CHILD_TIMEOUT` from now)."""
        deadline = deadline if deadline is not None else time.monotonic() + CHILD_TIMEOUT
        with self._room:
            while self.alive and self._bytes and self._bytes + nbytes > CHILD_BUFFER:
                left = deadline - time.monotonic()
                if left <= 0:  # its sending thread says so after the piece it is in (or is cut off)
                    log.warning("relay: dropped child %s: it fell behind (%d bytes waited for it for %g s); it asks "
                                "the server for a new route", self.peer, self._bytes, CHILD_TIMEOUT)
                    self.alive, self.behind = False, True
                    self._room.notify_all()
                    cut = threading.Timer(CHILD_TIMEOUT, self.link.abort)
                    cut.daemon = True
                    cut.start()
                    return False
                self._room.wait(left)
            if not self.alive:
                return False
            self._queue.append(item)
            self._bytes += nbytes
            self._room.notify_all()
        return True

    def _send_all(self) -> None:
        try:
            while True:
                with self._room:
                    while self.alive and not self._queue:
                        self._room.wait()
                    if not self.alive:
                        break
                    item = self._queue[0]
                if item is _ABANDONED:
                    self.link.send(frame(abandoned=Abandoned()))
                    size = 0
                elif item is _RESTART:  # this relay's upstream changed: the child starts over with it
                    self.link.sock.settimeout(1.0)
                    self.link.send(frame(failure=DataFailure(code="ABORTED", message=(
                        "the relay took its payloads from another source: connect again (the version in "
                        "flight comes from the store)"))))
                    return
                elif item is None:  # the port closes: said between pieces, on this thread
                    self.link.sock.settimeout(1.0)
                    self.link.send(frame(failure=DataFailure(code="UNAVAILABLE", message=(
                        "the relay stopped; ask the server for a new route"))))
                    return
                else:
                    size = len(item)
                    self.link.send(frame(entry=EntryBytes(payload_bytes=size)))
                    self.link.send_bytes(item)
                with self._room:
                    self._queue.popleft()
                    self._bytes -= size
                    self._room.notify_all()
            if self.behind:  # between pieces, on this thread: the child knows it was too slow
                self.link.sock.settimeout(1.0)
                self.link.send(frame(failure=DataFailure(code="RESOURCE_EXHAUSTED", message=(
                    f"fell behind: its queue stayed full ({CHILD_BUFFER} bytes) for {CHILD_TIMEOUT:g} s"))))
        except (OSError, LinkError) as exc:
            log.info("relay: child %s left (%s)", self.peer, exc)
        finally:
            self.close()

    def close(self) -> None:
        with self._room:
            self.alive = False
            self._queue.clear()
            self._room.notify_all()
        self.link.abort()
        self.link.close()
        self._dropped(self)


class RelayPort:
    """A listening TCP port that feeds the followers the server routes through this one.

    The follower's receiving thread calls :meth:`piece` with each piece of a payload as it
    lands (a view of the received bytes), :meth:`payload_done` after a payload's last piece,
    and :meth:`abandon` when the payload in progress was cut off upstream.
    """

    def __init__(self, host: str = "", port: int = 0, key: bytes | None = None, tls: bool = False) -> None:
        #: What a child presents in its hello (the server hands it to this port's children only).
        self.key = key or os.urandom(32)
        #: With ``tls``: the certificate (PEM) this port serves, made now; children pin it.
        self.certificate, self._tls = (_self_signed() if tls else (b"", None))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(64)
        except BaseException:
            self._listener.close()
            raise
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._children: list[_Child] = []  # fed from the next piece on
        self._waiting: list[_Child] = []  # joined mid-payload: fed from the next payload's start
        self._at_start = True
        self._greeting = threading.BoundedSemaphore(MAX_GREETING)
        self.closed = False
        self._accepting = threading.Thread(target=self._accept_all, daemon=True, name=f"tannery-relay-port-{self.port}")
        self._accepting.start()

    @property
    def children(self) -> int:
        """Followers connected to this port now."""
        with self._lock:
            return len(self._children) + len(self._waiting)

    # -- the receiving side -----------------------------------------------------------------

    def piece(self, view: memoryview) -> None:
        """Pass on ``view``, the next bytes of the payload in progress. They are copied once, for
        every child, when there is one: the buffer they were received into is the follower's own,
        grown in place (``mremap``) while the payload arrives and used again by a later payload
        once its tensor is dropped, while a child may still be sending them."""
        with self._lock:
            if self._at_start:
                self._children += self._waiting
                self._waiting = []
                self._at_start = False
            children = list(self._children)
        if not children:
            return
        data = bytes(view)
        deadline = time.monotonic() + CHILD_TIMEOUT  # one wait for all: slow children do not add up
        for child in children:
            child.put(data, len(data), deadline)

    def payload_done(self) -> None:
        """The payload in progress is whole: a child waiting starts with the next one."""
        with self._lock:
            self._at_start = True

    def restart(self) -> None:
        """This follower's upstream changed (another parent, the server, or the same again after a
        break): every child is told to connect again, so that none assembles one version from two
        streams (a piece skipped by one, repeated by the other)."""
        with self._lock:
            children, self._children, self._waiting = self._children + self._waiting, [], []
            self._at_start = True
        for child in children:
            child.put(_RESTART, 0)

    def abandon(self) -> None:
        """The payload in progress was cut off upstream: the children discard what came of it."""
        with self._lock:
            children = [] if self._at_start else list(self._children)
            self._at_start = True
        for child in children:
            child.put(_ABANDONED, 0)

    # -- children ---------------------------------------------------------------------------

    def _accept_all(self) -> None:
        while not self.closed:
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                log.warning("relay port %s: accept failed (%s); going on", self.port, exc)
                time.sleep(0.1)  # out of descriptors, say: the next accept may work
                continue
            if not self._greeting.acquire(blocking=False) or self.children >= MAX_CHILDREN:
                sock.close()  # a flood of connections that say nothing, or too many children: refused
                continue
            threading.Thread(target=self._greet, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="tannery-relay-greet").start()

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """Welcome a connection, check its key, and feed it from the next payload on; a handshake
        not done in :data:`HANDSHAKE_SECONDS` in all (however it trickles) is cut."""
        cut = threading.Timer(HANDSHAKE_SECONDS, _shut, args=(sock,))
        cut.daemon = True
        cut.start()
        try:
            self._handshake(sock, peer)
        finally:
            cut.cancel()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            tune_tcp(sock)
            sock.settimeout(HANDSHAKE_SECONDS)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.info("relay: a connection from %s did not complete its TLS handshake: %s", peer, exc)
            sock.close()
            self._greeting.release()
            return
        link = Link(sock, local=False)
        try:
            link.send(frame(welcome=Welcome(server_id=RELAY_ID)))
            hello, _ = link.receive(limit=MAX_HANDSHAKE_FRAME)
            expect(hello, "hello")
            if not hmac.compare_digest(hello.hello.ticket, self.key):
                link.send(frame(failure=DataFailure(code="PERMISSION_DENIED", message=(
                    f"relay {self.host}:{self.port} refused the key presented: it takes the key the server gives "
                    "with the route to it (a route that is no longer current? ask the server again)"))))
                link.close()
                return
            sock.settimeout(None)
        except (OSError, LinkError) as exc:
            log.info("relay: a connection from %s did not complete its hello: %s", peer, exc)
            link.close()
            return
        finally:
            self._greeting.release()
        child = _Child(link, peer, self._dropped)
        with self._lock:
            if self.closed:
                child.put(None, 0)
                return
            (self._waiting if not self._at_start else self._children).append(child)

    def _dropped(self, child: _Child) -> None:
        with self._lock:
            for group in (self._children, self._waiting):
                if child in group:
                    group.remove(child)

    def close(self) -> None:
        """Stop listening and end every child's feed (they ask the server for a new route)."""
        with self._lock:
            self.closed = True
            children, self._children, self._waiting = self._children + self._waiting, [], []
        _shut(self._listener)
        self._listener.close()
        for child in children:
            child.put(None, 0)
            cut = threading.Timer(CHILD_TIMEOUT, child.link.abort)  # one that stopped reading is cut
            cut.daemon = True
            cut.start()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _self_signed() -> tuple[bytes, ssl.SSLContext]:
    """A fresh key and a self-signed certificate for one relay port (the children pin it: no name
    is checked, no authority involved), and the server-side TLS context serving them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tannery-relay")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=3650))  # pinned: its dates guard nothing
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="tannery-relay-") as directory:  # 0700: the key is read, then gone
        path = os.path.join(directory, "relay.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
            file.write(private + pem)
        context.load_cert_chain(path)
    return pem, context


def pinned_context(certificate: bytes) -> ssl.SSLContext:
    """A client TLS context that trusts ``certificate`` (a relay port's, as the server handed it) and no other."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the pinned certificate is the identity: no name to check
    context.load_verify_locations(cadata=certificate.decode())
    return context


__all__ = ["CHILD_BUFFER", "CHILD_TIMEOUT", "PIECE", "RELAY_ID", "RelayPort", "pinned_context"]
