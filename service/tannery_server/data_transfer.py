"""The bytes of a Store or Fetch on a data connection (worker threads; blocking sockets).

Fetch, same host (``local``): each entry is a file descriptor and a region of it. A stored
payload, whole or a row range, is its blob file itself: the client maps it and checks
the blocks that cover the region against the checksums sent with it before it hands out
a tensor. What the server computes (a cast, bool rows) goes into a memory file, filled
from blocks checked here.

Fetch over TCP: each entry is an ``entry`` frame and its payload's raw bytes, sent from
the blob file with ``sendfile`` after each batch of blocks is checked; a block that fails
its check breaks the connection (the call ends DATA_LOSS naming it), so no client ever
holds a corrupted tensor.

Store: the payloads' bytes come as raw bytes after ``entry`` frames (TCP) or as sealed
memory files (``piece`` frames, same host), and go through the same
:class:`~.store_session.StoreSession` as gRPC messages do: checked header, limits, hashes,
temporary blob, commit only on the gRPC call's ``commit``.
"""

from __future__ import annotations

import fcntl
import io
import mmap
import os
import queue
import socket
import ssl
import threading
from typing import Iterator, Sequence

from tannery_protocol.codec import read_info
from tannery_protocol.datalink import Link, LinkClosed, LinkError, expect, frame
from tannery_protocol.v1.data_pb2 import DataEnd, DataFailure, EntryBytes, MappedEntry
from tannery_protocol.wire import StoreMessage

from .failures import DataLoss, Failure, Malformed, Unavailable
from .fetching import Plan, open_planned, payload_pieces, read_blocks
from .storage import BlobInfo, Storage
from .storage.integrity import check_block
from .store_session import StoreSession

#: Bytes a cast converts at a time for a data path.
COMPUTE_WINDOW = 4 << 20
#: Blocks checked before each ``sendfile`` of a TCP Fetch.
SEND_BATCH_BLOCKS = 8
#: Bytes a TCP Store receives at a time.
RECEIVE_WINDOW = 4 << 20
#: Receive buffers of a TCP Store: one fills (on a thread of its own) while the one before it
#: is fed to the session (hashed and written), and one is spare.
RECEIVE_BUFFERS = 3
#: A sealed memory file of a local Store must not change, shrink or grow under the server.
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


#: What a data connection raises when it breaks (or its peer breaks the protocol): errors of
#: the connection, not of the storage, whatever OSError they derive from.
LINK_ERRORS = (ConnectionError, ssl.SSLError, TimeoutError)


def link_failure(transport: str, exc: BaseException) -> Failure:
    """The call's failure for a data connection that broke (one of :data:`LINK_ERRORS`): the
    peer leaving is Unavailable, a peer breaking the protocol Malformed."""
    if isinstance(exc, LinkError) and not isinstance(exc, LinkClosed):
        return Malformed(f"the {transport} {exc}")
    return Unavailable(f"the {transport} data connection broke: {exc}")


def fail(link: Link, failure: BaseException) -> None:
    """Tell the peer why the transfer stops, then break the connection. Best effort and never
    blocking (the call's status says it too): a peer whose buffer is full misses the frame.

    In the middle of an entry's raw bytes (TCP Fetch) the connection is only broken: the
    client would read a failure frame as tensor bytes (or as the payload's header)."""
    if isinstance(failure, Failure) and not link.in_payload:
        try:
            link.sock.settimeout(0.0)
            link.send(frame(failure=DataFailure(code=failure.code.name, message=str(failure))))
        except OSError:
            pass
    link.abort()


# -- Fetch ------------------------------------------------------------------------------------


def send_fetch(link: Link, storage: Storage, plans: Sequence[Plan]) -> int:
    """Send every planned entry, then ``end``; the payload bytes sent."""
    total = 0
    for plan in plans:
        what = f"entry {plan.entry.name!r}"
        blob, info = open_planned(storage, plan, what)
        try:
            send = _send_mapped if link.local else _send_bytes
            total += send(link, blob, info, plan, what)
        except DataLoss:
            storage.damaged(plan.entry.digest)
            raise
        finally:
            blob.close()
    link.send(frame(end=DataEnd(entries=len(plans), payload_bytes=total)))
    return total


