"""Fetch: every ask checked against the catalog first, then entries streamed from their blobs.

Checking (:func:`plan_fetch`) reads the catalog only and raises the archive issue's
messages. Streaming (:class:`FetchStream`) runs in a worker thread and yields encoded
``FetchResponse`` messages of exactly ``chunk_size`` bytes of payload (the last of each
entry shorter), verifying what it serves:

every byte sent comes from a block (1 MiB) checked against the CRC-32 recorded when it
was stored, and no message leaves before the blocks it holds are checked, so a corrupted
blob is DATA_LOSS and none of its corrupted bytes is served. A whole entry reads every
block; a row range reads only the blocks that cover it. (The SHA-256 that names a blob is
checked on demand by :meth:`Storage.scrub`, not on every read: it costs twice the CRCs.)

Memory stays bounded: a float cast converts one window of elements at a time.
"""

from __future__ import annotations

import io
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from tannery_protocol import mismatches
from tannery_protocol.codec import DTYPES, DType, encode_prefix
from tannery_protocol.v1 import archives_pb2

from .failures import DataLoss, Malformed, Mismatch, Missing
from .storage import BlobFile, BlobInfo, EntryRecord, Storage
from .storage.integrity import BlockCheck, check_block
from tannery_protocol.wire import encode_fetch_response, encode_varint, split_parts

@dataclass(frozen=True)
class Plan:
    """How to serve one entry: which bytes of its blob, changed how, checked how."""

    entry: EntryRecord
    #: Header, metadata and shape to send first; None to send the stored payload as it is.
    prefix: bytes | None
    #: The stored bytes [start, stop) to send after the prefix.
    start: int
    stop: int
    #: Convert elements from ``source`` to ``target`` (None: send bytes as stored).
    source: DType
    target: DType | None = None
    #: For bool rows: bits to drop at the start of the range and bits to send.
    skip_bits: int = 0
    send_bits: int = 0
    #: Verify by block checksums (row ranges) instead of the whole digest.
    blob: BlobInfo | None = None


