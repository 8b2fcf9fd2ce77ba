"""The data connections of the same-host and TCP transports: reaching them, and the bytes moved on them.

A :class:`Route` says where the server's data path is ("local": its Unix socket; "tcp": its
data port) and opens a connection the server has welcomed as itself; a call then presents
its one-time ticket (:func:`connect_call`). The rest moves a call's bytes on that
connection: the entries of a Fetch (:func:`receive_fetch`: mapped files, or received straight
into the tensors' memory), the payloads of a Store (:func:`send_store`) and of a
Publish (:func:`publish_over`), and a subscription's payloads on a data path
(:func:`next_published`). Every function here blocks: the asyncio client runs them on worker
threads. Which transport a call takes is :mod:`tannery.dataplane.transports`' choice.
"""

from __future__ import annotations

import mmap
import os
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from tannery_protocol import checksums, errors
from tannery.dataplane import receive_memory
from tannery_protocol.codec import DIM, FIXED_PREFIX, HEADER, METADATA, FormatError, parse, read_info
from tannery_protocol.datalink import (
    HANDSHAKE_SECONDS, MAX_HANDSHAKE_FRAME, Link, LinkError, PeerFailed, connect_unix, expect, frame, tune_tcp,
)
from tannery.dataplane.gathering import receive_buffer
from tannery.dataplane.memory_files import MemoryFiles, new_file
from tannery.dataplane.received import Arrived, TensorPiece
from tannery_protocol.v1.data_pb2 import DataEnd, EntryBytes, Hello, SealedPiece, Taken

if TYPE_CHECKING:
    from tannery.rpc.connection import TLS
    from tannery.rpc.requests import Progress

#: Bytes of one sealed memory file of a local Store (the server hashes one while the next fills).
STORE_PIECE = 32 << 20
#: Bytes sent between two reports to a Store's ``progress`` (a bar moves, and shows a rate).
PROGRESS_STEP = 1 << 20
#: Bytes of one piece of a TCP Fetch read as pieces (``fetch_pieces``): only these are held.
RECEIVE_PIECE = 4 << 20
#: madvise advice that maps a range's pages in for reading (Linux 5.14; the mmap module may lack the name).



@dataclass(frozen=True)
class Route:
    """How to reach the server's data path: its kind ("local" or "tcp") and address."""

    kind: str
    server_id: str
    socket_path: str = ""
    host: str = ""
    port: int = 0
    tls: "TLS | None" = None

    def describe(self) -> str:
        return f"socket {self.socket_path}" if self.kind == "local" else f"data port {self.host}:{self.port}"

    def open(self, timeout: float | None = HANDSHAKE_SECONDS) -> Link:
        """A connection that the server has welcomed as itself (LinkError or OSError otherwise)."""
        link = connect_unix(self.socket_path, timeout) if self.kind == "local" else self._connect_tcp(timeout)
        try:
            welcome, _ = link.receive(limit=MAX_HANDSHAKE_FRAME)
            expect(welcome, "welcome")
            if welcome.welcome.server_id != self.server_id:
                raise LinkError(f"another server answers on the {self.describe()} (its id differs from the one "
                                "the gRPC port gave)")
            link.sock.settimeout(None)
        except BaseException:
            link.close()
            raise
        return link

    def connect(self, ticket: str) -> Link:
        """A connection for one call: welcomed, and the call's ticket presented."""
        link = self.open()
        try:
            link.send(frame(hello=Hello(ticket=bytes.fromhex(ticket))))
        except BaseException:
            link.close()
            raise
        return link

    def _connect_tcp(self, timeout: float | None) -> Link:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            tune_tcp(sock)
            if self.tls is not None:
                sock = _client_context(self.tls).wrap_socket(sock, server_hostname=self.tls.server_name or self.host)
        except BaseException:
            sock.close()
            raise
        return Link(sock, local=False)


def _client_context(tls: "TLS") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=os.fspath(tls.ca) if tls.ca is not None else None)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(os.fspath(tls.cert), os.fspath(tls.key))
    return context




# -- Fetch ------------------------------------------------------------------------------------


