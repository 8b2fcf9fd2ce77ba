"""A Store's payloads on a data connection (a worker thread; a blocking socket), written
to its :class:`~tannery_server.store_session.StoreSession` with the same plain calls as the
gRPC messages': checked header, limits, hashes, temporary blob, commit only on the gRPC
call's ``commit``.

Over TCP the payloads' bytes come as raw bytes after ``entry`` frames, received into a
few reused windows; on the same host as sealed memory files (``piece`` frames), mapped
and written from the mapping, or, for a small payload marked ``inline``, as over TCP.
"""

from __future__ import annotations

import os
import queue
import socket
import threading

from tannery_protocol.datalink import Link, expect, frame
from tannery_protocol.v1.data_pb2 import DataEnd, EntryBytes

from ..failures import Malformed
from ..store_session import StoreSession
from .links import close_all, sealed_map

#: Bytes a TCP Store receives at a time.
RECEIVE_WINDOW = 4 << 20
#: Receive buffers of a TCP Store: one fills (on a thread of its own) while the one before it
#: is written to the session (hashed and written), and one is spare.
RECEIVE_BUFFERS = 3


def receive_over(link: Link, session: StoreSession) -> None:
    """Give the session every entry the client sends, until its ``end`` (answered by ours)."""
    entries = 0
    buffers: list[memoryview] = []  # made at the first payload that comes as bytes
    while True:
        received, fds = link.receive(expect_fds=1 if link.local else 0)
        kind = expect(received, "entry", "end", "piece")
        if kind == "end":
            close_all(fds)
            end = received.end
            if end.entries != entries or end.payload_bytes != session.bytes_received:
                raise Malformed(f"the data connection's end says {end.entries} entries of {end.payload_bytes} "
                                f"payload bytes were sent, but {entries} entries of {session.bytes_received} "
                                "bytes arrived: nothing was stored")
            link.send(frame(end=DataEnd(entries=entries, payload_bytes=session.bytes_received)))
            return
        if kind == "piece":
            close_all(fds)
            raise Malformed("a piece before any entry on the data connection")
        entries += 1
        entry = received.entry
        session.begin_entry(entry.name, entry.sha256)
        if link.local and not entry.inline:
            _receive_pieces(link, session, entry)
            continue
        if not buffers:
            buffers += [memoryview(bytearray(RECEIVE_WINDOW)) for _ in range(RECEIVE_BUFFERS)]
        _receive_bytes(link, session, entry, buffers)


def _receive_bytes(link: Link, session: StoreSession, entry: EntryBytes, buffers: list[memoryview]) -> None:
    """Give the session an entry's raw bytes as they arrive. A payload of more than one window
    is received on another thread, so receiving the next window overlaps hashing and
    writing this one; a buffer is refilled once it was written (the payload writer reads
    nothing of it after)."""
    size = entry.payload_bytes
    if size <= RECEIVE_WINDOW:
        buffer = buffers[0][:size]
        link.receive_into(buffer)
        session.write(buffer)
        return
    free: queue.SimpleQueue = queue.SimpleQueue()
    for buffer in buffers:
        free.put(buffer)
    filled: queue.SimpleQueue = queue.SimpleQueue()
    receiver = threading.Thread(target=_receive_windows, args=(link, size, free, filled),
                                name="tannery-store-receive", daemon=True)
    receiver.start()
    left = size
    try:
        while left:
            got = filled.get()
            if isinstance(got, BaseException):
                raise got
            buffer, piece = got
            session.write(piece)
            left -= piece.nbytes
            free.put(buffer)
    except BaseException:
        free.put(None)  # a receiver waiting for a buffer stops
        _stop_receiving(link, receiver)
        raise
    receiver.join()


def _stop_receiving(link: Link, receiver: threading.Thread) -> None:
    """End a receiver inside ``recv`` and wait for it, so that the failure frame the caller
    sends next is the only use of the connection (a TLS connection is not to be read and
    written from two threads at once). The base class's shutdown: an SSLSocket's own would
    drop its TLS state, which that frame still needs."""
    try:
        socket.socket.shutdown(link.sock, socket.SHUT_RD)
    except OSError:
        pass  # not connected any more: the receiver has ended or is ending
    receiver.join(timeout=10)


def _receive_windows(link: Link, size: int, free: queue.SimpleQueue, filled: queue.SimpleQueue) -> None:
    """Receive ``size`` bytes window by window into the buffers ``free`` gives (None: stop),
    handing each ``(buffer, filled part)`` to ``filled``; a failure is handed over instead."""
    left = size
    try:
        while left:
            buffer = free.get()
            if buffer is None:
                return
            piece = buffer[: min(buffer.nbytes, left)]
            link.receive_into(piece)
            filled.put((buffer, piece))
            left -= piece.nbytes
    except BaseException as exc:
        filled.put(exc)


def _receive_pieces(link: Link, session: StoreSession, entry: EntryBytes) -> None:
    left = entry.payload_bytes
    while left:
        received, fds = link.receive(expect_fds=1)
        expect(received, "piece")
        if len(fds) != 1:
            close_all(fds)
            raise Malformed(f"entry {entry.name!r}: a piece came without its memory file")
        size = received.piece.size
        try:
            if size > left:  # before mapping it: a piece is mapped whole, its pages populated
                raise Malformed(f"entry {entry.name!r}: pieces of more than the {entry.payload_bytes} bytes "
                                "announced")
            mapped = sealed_map(fds[0], size, entry.name)
        finally:
            os.close(fds[0])
        session.write(memoryview(mapped))  # read whole when this returns
        left -= size
