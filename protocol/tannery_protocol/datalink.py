"""Data connections: the framed conversation beside gRPC that moves a call's bytes.

Shared by the client and the server (no torch, no numpy). A :class:`Link` wraps a connected
socket: a Unix socket (frames may carry file descriptors, SCM_RIGHTS) or a TCP socket (plain
or TLS). Frames are a little-endian uint32 length and a ``tannery.v1.DataFrame``; raw payload
bytes follow the frames that say so (protos/tannery/v1/data.proto).

The gRPC call asks for a data path with the request metadata :data:`TRANSPORT_KEY` and gets
its ticket back in the initial metadata :data:`TICKET_KEY`.
"""

from __future__ import annotations

import array
import os
import select
import socket
import ssl
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .v1.data_pb2 import DataFrame

#: Request metadata of a Store, Fetch, Publish or Subscribe call: the data path it asks for ("local" or "tcp").
TRANSPORT_KEY = "tannery-transport"
#: Initial metadata of the server's answer: the hex ticket to present on the data connection.
TICKET_KEY = "tannery-ticket"
#: Data paths a call may ask for.
DATA_TRANSPORTS = ("local", "tcp")
#: The largest frame (not counting raw payload bytes after it): a frame carries names, a
#: prefix and block checksums (4 bytes per MiB of an entry, so 1 MiB covers 256 GiB).
MAX_FRAME = 4 << 20
#: The largest frame a peer may announce before its ticket is checked (a welcome or a hello:
#: a server id or a 16-byte ticket), so an unauthenticated peer makes nothing large be allocated.
MAX_HANDSHAKE_FRAME = 16 << 10
#: Most descriptors one frame carries.
MAX_FDS = 4
_LENGTH = struct.Struct("<I")
#: Seconds a client waits for each receive of the server's welcome (the server bounds the whole
#: handshake more tightly: tannery_server.dataplane.listeners.HANDSHAKE_SECONDS).
HANDSHAKE_SECONDS = 10.0
#: sun_path holds 108 bytes with its terminating NUL.
_SUN_PATH_MAX = 107


class LinkError(ConnectionError):
    """The data connection broke or its peer broke the protocol; the message says which."""


class LinkClosed(LinkError):
    """The peer closed the data connection before all it announced had come."""