def receive_fetch(link: Link, pieces: bool = False, pool: "receive_memory.ReceivePool | None" = None
                  ) -> Iterator[object]:
    """The entries a Fetch sends on ``link``, as :class:`Arrived` (or, with ``pieces`` on a TCP
    link, as :class:`~tannery.dataplane.received.TensorPiece`\\ s, so that only one piece is held); a TCP
    entry is received into one of ``pool``'s maps when it has one that fits."""
    entries = total = 0
    while True:
        received, fds = link.receive(expect_fds=1 if link.local else 0)
        kind = expect(received, "end", "mapped", "entry") if link.local else expect(received, "end", "entry")
        if kind == "end":
            end: DataEnd = received.end
            if end.entries != entries or end.payload_bytes != total:
                raise LinkError(f"data connection: the server says it sent {end.entries} entries of "
                                f"{end.payload_bytes} bytes, {entries} of {total} arrived")
            return
        entries += 1
        if kind == "mapped":
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise LinkError(f"data connection: entry {received.mapped.name!r} came without its file")
            try:
                arrived = _mapped(received.mapped, fds[0])
            finally:
                os.close(fds[0])
            total += len(received.mapped.prefix) + received.mapped.length
            yield arrived
            continue
        for fd in fds:  # an entry's bytes come on the connection: a file passed with it is not used
            os.close(fd)
        if pieces:
            total += received.entry.payload_bytes
            yield from _received_pieces(link, received.entry)
        else:
            total += received.entry.payload_bytes
            yield _received(link, received.entry, pool)


#: Payloads of a same-host Store smaller than this go on the connection itself (``inline``): a
#: memory file for each would cost more than its bytes.
INLINE_BELOW = 1 << 20

#: Regions of a same-host Fetch smaller than this are copied out of their map, which is closed
#: at once (:func:`_copied`); larger ones stay views of the blob file.
COPY_BELOW = 1 << 20


