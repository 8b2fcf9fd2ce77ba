"""The data paths beside gRPC: a Unix socket for clients on this host and a TCP data port.

A call that asks for a data path (request metadata ``tannery-transport``, see
:mod:`.plane`) is checked as every call is (token, names, every ask), then gets a
:class:`Ticket`: one use, for that call only, valid for :data:`CONNECT_SECONDS`. The
client presents it on a new data connection; the listener's handshake thread hands the
connection to the call, which moves the bytes and answers with its status as usual.

Listeners and handshakes run on threads of their own (blocking sockets); the transfer runs
on the storage's worker threads. Nothing here reads a byte of a payload.

Before its ticket is checked a connection is cheap and bounded (:mod:`.handshakes`): the whole
handshake, from connect to a valid ticket, must end within :data:`HANDSHAKE_SECONDS`; a hello
may announce :data:`~tannery_protocol.datalink.MAX_HANDSHAKE_FRAME` bytes at most; each listener
keeps its own limits, and counts its connections per peer, so slow peers cannot keep a real
client from its welcome.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tannery_protocol.datalink import (MAX_HANDSHAKE_FRAME, FrameTooLarge, Link, LinkClosed, LinkError, connect_unix,
                                       expect, frame, tune_tcp, unix_address)
from tannery_protocol.v1.data_pb2 import DataFailure, Welcome

from .handshakes import Gate, HandshakeCounts, Pending, Reaper, peer_of
from ..config import Config
from ..failures import Unavailable
from ..storage.private import socket_directory

log = logging.getLogger("tannery_server.data_paths")

#: Seconds a call waits for its client's data connection (and its ticket stays valid).
CONNECT_SECONDS = 30.0
#: Seconds from connect to a valid ticket (TLS, welcome and hello all included).
HANDSHAKE_SECONDS = 5.0


@dataclass
class Ticket:
    """What a call waiting for its data connection holds."""

    secret: bytes
    transport: str
    expires: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    paths: "DataPaths" = field(repr=False)

    @property
    def hex(self) -> str:
        return self.secret.hex()

    async def connection(self, timeout: float | None = None) -> Link:
        """The client's data connection; Unavailable when it does not come in time
        (:data:`CONNECT_SECONDS`, as the ticket's validity, unless ``timeout`` says otherwise)."""
        timeout = CONNECT_SECONDS if timeout is None else timeout
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow the call's cancellation when
            # the connection arrives at the same moment, leaving a handler for a client gone.
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self.future)
        except TimeoutError:
            raise Unavailable(f"the client did not open its {self.transport} data connection within {timeout:g} s "
                              "(a firewall between it and the data port?); nothing was moved") from None
        except asyncio.CancelledError:
            if self.future.done() and not self.future.cancelled():
                self.future.result().close()  # it came as the call was cancelled
            raise
        finally:
            self.withdraw()

    def withdraw(self) -> None:
        """Forget the ticket; a connection that arrived for it meanwhile is closed."""
        self.paths._tickets.pop(self.secret, None)
        if not self.future.done():
            self.future.cancel()