class FrameTooLarge(LinkError):
    """The peer announced a frame over the limit; nothing was read or allocated for it."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"data connection: a frame of {length} bytes is over the limit of {limit}")
        self.length = length
        self.limit = limit


class Link:
    """One data connection, used by one thread at a time (blocking socket)."""

    def __init__(self, sock: socket.socket, local: bool) -> None:
        self.sock = sock
        #: A Unix socket: descriptors travel with frames.
        self.local = local
        self._fds: list[int] = []  # received with the bytes read so far, not yet taken
        self._closed = False
        #: Raw payload bytes that a frame announced are being sent: the peer reads whatever
        #: comes next as those bytes, so no frame (a failure) may be sent until they are out.
        self.in_payload = False

    # -- frames -------------------------------------------------------------------------

    def send(self, frame: DataFrame, fds: Sequence[int] = ()) -> None:
        """Send one frame, with ``fds`` attached (Unix sockets only)."""
        body = frame.SerializeToString()
        data = _LENGTH.pack(len(body)) + body
        if fds:
            if not self.local:
                raise ValueError("file descriptors travel over a Unix socket only")
            sent = socket.send_fds(self.sock, [data], list(fds))
            if sent < len(data):
                self.sock.sendall(memoryview(data)[sent:])
        else:
            self.sock.sendall(data)

    def receive(self, expect_fds: int = 0, limit: int = MAX_FRAME) -> tuple[DataFrame, list[int]]:
        """The next frame and the descriptors that came with it (``expect_fds`` of them at most).

        LinkError when the connection ends or the frame is malformed; FrameTooLarge, before
        anything is allocated for it, when its announced length is over ``limit``.
        """
        header = self.receive_exactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(header)
        if length > limit:
            raise FrameTooLarge(length, limit)
        body = self.receive_exactly(length)
        frame = DataFrame()
        try:
            frame.ParseFromString(bytes(body))
        except Exception as exc:  # protobuf's DecodeError
            raise LinkError(f"data connection: a frame that does not decode: {exc}") from None
        fds, self._fds = self._fds, []
        if len(fds) > expect_fds:
            for fd in fds:
                os.close(fd)
            raise LinkError(f"data connection: {len(fds)} file descriptors came with a {frame.WhichOneof('kind')} "
                            f"frame, which takes {expect_fds}")
        return frame, fds

    def receive_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        self.receive_into(memoryview(buffer))
        return buffer

    def receive_into(self, view: memoryview) -> None:
        """Fill ``view`` from the connection; LinkError when it ends first."""
        filled, size = 0, view.nbytes
        while filled < size:
            if self.local:
                got = self._receive_with_fds(view[filled:])
            else:
                got = self.sock.recv_into(view[filled:])
            if not got:
                raise LinkClosed(f"data connection closed by the peer after {filled} of {size} bytes")
            filled += got

    def _receive_with_fds(self, view: memoryview) -> int:
        fds = array.array("i")
        got, ancillary, flags, _ = self.sock.recvmsg_into([view], socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise LinkError("data connection: more file descriptors came than one frame carries")
        return got

    def send_bytes(self, data: memoryview | bytes) -> None:
        self.sock.sendall(data)

    def send_file(self, fd: int, offset: int, count: int) -> None:
        """Send bytes [offset, offset + count) of a file: ``sendfile`` on a plain socket (the
        kernel moves them), reads and writes through TLS. On a socket with a timeout, a peer
        that takes nothing for that long raises ``socket.timeout``, as ``sendall`` does."""
        if isinstance(self.sock, ssl.SSLSocket):
            window = 4 << 20
            buffer = memoryview(bytearray(min(window, count)))
            while count:
                piece = buffer[: min(window, count)]
                got = os.preadv(fd, [piece], offset)
                if not got:
                    raise LinkError(f"file ended {count} bytes early")
                self.sock.sendall(piece[:got])
                offset, count = offset + got, count - got
            return
        out = self.sock.fileno()
        timeout = self.sock.gettimeout()  # a socket with a timeout is non-blocking underneath
        while count:
            try:
                sent = os.sendfile(out, fd, offset, count)
            except BlockingIOError:
                if not select.select([], [out], [], timeout)[1]:
                    raise socket.timeout(f"sendfile: the peer took no byte for {timeout:g} s") from None
                continue
            if not sent:
                raise LinkError(f"file ended {count} bytes early")
            offset, count = offset + sent, count - sent

    # -- ending -------------------------------------------------------------------------

    def abort(self) -> None:
        """Break the connection now (a blocked send or receive in another thread returns)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.sock.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frame(**kind: object) -> DataFrame:
    """A DataFrame with one kind set: ``frame(hello=Hello(ticket=...))``."""
    return DataFrame(**kind)


def expect(received: DataFrame, *kinds: str) -> str:
    """The kind of a received frame; LinkError unless it is one of ``kinds`` (a failure frame
    raises LinkError with the server's message)."""
    kind = received.WhichOneof("kind")
    if kind == "failure" and "failure" not in kinds:
        raise PeerFailed(received.failure.code, received.failure.message)
    if kind not in kinds:
        raise LinkError(f"data connection: a {kind or 'empty'} frame where {' or '.join(kinds)} was expected")
    return kind


class PeerFailed(LinkError):
    """The server stopped the transfer and said why (its gRPC status says the same)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@contextmanager
def unix_address(path: str | os.PathLike[str]) -> Iterator[str]:
    """An address to bind or connect a Unix socket at ``path``, even one longer than
    sun_path's 107 bytes (through ``/proc/self/fd`` of its directory, open meanwhile)."""
    path = os.fspath(path)
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    parent = Path(path).parent
    fd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{Path(path).name}"
    finally:
        os.close(fd)


def connect_unix(path: str | os.PathLike[str], timeout: float | None = HANDSHAKE_SECONDS) -> Link:
    """A Link to the Unix socket at ``path``; OSError when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with unix_address(path) as address:
            sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return Link(sock, local=True)


def tune_tcp(sock: socket.socket) -> None:
    """Large socket buffers and no Nagle delay for a bulk TCP data connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
        except OSError:
            pass


__all__ = ["DATA_TRANSPORTS", "FrameTooLarge", "Link", "LinkClosed", "LinkError", "MAX_HANDSHAKE_FRAME", "PeerFailed",
           "TICKET_KEY", "TRANSPORT_KEY",
           "connect_unix", "expect", "frame", "tune_tcp", "unix_address"]