def _as_stored(plan: Plan) -> bool:
    """Whether the entry's bytes are a region of its blob as stored (no cast, no bit shifting)."""
    return plan.target is None and (plan.prefix is None or not plan.source.is_bool)


def _has_file(blob) -> bool:
    """Whether the blob is a local file the data paths may pass or ``sendfile`` (an object in a
    bucket that is not in the local cache is not: its bytes are read and sent instead)."""
    try:
        blob.fileno()
    except io.UnsupportedOperation:
        return False
    return True


def _checked_pieces(blob, info: BlobInfo, plan: Plan, what: str) -> Iterator[memoryview]:
    """The entry's payload as the client gets it, from blocks each checked as it is read."""
    if plan.prefix is None:
        return read_blocks(blob, info, plan.start, plan.stop, what)
    return payload_pieces(blob, info, plan, what, COMPUTE_WINDOW)


def _send_mapped(link: Link, blob, info: BlobInfo, plan: Plan, what: str) -> int:
    """One entry as a descriptor: its blob file (a region of it), or a memory file the server filled."""
    if _as_stored(plan) and _has_file(blob):
        first = plan.start // info.block_size
        last = max(first, -(-plan.stop // info.block_size))
        entry = MappedEntry(
            name=plan.entry.name, prefix=plan.prefix or b"", offset=plan.start, length=plan.stop - plan.start,
            digest=info.digest, file_size=info.size, block_size=info.block_size, first_block=first,
            block_crcs=info.block_crcs[4 * first : 4 * last], checksum=info.checksum,
        )
        link.send(frame(mapped=entry), [blob.fileno()])
        return len(entry.prefix) + entry.length
    memory = os.memfd_create(f"tannery-{plan.entry.digest[:12]}", os.MFD_CLOEXEC)
    try:
        size = 0
        for piece in _checked_pieces(blob, info, plan, what):
            size += piece.nbytes
            while piece.nbytes:
                piece = piece[os.write(memory, piece):]
        link.send(frame(mapped=MappedEntry(name=plan.entry.name, offset=0, length=size, digest=info.digest,
                                           file_size=size)), [memory])
        return size
    finally:
        os.close(memory)


def _send_bytes(link: Link, blob, info: BlobInfo, plan: Plan, what: str) -> int:
    """One entry as an ``entry`` frame and its payload's bytes."""
    link.in_payload = True  # from the entry frame on, until its last byte is out
    size = _send_payload(link, blob, info, plan, what)
    link.in_payload = False
    return size


def _send_payload(link: Link, blob, info: BlobInfo, plan: Plan, what: str) -> int:
    if plan.prefix is None:  # the whole payload as stored: from the file, each batch checked first
        link.send(frame(entry=EntryBytes(name=plan.entry.name, payload_bytes=info.size)))
        _send_checked(link, blob, info, 0, info.size, what)
        return info.size
    size = read_info(plan.prefix).size
    link.send(frame(entry=EntryBytes(name=plan.entry.name, payload_bytes=size)))
    if _as_stored(plan):  # rows: a new prefix, then a region of the file
        link.send_bytes(plan.prefix)
        _send_checked(link, blob, info, plan.start, plan.stop, what)
        return size
    sent = 0
    for piece in payload_pieces(blob, info, plan, what, COMPUTE_WINDOW):
        link.send_bytes(piece)
        sent += piece.nbytes
    if sent != size:
        raise AssertionError(f"{what}: {sent} bytes made for a payload of {size}")
    return size


def _send_checked(link: Link, blob, info: BlobInfo, start: int, stop: int, what: str) -> None:
    """Bytes [start, stop) of the blob, each batch of covering blocks checked before it is sent."""
    if start == stop:
        return
    if not _has_file(blob):
        for piece in read_blocks(blob, info, start, stop, what):
            link.send_bytes(piece)
        return
    block = info.block_size
    with mmap.mmap(blob.fileno(), info.size, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            first, end = start // block, -(-stop // block)
            for batch in range(first, end, SEND_BATCH_BLOCKS):
                last = min(end, batch + SEND_BATCH_BLOCKS)
                for index in range(batch, last):
                    # Released at once, even when the check fails: a slice a traceback keeps
                    # would make closing the map fail (BufferError) in place of the DataLoss.
                    with view[index * block : min((index + 1) * block, info.size)] as data:
                        check_block(what, info, index, data)
                lo, hi = max(start, batch * block), min(stop, last * block)
                link.send_file(blob.fileno(), lo, hi - lo)
        finally:
            view.release()


# -- Store ------------------------------------------------------------------------------------


def receive_store(link: Link, session: StoreSession) -> None:
    """Feed the session every entry the client sends, until its ``end`` (answered by ours)."""
    entries = 0
    buffers = [] if link.local else [memoryview(bytearray(RECEIVE_WINDOW)) for _ in range(RECEIVE_BUFFERS)]
    while True:
        received, fds = link.receive(expect_fds=1 if link.local else 0)
        kind = expect(received, "entry", "end", "piece")
        if kind == "end":
            _close_all(fds)
            end = received.end
            if end.entries != entries or end.payload_bytes != session.bytes_received:
                raise Malformed(f"the data connection's end says {end.entries} entries of {end.payload_bytes} "
                                f"payload bytes were sent, but {entries} entries of {session.bytes_received} "
                                "bytes arrived: nothing was stored")
            link.send(frame(end=DataEnd(entries=entries, payload_bytes=session.bytes_received)))
            return
        if kind == "piece":
            _close_all(fds)
            raise Malformed("a piece before any entry on the data connection")
        entries += 1
        entry = received.entry
        session.feed(StoreMessage(None, entry.name, memoryview(b""), 0, sha256=entry.sha256))
        if link.local:
            _receive_pieces(link, session, entry)
        else:
            _receive_bytes(link, session, entry, buffers)


def _receive_bytes(link: Link, session: StoreSession, entry: EntryBytes, buffers: list[memoryview]) -> None:
    """Feed the session an entry's raw bytes as they arrive. A payload of more than one window
    is received on another thread, so receiving the next window overlaps hashing and
    writing this one; a buffer is refilled once it was fed (the payload writer reads
    nothing of it after)."""
    size = entry.payload_bytes
    if size <= RECEIVE_WINDOW:
        buffer = buffers[0][:size]
        link.receive_into(buffer)
        session.feed(StoreMessage(None, "", buffer, size))
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
            session.feed(StoreMessage(None, "", piece, piece.nbytes))
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
            _close_all(fds)
            raise Malformed(f"entry {entry.name!r}: a piece came without its memory file")
        size = received.piece.size
        try:
            mapped = _sealed_map(fds[0], size, entry.name)
        finally:
            os.close(fds[0])
        if size > left:
            raise Malformed(f"entry {entry.name!r}: pieces of more than the {entry.payload_bytes} bytes announced")
        session.feed(StoreMessage(None, "", memoryview(mapped), size))  # read whole when this returns
        left -= size


def _sealed_map(fd: int, size: int, name: str) -> mmap.mmap:
    """A read-only map of a memory file the client can no longer change; Malformed otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise Malformed(f"entry {name!r}: a piece's memory file is not sealed against writes and resizing "
                        "(F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW)")
    actual = os.fstat(fd).st_size
    if actual != size or size == 0:
        raise Malformed(f"entry {name!r}: a piece of {size} bytes in a memory file of {actual}")
    # Mapped in one call (the pages are the client's, already there), not one fault per 4 KiB.
    return mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | _MAP_POPULATE)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


__all__ = ["LINK_ERRORS", "LinkError", "fail", "link_failure", "receive_store", "send_fetch"]
