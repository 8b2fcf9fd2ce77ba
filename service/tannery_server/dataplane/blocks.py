"""One planned entry, read through the one block reader: every byte a Fetch serves, on any
transport, comes from it.

A blob is read in its blocks (1 MiB; 64 KiB in a pack), and each block is checked against
the CRC-32C recorded when it was stored before any of its bytes leave
(:class:`~..storage.block_reader.BlockReader`, which scrub reads every blob with too): a
corrupted blob is DATA_LOSS naming the entry, none of its corrupted bytes is served, and
the blob is reported damaged. A whole entry reads every block that covers it; a row range
only those of its rows. An entry of a pack is the bytes of the pack from its offset
(docs/packs.md); a :class:`~..storage.block_reader.BlobShelf` keeps the pack open, with its
last checked block, for the entries after it.

Three ways out, one check: :meth:`VerifiedBlob.blocks` reads the blocks that cover a range
(what a row range, a cast, a pack's entry or a bucket's blob is made of);
:meth:`VerifiedBlob.regions` checks them in place in a map of the file and says which
regions are verified (what ``sendfile`` sends); :meth:`VerifiedBlob.messages` reads a whole
payload of its own straight into the gRPC messages that carry it, and lets each out once its
blocks are checked.
"""

from __future__ import annotations

import io
from collections import deque
from typing import Iterator

from tannery_protocol.wire import encode_fetch_response, encode_varint, split_parts

from ..fetching import Plan
from ..storage import BlobFile, BlobInfo, Damaged, Storage
from ..storage.block_reader import BlobShelf, BlockReader
from ..storage.integrity import BlockCheck
from .transforms import made_pieces