class DataPaths:
    """The Unix socket and the TCP data port of one server, and the tickets waiting on them."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.server_id = secrets.token_hex(16)
        self.socket_path: Path | None = None
        #: The data port bound (0 while there is none: what DataPaths answers then).
        self.data_port = 0
        self.tls = config.tls_cert is not None
        self._tickets: dict[bytes, Ticket] = {}
        self._listeners: list[socket.socket] = []
        #: Handshakes refused or timed out, by listener and reason (the metrics read them).
        self.handshake_failures = HandshakeCounts()
        self._gates = {kind: Gate(kind, self.handshake_failures) for kind in ("local", "tcp")}
        self._reaper = Reaper(list(self._gates.values()))
        self._ssl: ssl.SSLContext | None = _server_context(config) if self.tls else None
        self._closed = False

    # -- listening ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind and listen (the socket, the port), each served by an accepting thread."""
        self._reaper.start()
        path = socket_path(self.config)
        if path is not None:
            self._listen(self._bind_unix(path), local=True)
            self.socket_path = path
            log.info("same-host data path on %s", path)
        if self.config.data_port is not None:  # 0: a free port the OS picks
            listener = _bind_tcp(self.config.host, self.config.data_port)
            self.data_port = listener.getsockname()[1]
            self._listen(listener, local=False)
            log.info("data connections on %s:%d (%s)", self.config.host, self.data_port,
                     "TLS" if self.tls else "plaintext")

    def describe(self) -> str:
        """The data paths listening, for the start line: the data port's address, the socket's path."""
        port = f"{self.config.host}:{self.data_port}" if self.data_port else "off"
        return f"data port {port}, socket {self.socket_path or 'off'}"

    def _bind_unix(self, path: Path) -> socket.socket:
        socket_directory(path.parent, self.config.socket_permissions)
        if path.exists() or path.is_symlink():
            if _answers(path):
                raise OSError(errno.EADDRINUSE, f"cannot listen on the socket {path}: another server answers there; "
                              "choose another with --socket or TANNERY_SOCKET (or 'off')")
            path.unlink()  # left by a server that was killed
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(path) as address:
                listener.bind(address)
            # Only the users --socket-mode names may connect (the server's own by default).
            os.chmod(path, self.config.socket_permissions)
        except BaseException:
            listener.close()
            raise
        return listener

    def _listen(self, listener: socket.socket, local: bool) -> None:
        listener.listen(128)
        self._listeners.append(listener)
        kind = "unix" if local else "tcp"
        threading.Thread(target=self._accept, args=(listener, local), name=f"tannery-data-{kind}",
                         daemon=True).start()

    def _accept(self, listener: socket.socket, local: bool) -> None:
        gate = self._gates["local" if local else "tcp"]
        while not self._closed:
            try:
                sock, address = listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and the like: let descriptors come back
                continue
            pending = gate.admit(sock, peer_of(sock, address, local), HANDSHAKE_SECONDS)
            try:
                threading.Thread(target=self._handshake, args=(sock, local, gate, pending),
                                 name="tannery-data-handshake", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: this connection waits for none
                log.warning("data connection from %s dropped before its handshake: %s", pending.peer, exc)
                gate.finish(pending)  # off the gate before its descriptor is closed
                sock.close()

    def _handshake(self, sock: socket.socket, local: bool, gate: Gate, pending: Pending) -> None:
        """Welcome, hello, ticket: hand the connection to its call, or close it (counting why)."""
        handed = False
        try:
            sock = self._secure(sock, local)
            link = Link(sock, local)
            link.send(frame(welcome=Welcome(server_id=self.server_id)))
            hello, _ = link.receive(limit=MAX_HANDSHAKE_FRAME)
            expect(hello, "hello")
            if not gate.finish(pending):
                return  # ended by the gate (its deadline, or room for newer peers) as the hello came
            problem = self._take(hello.hello.ticket, "local" if local else "tcp")
            if isinstance(problem, str):
                gate.refused("bad_ticket")
                link.send(frame(failure=DataFailure(code="PERMISSION_DENIED", message=problem)))
                return
            sock.settimeout(None)
            problem.loop.call_soon_threadsafe(_deliver, problem.future, link)
            handed = True
        except (OSError, LinkError, ssl.SSLError) as exc:
            if gate.finish(pending):  # else the gate ended it and counted why
                gate.refused(_reason(exc))
            log.debug("data connection refused at its handshake (%s listener, from %s): %s", gate.listener,
                      pending.peer, exc)
        finally:
            gate.finish(pending)  # off the gate before its descriptor is closed (and may be reused)
            if not handed:
                sock.close()

    def _secure(self, sock: socket.socket, local: bool) -> socket.socket:
        """The connection ready for its welcome: a timeout on each step (the gate's reaper bounds
        the whole handshake), and on the data port tuned, and TLS-wrapped when the port has TLS."""
        sock.settimeout(HANDSHAKE_SECONDS)
        if local:
            return sock
        tune_tcp(sock)
        return self._ssl.wrap_socket(sock, server_side=True) if self._ssl is not None else sock

    def _take(self, secret: bytes, transport: str) -> "Ticket | str":
        """The ticket presented (now used up), or why it is refused."""
        ticket = self._tickets.pop(secret, None)
        if ticket is None:
            return "unknown ticket: it was used already, has expired, or its call has ended"
        if ticket.transport != transport:
            return f"a ticket for the {ticket.transport} data path, presented on the {transport} one"
        if time.monotonic() > ticket.expires:
            return "the ticket has expired"
        return ticket

    # -- tickets --------------------------------------------------------------------------

    def offers(self, transport: str) -> bool:
        return self.socket_path is not None if transport == "local" else self.data_port != 0

    def ticket(self, transport: str) -> Ticket:
        """A new ticket for a call that asked for ``transport`` (one this server :meth:`offers`)."""
        assert self.offers(transport), transport
        loop = asyncio.get_running_loop()
        secret = secrets.token_bytes(16)
        ticket = Ticket(secret, transport, time.monotonic() + CONNECT_SECONDS, loop.create_future(), loop, self)
        self._tickets[secret] = ticket
        return ticket

    def close(self) -> None:
        """Stop listening; remove the socket file."""
        self._closed = True
        self._reaper.stop()
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        self._listeners = []
        for ticket in list(self._tickets.values()):
            ticket.loop.call_soon_threadsafe(ticket.withdraw)
        if self.socket_path is not None:
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass


def _deliver(future: asyncio.Future, link: Link) -> None:
    if future.done():  # the call gave up meanwhile
        link.close()
    else:
        future.set_result(link)


def _reason(exc: BaseException) -> str:
    """The ``reason`` label of a handshake that failed with ``exc`` on its own thread."""
    if isinstance(exc, FrameTooLarge):
        return "oversized"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, (LinkClosed, ConnectionError)):
        return "closed"
    return "malformed"


def socket_path(config: Config) -> Path | None:
    """Where the same-host socket goes: ``config.socket`` ("off": none; empty: in the data directory)."""
    if config.socket.strip().lower() == "off":
        return None
    # Absolute: clients resolve it from their own working directory.
    return (Path(config.socket) if config.socket else config.data_dir / "tannery.sock").absolute()


def _answers(path: Path) -> bool:
    try:
        connect_unix(path, timeout=1.0).close()
    except OSError:
        return False
    return True


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot listen for data connections on {host}:{port}: {exc.strerror or exc} "
                      "(choose another port with --data-port or TANNERY_DATA_PORT: auto for a free one, or off "
                      "for none)") from None
    return listener


def _server_context(config: Config) -> ssl.SSLContext:
    """The TLS of the data port: the gRPC port's certificate, key and client CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=config.tls_client_ca)
    return context
