"""A Fetch's entries on a data connection (a worker thread; a blocking socket).

Same host (``local``): each entry is a file descriptor and a region of it. A stored
payload, whole or a row range, is its blob file itself: the client maps it and checks
the blocks that cover the region against the checksums sent with it before it hands out
a tensor. What the server computes (a cast, bool rows) goes into a memory file, filled
from blocks checked here.

Over TCP: each entry is an ``entry`` frame and its payload's raw bytes, sent from the blob
file with ``sendfile`` after each batch of blocks is checked; a block that fails its check
breaks the connection (the call ends DATA_LOSS naming it), so no client ever holds a
corrupted tensor.
"""

from __future__ import annotations

import os
from typing import Sequence

from tannery_protocol.codec import read_info
from tannery_protocol.datalink import Link, frame
from tannery_protocol.v1.data_pb2 import DataEnd, EntryBytes, MappedEntry

from ..fetching import Plan
from ..storage import Storage
from ..storage.block_reader import BlobShelf
from .blocks import VerifiedBlob

#: Bytes a cast converts at a time for a data path.
COMPUTE_WINDOW = 4 << 20
#: Blocks checked before each ``sendfile`` of a TCP Fetch.
SEND_BATCH_BLOCKS = 8


def send_fetch(link: Link, storage: Storage, plans: Sequence[Plan], inline: bool = False) -> int:
    """Send every planned entry, then ``end``; the payload bytes sent. ``inline`` (a client that
    reads them): a pack's entries go as bytes on a same-host connection too, not as the pack
    passed once for each."""
    total = 0
    shelf = BlobShelf(storage.open_blob)  # a pack stays open while consecutive entries read it
    try:
        for plan in plans:
            with VerifiedBlob(storage, plan, shelf) as blob:
                mapped = link.local and not (inline and blob.shelf is not None)
                total += _send_mapped(link, blob) if mapped else _send_bytes(link, blob)
    finally:
        shelf.close()
    link.send(frame(end=DataEnd(entries=len(plans), payload_bytes=total)))
    return total


def _as_stored(plan: Plan) -> bool:
    """Whether the entry's bytes are a region of its blob as stored (no cast, no bit shifting)."""
    return plan.target is None and (plan.prefix is None or not plan.source.is_bool)


def _send_mapped(link: Link, blob: VerifiedBlob) -> int:
    """One entry as a descriptor: its blob file (a region of it), or a memory file the server filled."""
    plan, info = blob.plan, blob.info
    if _as_stored(plan) and blob.has_file():
        start, stop = blob.base + plan.start, blob.base + plan.stop  # in the file (a pack's entry: inside it)
        first = start // info.block_size
        last = max(first, -(-stop // info.block_size))
        entry = MappedEntry(
            name=plan.entry.name, prefix=plan.prefix or b"", offset=start, length=stop - start,
            digest=info.digest, file_size=info.size, block_size=info.block_size, first_block=first,
            block_crcs=info.block_crcs[4 * first : 4 * last], checksum=info.checksum,
        )
        link.send(frame(mapped=entry), [blob.blob.fileno()])
        return len(entry.prefix) + entry.length
    memory = os.memfd_create(f"tannery-{plan.entry.digest[:12]}", os.MFD_CLOEXEC)
    try:
        size = 0
        for piece in blob.pieces(COMPUTE_WINDOW):
            size += piece.nbytes
            while piece.nbytes:
                piece = piece[os.write(memory, piece):]
        link.send(frame(mapped=MappedEntry(name=plan.entry.name, offset=0, length=size, digest=info.digest,
                                           file_size=size)), [memory])
        return size
    finally:
        os.close(memory)


def _send_bytes(link: Link, blob: VerifiedBlob) -> int:
    """One entry as an ``entry`` frame and its payload's bytes."""
    link.in_payload = True  # from the entry frame on, until its last byte is out
    size = _send_payload(link, blob)
    link.in_payload = False
    return size


def _send_payload(link: Link, blob: VerifiedBlob) -> int:
    plan = blob.plan
    if plan.prefix is None:  # the whole payload as stored: from the file, each batch checked first
        size = plan.entry.payload_bytes
        link.send(frame(entry=EntryBytes(name=plan.entry.name, payload_bytes=size)))
        _send_checked(link, blob, 0, size)
        return size
    size = read_info(plan.prefix).size
    link.send(frame(entry=EntryBytes(name=plan.entry.name, payload_bytes=size)))
    if _as_stored(plan):  # rows: a new prefix, then a region of the file
        link.send_bytes(plan.prefix)
        _send_checked(link, blob, plan.start, plan.stop)
        return size
    sent = 0
    for piece in blob.pieces(COMPUTE_WINDOW):
        link.send_bytes(piece)
        sent += piece.nbytes
    if sent != size:
        raise AssertionError(f"{blob.what}: {sent} bytes made for a payload of {size}")
    return size


def _send_checked(link: Link, blob: VerifiedBlob, start: int, stop: int) -> None:
    """Bytes [start, stop) of the payload: from its blob's file, each batch of blocks checked
    before it is sent; read and sent otherwise (a small entry of a pack: mapping the pack for
    each would cost more than its bytes)."""
    if start == stop:
        return
    if blob.shelf is not None or not blob.has_file():  # a pack's entry: from its checked block, kept for the next
        for piece in blob.blocks(start, stop):
            link.send_bytes(piece)
        return
    for lo, hi in blob.regions(start, stop, SEND_BATCH_BLOCKS):
        link.send_file(blob.blob.fileno(), lo, hi - lo)