def _dtype_asked(what: str, name: str, field: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise Malformed(f"{what}: unknown dtype {name!r} in {field}; known: {', '.join(DTYPES)}") from None


def check_request(request: archives_pb2.FetchRequest) -> None:
    """Request-level errors, found before the catalog is read."""
    for ask in request.entries:
        what = "Archive.float" if ask.cast else "Archive.tensor"
        if not ask.name:
            raise Malformed(f"{what}: an ask with an empty entry name")
        if ask.dtype:
            _dtype_asked(what, ask.dtype, "dtype")
        if ask.cast:
            target = _dtype_asked(what, ask.cast, "cast")
            if not target.is_float:
                raise Malformed(f"Archive.float: {ask.cast} is not {mismatches.FLOATS_TEXT}")
        if ask.HasField("rows") and ask.rows.start > ask.rows.stop:
            raise Malformed(
                f"{what}: {ask.name}: rows [{ask.rows.start}, {ask.rows.stop}): start is after stop"
            )


def plan_entry(ask: archives_pb2.EntryAsk, entry: EntryRecord | None, blob: BlobInfo | None = None) -> Plan:
    """Check one ask against its catalog entry; Mismatch or Missing with the archive issue's message."""
    what = "Archive.float" if ask.cast else "Archive.tensor"
    if entry is None:
        raise Missing(mismatches.no_entry(what, ask.name))
    shape = entry.shape
    stored = DTYPES[entry.dtype]
    if ask.HasField("shape") and tuple(ask.shape.dims) != shape:
        raise Mismatch(mismatches.shape_differs(what, entry.name, shape, ask.shape.dims))
    if ask.dtype and ask.dtype != entry.dtype:
        raise Mismatch(mismatches.dtype_differs(what, entry.name, entry.dtype, ask.dtype))
    target = None
    if ask.cast:
        if not stored.is_float:
            raise Mismatch(mismatches.not_float("Archive.float", entry.name, entry.dtype))
        if ask.cast != entry.dtype:
            target = DTYPES[ask.cast]
    out_dtype = target or stored
    if not ask.HasField("rows"):
        if target is None:
            return Plan(entry, None, 0, entry.payload_bytes, stored)
        return Plan(entry, encode_prefix(target, shape), entry.data_offset, entry.payload_bytes, stored, target)

    start, stop = ask.rows.start, ask.rows.stop
    if not shape:
        raise Mismatch(mismatches.rows_of_scalar(what, entry.name, start, stop))
    if stop > shape[0]:
        raise Mismatch(mismatches.rows_past_end(what, entry.name, start, stop, shape))
    assert blob is not None, "row ranges need the blob's block checksums"
    row_elements = math.prod(shape[1:])
    prefix = encode_prefix(out_dtype, (stop - start, *shape[1:]))
    if stored.is_bool:
        first_bit, last_bit = start * row_elements, stop * row_elements
        return Plan(
            entry, prefix, entry.data_offset + first_bit // 8, entry.data_offset + (last_bit + 7) // 8, stored,
            skip_bits=first_bit % 8, send_bits=last_bit - first_bit, blob=blob,
        )
    row_bytes = row_elements * stored.itemsize
    return Plan(
        entry, prefix, entry.data_offset + start * row_bytes, entry.data_offset + stop * row_bytes, stored, target,
        blob=blob,
    )


def resolve(storage: Storage, request: archives_pb2.FetchRequest) -> list[Plan]:
    """The plans of a request, their blobs pinned (release ``digests(plans)`` afterwards).

    Missing for a missing archive or entry, Mismatch for an entry that is not what is asked.
    """
    catalog = storage.catalog

    def lookup() -> list[Plan]:
        if catalog.archive(request.archive) is None:
            raise Missing(f"archive {request.archive!r} not found")
        if not request.entries:
            entries = catalog.entries_under(request.archive, request.prefix)
            if request.prefix and not entries:
                raise Missing(f"archive {request.archive!r}: no entry under prefix {request.prefix!r}")
            return [Plan(e, None, 0, e.payload_bytes, DTYPES[e.dtype]) for e in entries]
        found = catalog.entries(request.archive, [ask.name for ask in request.entries])
        plans = []
        for ask in request.entries:
            entry = found.get(ask.name)
            blob = catalog.blob(entry.digest) if entry is not None and ask.HasField("rows") else None
            plans.append(plan_entry(ask, entry, blob))
        return plans

    return storage.pinned(lookup, digests)


def digests(plans: Iterable[Plan]) -> list[str]:
    return [p.entry.digest for p in plans]


class FetchStream:
    """The encoded response messages of a fetch, produced by a worker thread in batches.

    It knows its end: the batch that holds the last message says so (:attr:`done`), and
    the stream has closed its blob and released its pins by then, so a fetch that fits in
    one batch takes one trip to a worker thread (:meth:`open`), resolving included.
    """

    def __init__(self, storage: Storage, plans: Sequence[Plan], chunk_size: int) -> None:
        self.storage = storage
        self.plans = plans
        self.chunk_size = chunk_size
        self.done = False
        self._messages = self._all()
        self._next: bytes | None = None  # a message read to learn whether the stream ends
        self._error: Exception | None = None  # raised once the messages before it are out
        self._released = False

    @classmethod
    def open(cls, storage: Storage, request: archives_pb2.FetchRequest, chunk_size: int, max_bytes: int
             ) -> tuple["FetchStream", list[bytes]]:
        """Resolve a request (pinning its blobs) and produce the first batch, in one go."""
        stream = cls(storage, resolve(storage, request), chunk_size)
        try:
            return stream, stream.next_batch(max_bytes)
        except BaseException:
            stream.close()
            raise

    def next_batch(self, max_bytes: int) -> list[bytes]:
        """The next messages, about ``max_bytes`` of them; the last batch sets :attr:`done`
        and closes the stream. A failure is raised after the messages before it were
        returned (by the next call, if this batch has some)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        batch: list[bytes] = []
        size = 0
        if self._next is not None:
            batch.append(self._next)
            size, self._next = len(self._next), None
        try:
            for message in self._messages:
                if size >= max_bytes:
                    self._next = message
                    return batch
                batch.append(message)
                size += len(message)
        except Exception as error:
            if not batch:
                raise
            self._error = error
            return batch
        self.close()
        return batch

    def close(self) -> None:
        """Stop reading (closing the blob being read) and unpin the blobs; idempotent."""
        self.done = True
        self._next = None
        self._messages.close()
        if not self._released:
            self._released = True
            self.storage.release(digests(self.plans))

    def _all(self) -> Iterator[bytes]:
        for plan in self.plans:
            yield from self._entry(plan)

    def _entry(self, plan: Plan) -> Iterator[bytes]:
        what = f"entry {plan.entry.name!r}"
        blob, info = open_planned(self.storage, plan, what)
        try:
            if plan.prefix is None:
                yield from _whole_payload(blob, plan.entry, info, self.chunk_size, what)
                return
            # Each block is checked as it is read, before any of its bytes reach a message.
            yield from _messages(plan.entry.name, payload_pieces(blob, info, plan, what, self.chunk_size),
                                 self.chunk_size)
        except DataLoss:
            self.storage.damaged(plan.entry.digest)
            raise
        finally:
            blob.close()


def open_planned(storage: Storage, plan: Plan, what: str) -> tuple[BlobFile, BlobInfo]:
    """The open blob of a pinned entry and its checksums; DataLoss when the blob is missing,
    of another size than was stored, or without checksums. The caller closes the blob."""
    try:
        blob = storage.open_blob(plan.entry.digest, plan.entry.payload_bytes)
    except FileNotFoundError:
        raise DataLoss(f"{what}: stored blob {plan.entry.digest} is missing") from None
    try:
        if blob.size != plan.entry.payload_bytes:
            raise DataLoss(f"{what}: stored blob {plan.entry.digest} has {blob.size} bytes, "
                           f"{plan.entry.payload_bytes} were stored")
        info = plan.blob or storage.catalog.blob(plan.entry.digest)
        if info is None:
            raise DataLoss(f"{what}: stored blob {plan.entry.digest} has no checksums in the catalog")
    except BaseException:
        blob.close()
        raise
    return blob, info


def payload_pieces(blob: BlobFile, info: BlobInfo, plan: Plan, what: str, window: int) -> Iterator[memoryview]:
    """The payload of a plan with a new prefix (rows, a cast): the prefix, then the bytes made
    from blocks each checked as it is read (a cast converts ``window`` bytes at a time)."""
    yield memoryview(plan.prefix)
    pieces = read_blocks(blob, info, plan.start, plan.stop, what)
    if plan.source.is_bool and plan.blob is not None:
        pieces = _shift_bits(pieces, plan.skip_bits, plan.send_bits)
    elif plan.target is not None:
        pieces = _cast(pieces, plan.source, plan.target, window)
    yield from pieces


def _messages(name: str, pieces: Iterable[memoryview], chunk_size: int) -> Iterator[bytes]:
    """Messages of exactly ``chunk_size`` payload bytes (the last shorter), the first naming the entry."""
    first = True
    for parts in split_parts(pieces, chunk_size):
        yield encode_fetch_response(name if first else None, parts)
        first = False
    if first:  # no bytes at all: the entry is still announced
        yield encode_fetch_response(name, [])


def _whole_payload(blob: BlobFile, entry: EntryRecord, info: BlobInfo, chunk_size: int, what: str) -> Iterator[bytes]:
    """An entry's payload as stored, the fast path: each chunk is read from the file straight
    into the ``bytes`` gRPC sends, behind its message's framing (:func:`_new_message`: one
    copy), and checked there. A message is sent only once every block it holds has matched
    its CRC-32 (with chunks of whole blocks, at once; smaller chunks wait for the end of
    their block)."""
    check = BlockCheck(what, info)
    held: deque[tuple[int, bytes]] = deque()  # messages and where their bytes end
    for offset in range(0, max(entry.payload_bytes, 1), chunk_size):
        size = min(chunk_size, entry.payload_bytes - offset)
        framing = encode_fetch_response(entry.name if offset == 0 else None, []) + b"\x12" + encode_varint(size)
        message, got = _new_message(framing, blob, offset, size)
        if got != size:
            raise DataLoss(f"{what}: stored blob {entry.digest} is truncated at byte {offset + got}")
        check.update(memoryview(message)[len(framing):])
        held.append((offset + size, message))
        while held and held[0][0] <= check.verified:
            yield held.popleft()[1]
    if check.verified != info.size or info.size != entry.payload_bytes:
        raise DataLoss(f"{what}: stored blob {entry.digest}: {check.verified} of {info.size} bytes checked")
    while held:
        yield held.popleft()[1]


def _new_message(framing: bytes, blob: BlobFile, offset: int, size: int) -> tuple[bytes, int]:
    """A new ``bytes``: ``framing``, then ``size`` bytes of ``blob`` from ``offset``; and how many
    of them were read (fewer: the blob is short).

    grpcio sends only ``bytes``, and filling a ``bytearray`` first would cost a second copy of
    each chunk. A ``BytesIO`` made from a new ``bytes`` owns it alone, writes through
    ``getbuffer()`` land in it, and ``getvalue()`` hands that very object over once no view
    of it is left (CPython; elsewhere it copies). No ``bytes`` anyone can see ever changes:
    copy-on-write is ``BytesIO``'s own.
    """
    buffer = io.BytesIO(bytes(len(framing) + size))
    view = buffer.getbuffer()
    view[: len(framing)] = framing
    got = blob.read_into(view[len(framing) :], offset)
    view.release()
    return buffer.getvalue(), got


def read_blocks(blob: BlobFile, info: BlobInfo, start: int, stop: int, what: str) -> Iterator[memoryview]:
    """Bytes [start, stop) of the blob, each covering block checked against its CRC-32 first."""
    size = info.block_size
    read_ahead_until = getattr(blob, "read_ahead_until", None)
    if read_ahead_until is not None:  # a bucket's blob reads ahead no further than the range needs
        read_ahead_until(-(-stop // size) * size)
    for index in range(start // size, -(-stop // size)):
        offset = index * size
        data = blob.read(offset, min(size, info.size - offset))
        check_block(what, info, index, data)
        lo, hi = max(start, offset), min(stop, offset + len(data))
        yield memoryview(data)[lo - offset : hi - offset]


def _elements(pieces: Iterable[memoryview], itemsize: int) -> Iterator[memoryview]:
    """The same bytes, re-cut so that no element is split between two pieces."""
    carry = b""
    for piece in pieces:
        if carry:
            piece = memoryview(carry + piece)
        cut = piece.nbytes - piece.nbytes % itemsize
        carry = bytes(piece[cut:])
        if cut:
            yield piece[:cut]
    if carry:
        raise AssertionError("a range that is not a whole number of elements")


def _cast(pieces: Iterable[memoryview], source: DType, target: DType, chunk_size: int) -> Iterator[memoryview]:
    """Elements converted from ``source`` to ``target`` a window at a time.

    float64 goes to float16 and bfloat16 through float32, as torch's ``.to`` does, so that
    a cast on the server gives the same bits as one in the client.
    """
    via32 = source.name == "float64" and target.name in ("float16", "bfloat16")
    for piece in _elements(pieces, source.itemsize):
        values = np.frombuffer(piece, dtype=source.numpy)
        with np.errstate(over="ignore", invalid="ignore"):
            if via32:
                values = values.astype(np.float32)
            out = values.astype(target.numpy)
        yield memoryview(out.view(np.uint8))


def _shift_bits(pieces: Iterable[memoryview], skip: int, count: int) -> Iterator[memoryview]:
    """Bit-packed booleans (LSB first) from bit ``skip`` of the stream, ``count`` of them,
    packed again from bit 0: the rows of a bool entry that start inside a byte."""
    if skip == 0:
        sent = 0
        full, tail_bits = divmod(count, 8)
        needed = full + (1 if tail_bits else 0)
        for piece in pieces:
            take = min(piece.nbytes, needed - sent)
            out = piece[:take]
            sent += take
            if sent == needed and tail_bits:
                # Clear the pad bits of the last byte, which belong to the next row.
                last = bytes([out[-1] & ((1 << tail_bits) - 1)])
                yield out[:-1]
                yield memoryview(last)
            else:
                yield out
        return
    carry = np.zeros(0, dtype=np.uint8)  # unpacked bits not yet sent (fewer than 8)
    remaining = count
    first = True
    for piece in pieces:
        bits = np.unpackbits(np.frombuffer(piece, dtype=np.uint8), bitorder="little")
        if first:
            bits, first = bits[skip:], False
        bits = np.concatenate((carry, bits[:remaining + 8]))
        usable = min(len(bits), remaining)
        whole = usable - usable % 8 if usable < remaining else usable
        if whole:
            yield memoryview(np.packbits(bits[:whole], bitorder="little"))
            remaining -= whole
        carry = bits[whole:usable] if remaining else carry[:0]
    if remaining:
        raise AssertionError("bool rows ended early")