def _mapped(entry, fd: int) -> Arrived:
    """An entry from the region of a file: mapped privately (the tensor may be written; the file
    never is), its covering blocks checked first."""
    what = f"entry {entry.name!r}"
    start, stop = entry.offset, entry.offset + entry.length
    if entry.block_crcs:
        map_start = entry.first_block * entry.block_size
        map_stop = min(entry.file_size, map_start + len(entry.block_crcs) // 4 * entry.block_size)
    else:
        map_start, map_stop = 0, stop
    map_start -= map_start % mmap.ALLOCATIONGRANULARITY
    if not map_start <= start <= stop <= map_stop:
        raise LinkError(f"data connection: {what}: region [{start}, {stop}) outside the checked blocks")
    if map_stop == map_start:
        region = memoryview(bytearray(0))
    else:
        mapped = mmap.mmap(fd, map_stop - map_start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=map_start)
        _populate(mapped)
        region = memoryview(mapped)
        if entry.block_crcs:
            first = entry.first_block * entry.block_size - map_start
            bad = checksums.first_bad_block(region[first:], entry.block_size, entry.block_crcs, entry.checksum,
                                            entry.first_block)
            if bad is not None:
                raise coded(errors.DataLoss, "DATA_LOSS", checksums.corrupted_message(what, entry.digest, bad))
        if stop - start < COPY_BELOW:
            region = _copied(mapped, region, start - map_start, stop - map_start)
        else:
            region = region[start - map_start : stop - map_start]
    try:
        if entry.prefix:
            info = read_info(entry.prefix)
            if info is None or info.nbytes != entry.length:
                raise FormatError(f"a prefix for {info.nbytes if info else '?'} bytes before {entry.length}")
            return Arrived(entry.name, info, region)
        info = parse(region)
    except FormatError as exc:
        raise FormatError(f"Fetch: {what}: {exc}") from None
    return Arrived(entry.name, info, region[info.data_offset :])


def _copied(mapped: mmap.mmap, view: memoryview, start: int, stop: int) -> memoryview:
    """Bytes [start, stop) of a checked map, copied out, and the map closed: every live map holds
    an open descriptor of its own (Python's mmap keeps one), so a tensor that viewed the map of
    each of a fetch's thousands of small entries (a pack's) would run the process out of them."""
    copied = memoryview(bytearray(view[start:stop]))
    view.release()
    mapped.close()
    return copied


def _populate(mapped: mmap.mmap) -> None:
    """Map the file's pages in at once, read-only: the block check reads them all next."""
    receive_memory.populate_read(mapped)


def _receive_prefix(link: Link, size: int, name: str) -> bytearray:
    """A payload's header, metadata and shape, read off the connection."""
    prefix = link.receive_exactly(min(size, FIXED_PREFIX))
    try:
        if len(prefix) == FIXED_PREFIX and read_info(prefix) is None:
            rank = METADATA.unpack_from(prefix, HEADER.size)[3]
            prefix += link.receive_exactly(min(size - FIXED_PREFIX, DIM.size * rank))
        info = read_info(prefix)
        if info is None or info.size != size:
            raise FormatError(f"a payload of {size} bytes whose header says "
                              f"{info.size if info else 'too little'}")
    except FormatError as exc:
        raise FormatError(f"Fetch: entry {name!r}: {exc}") from None
    return prefix


def _received(link: Link, entry: EntryBytes, pool: "receive_memory.ReceivePool | None" = None) -> Arrived:
    """A payload received in one aligned buffer, which the tensor then shares."""
    prefix = _receive_prefix(link, entry.payload_bytes, entry.name)
    info = read_info(prefix)
    buffer = receive_buffer(entry.payload_bytes, info.data_offset, pool)
    buffer[: len(prefix)] = prefix
    rest = buffer[len(prefix) :]
    with receive_memory.faulting_in_behind(rest):
        link.receive_into(rest)
    return Arrived(entry.name, info, buffer[info.data_offset :])


def _received_pieces(link: Link, entry: EntryBytes) -> Iterator[object]:
    prefix = _receive_prefix(link, entry.payload_bytes, entry.name)
    info = read_info(prefix)
    offset = 0
    if info.nbytes == 0:
        yield TensorPiece(entry.name, info, 0, memoryview(b""), True, True)
        return
    while offset < info.nbytes:
        piece = memoryview(bytearray(min(RECEIVE_PIECE, info.nbytes - offset)))
        link.receive_into(piece)
        yield TensorPiece(entry.name, info, offset, piece, offset == 0, offset + piece.nbytes == info.nbytes)
        offset += piece.nbytes


# -- Store ------------------------------------------------------------------------------------


def send_store(link: Link, entries: Iterable[tuple[str, list, bytes]], progress: "Progress" = None,
               inline: bool = False) -> tuple[int, int]:
    """Send each ``(name, payload parts, SHA-256 or empty)`` on ``link``, then ``end``, and wait
    for the server's ``end``; returns the entries and payload bytes sent. ``inline`` (a server
    that reads them): payloads under :data:`INLINE_BELOW` go on a same-host connection itself."""
    count = total = 0
    for name, parts, sha256 in entries:
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(view.nbytes for view in views)
        inlined = link.local and inline and size < INLINE_BELOW
        link.send(frame(entry=EntryBytes(name=name, payload_bytes=size, sha256=sha256, inline=inlined)))
        if link.local and not inlined:
            for piece in _pieces(views, STORE_PIECE):
                _send_sealed(link, piece, name, progress)
        else:
            for step in _pieces(views, PROGRESS_STEP):
                for view in step:
                    link.send_bytes(view)
                if progress is not None:
                    progress(sum(view.nbytes for view in step))
        count += 1
        total += size
    link.send(frame(end=DataEnd(entries=count, payload_bytes=total)))
    answer, _ = link.receive()
    expect(answer, "end")
    return count, total


def _pieces(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """The views cut into consecutive lists of at most ``size`` bytes."""
    batch: list[memoryview] = []
    room = size
    for view in views:
        while view.nbytes:
            take = view[:room]
            batch.append(take)
            view, room = view[take.nbytes :], room - take.nbytes
            if not room:
                yield batch
                batch, room = [], size
    if batch:
        yield batch


def _send_sealed(link: Link, views: list[memoryview], name: str, progress: "Progress" = None,
                 files: "MemoryFiles | None" = None) -> None:
    """Write ``views`` into a new memory file (one ``files`` made ready, when it has one),
    seal it against any change, and pass it on (``progress`` hears of every
    :data:`PROGRESS_STEP` written)."""
    import fcntl

    size = sum(view.nbytes for view in views)
    fd = files.take(name, size) if files is not None else new_file(f"store-{name}", size)
    try:
        offset = 0
        for view in views:
            while view.nbytes:
                written = os.pwrite(fd, view[:PROGRESS_STEP], offset)
                view, offset = view[written:], offset + written
                if progress is not None:
                    progress(written)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        link.send(frame(piece=SealedPiece(size=size)), [fd])
    finally:
        os.close(fd)


# -- Channels ---------------------------------------------------------------------------------


def publish_over(link: Link, tensors: Iterable[object], progress: "Progress" = None,
                 files: "MemoryFiles | None" = None) -> tuple[int, int]:
    """Send each tensor's payload: one sealed memory file on the same host, an ``entry`` frame
    and the payload's bytes (from the tensor's own memory) over TCP; then ``end``, and wait for
    the server's ``end``. Returns the payloads and bytes published. With ``files``, the memory
    files come from those made ready, and files of these sizes are made ready for the next call."""
    from tannery import torch as torch_codec
    from tannery.values import as_tensor

    count = total = 0
    sizes: list[int] = []
    for index, tensor in enumerate(tensors):
        tensor = as_tensor(tensor, f"tensor {index}", "Client.publish")
        views = [memoryview(part).cast("B") for part in torch_codec.serialize_parts(tensor)]
        size = sum(view.nbytes for view in views)
        if link.local:
            _send_sealed(link, views, "publish", files=files)
            sizes.append(size)
        else:
            link.send(frame(entry=EntryBytes(payload_bytes=size)))
            for view in views:
                link.send_bytes(view)
        count, total = count + 1, total + size
        if progress is not None:
            progress(size)
    link.send(frame(end=DataEnd(entries=count, payload_bytes=total)))
    answer, _ = link.receive()
    expect(answer, "end")
    if files is not None:
        files.expect(sizes)
    return count, total


def next_published(link: Link, reader: object) -> list:
    """The tensors the next frame of a data-path subscription completes (a mapped payload, on
    the same host, is one, acknowledged at once; pieces that come as bytes are gathered by
    ``reader``, a :class:`~tannery.dataplane.readers.PayloadReader`, received straight into the payload's
    buffer)."""
    received, fds = link.receive(expect_fds=1 if link.local else 0)
    kind = expect(received, "mapped", "entry", "abandoned") if link.local else expect(received, "entry", "abandoned")
    if kind == "mapped":
        if len(fds) != 1:
            raise LinkError("data connection: a published payload came without its memory file")
        try:
            arrived = _mapped(received.mapped, fds[0])
        finally:
            os.close(fds[0])
        link.send(frame(taken=Taken(payloads=1)))
        return [reader.arrived(arrived)]
    for fd in fds:  # an entry's bytes come on the connection: a file passed with it is not used
        os.close(fd)
    if kind == "abandoned":
        reader.discard()
        return []
    return reader.receive(received.entry.payload_bytes, link.receive_into)


def connect_call(route: Route, ticket: str) -> Link:
    """A call's data connection; Unavailable at once when it cannot be made (the caller then
    cancels the call: the server would answer only when its wait for the connection ends)."""
    try:
        return route.connect(ticket)
    except (LinkError, OSError) as exc:
        raise link_failure(exc, route) from None


def link_failure(exc: BaseException, route: Route) -> errors.ServiceError:
    """The client's error for a data connection that broke (when the call's status says nothing more)."""
    if isinstance(exc, PeerFailed) and exc.code == "PERMISSION_DENIED":
        return coded(errors.PermissionDenied, exc.code, f"the server refused the data connection: {exc.message}")
    return coded(errors.Unavailable, "UNAVAILABLE", f"the data connection ({route.describe()}) broke: {exc}")


def coded(kind: type[errors.ServiceError], code: str, message: str) -> errors.ServiceError:
    """A service error raised by the client itself, carrying ``.code`` as those made from a
    call's status do (:func:`tannery.rpc.connection.service_error`)."""
    error = kind(message)
    error.code = code  # type: ignore[attr-defined]
    return error


__all__ = ["Route", "coded", "connect_call", "link_failure", "next_published", "publish_over", "receive_fetch", "send_store"]