class VerifiedBlob:
    """The open blob of one planned entry, read only in checked blocks; a context manager that
    closes it, and reports it damaged to the storage when a block fails its check."""

    def __init__(self, storage: Storage, plan: Plan, shelf: BlobShelf | None = None) -> None:
        """Damaged when the blob is missing, of another size than was stored, or without checksums.
        ``shelf``: where a pack stays open for the next entries of the same Fetch."""
        self.storage = storage
        self.plan = plan
        #: The shelf that keeps this entry's pack open (None: the blob is this reader's own).
        self.shelf = shelf if plan.entry.packed else None
        self.entry = entry = plan.entry
        self.what = what = (f"archive {plan.archive!r}, " if plan.archive else "") + f"entry {entry.name!r}"
        #: Where the entry's payload starts in its blob (a pack's entry: past the payloads before it).
        self.base = entry.blob_offset
        # A payload of its own is as large as its blob; a pack's size is in its record.
        size = entry.payload_bytes if not entry.packed else (plan.blob.size if plan.blob else None)
        try:
            self.blob: BlobFile = (self.shelf.open(entry.blob, size) if self.shelf is not None
                                   else storage.open_blob(entry.blob, size))
        except FileNotFoundError:
            raise Damaged(f"{what}: stored blob {entry.blob} is missing") from None
        try:
            if not entry.packed and self.blob.size != entry.payload_bytes:
                raise Damaged(f"{what}: stored blob {entry.blob} has {self.blob.size} bytes, "
                               f"{entry.payload_bytes} were stored")
            info = plan.blob or storage.catalog.blob(entry.blob)
            if info is None:
                raise Damaged(f"{what}: stored blob {entry.blob} has no checksums in the catalog")
            if entry.packed and (self.blob.size != info.size or self.base + entry.payload_bytes > info.size):
                raise Damaged(f"{what}: stored pack {entry.blob} has {self.blob.size} bytes, {info.size} were stored, "
                               f"and the entry's {entry.payload_bytes} bytes start at byte {self.base}")
        except BaseException:
            self._close()
            raise
        self.info: BlobInfo = info
        self.reader = BlockReader(self.blob, info, what, self.shelf)

    def __enter__(self) -> "VerifiedBlob":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if isinstance(exc, (Damaged, FileNotFoundError)):
                self.storage.damaged(self.entry.blob)
                if self.shelf is not None:
                    self.shelf.close()
        finally:
            if self.shelf is None:
                self.blob.close()
        if isinstance(exc, FileNotFoundError):  # the object went after it was opened: its bytes are lost
            raise Damaged(f"{self.what}: stored blob {self.entry.blob} is missing ({exc})") from exc

    def _close(self) -> None:
        if self.shelf is not None:
            self.shelf.close()
        else:
            self.blob.close()

    def has_file(self) -> bool:
        """Whether the blob is a local file the data paths may pass or ``sendfile`` (an object in a
        bucket that is not in the local cache is not: its bytes are read and sent instead)."""
        try:
            self.blob.fileno()
        except io.UnsupportedOperation:
            return False
        return True

    def blocks(self, start: int, stop: int) -> Iterator[memoryview]:
        """Bytes [start, stop) of the payload, read block by block, each covering block checked first."""
        return self.reader.blocks(self.base + start, self.base + stop)

    def regions(self, start: int, stop: int, batch: int) -> Iterator[tuple[int, int]]:
        """Regions [lo, hi) of the blob's file (offsets in the file) that hold bytes [start, stop)
        of the payload, each once the ``batch`` blocks that cover it (fewer at the end) are
        checked in place, in a map of the file."""
        return self.reader.regions(self.base + start, self.base + stop, batch)

    def pieces(self, window: int) -> Iterator[memoryview]:
        """The payload as the client gets it, from checked blocks: as stored, or with a new
        prefix and the rows or the cast the plan asks for (a cast converts ``window`` bytes at a time)."""
        plan = self.plan
        blocks = self.blocks(plan.start, plan.stop)
        if plan.prefix is None:
            return blocks
        return made_pieces(plan, blocks, window)

    def messages(self, chunk_size: int) -> Iterator[bytes]:
        """The whole payload as stored, the fast path: the encoded ``FetchResponse`` messages of
        ``chunk_size`` payload bytes (the last shorter), each read from the file straight into
        the ``bytes`` gRPC sends, behind its message's framing (:func:`_new_message`: one copy),
        and checked there. A message is let out only once every block it holds has matched
        its checksum (with chunks of whole blocks, at once; smaller chunks wait for the end of
        their block)."""
        entry, info = self.entry, self.info
        if entry.packed:  # a part of its pack: from the blocks that cover it
            yield from self._messages_of(self.blocks(0, entry.payload_bytes), chunk_size)
            return
        check = BlockCheck(self.what, info)
        held: deque[tuple[int, bytes]] = deque()  # messages and where their bytes end
        for offset in range(0, max(entry.payload_bytes, 1), chunk_size):
            size = min(chunk_size, entry.payload_bytes - offset)
            framing = encode_fetch_response(entry.name if offset == 0 else None, []) + b"\x12" + encode_varint(size)
            message, got = _new_message(framing, self.blob, offset, size)
            if got != size:
                raise Damaged(f"{self.what}: stored blob {entry.digest} is truncated at byte {offset + got}")
            check.update(memoryview(message)[len(framing):])
            held.append((offset + size, message))
            while held and held[0][0] <= check.verified:
                yield held.popleft()[1]
        if check.verified != info.size or info.size != entry.payload_bytes:
            raise Damaged(f"{self.what}: stored blob {entry.digest}: {check.verified} of {info.size} bytes checked")
        while held:
            yield held.popleft()[1]

    def _messages_of(self, pieces: Iterator[memoryview], chunk_size: int) -> Iterator[bytes]:
        """Messages of exactly ``chunk_size`` payload bytes of ``pieces`` (the last shorter), the
        first naming the entry (and sent even with no bytes)."""
        first = True
        for parts in split_parts(pieces, chunk_size):
            yield encode_fetch_response(self.entry.name if first else None, parts)
            first = False
        if first:
            yield encode_fetch_response(self.entry.name, [])


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
