"""One payload going to a temporary blob, hashed (SHA-256 and block CRCs) as it is written."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import BlobInfo, TempBlob
from .errors import DigestMismatch
from .integrity import PayloadDigest

if TYPE_CHECKING:
    from .catalog_and_blobs import Storage


#: Bytes written, checksummed and hashed at a time. The write brings a slice this small into
#: the CPU's cache, where the CRC and SHA-256 then read it, so each byte comes from memory
#: once (SHA-256 runs at 2 GB/s on cached bytes here, 1.2 GB/s from memory): a 1 GiB Store's
#: server spent 2.5 CPU-s hashing on a thread of its own beside the write, 1.16 this way
#: (docs/benchmarks.md, "Store: one pass over each byte").
SLICE = 64 << 10


class PayloadWriter:
    """One payload going to a temporary blob, hashed as it is written, slice by slice, on the
    caller's thread (hashlib, the CRC and the write release the GIL: a data path receives the
    next piece meanwhile)."""

    def __init__(self, temp: TempBlob, block_size: int, storage: "Storage | None" = None,
                 expected: str | None = None) -> None:
        self.temp = temp
        self.digest = PayloadDigest(block_size)
        #: The SHA-256 (hex) the sender gave ahead of the payload, which it must hash to.
        self.expected = expected
        #: Bytes written so far.
        self.size = 0
        self._storage = storage

    def write(self, data: memoryview | bytes) -> None:
        """Write a piece; StorageFull when the disk is full or its space reserve is released (the
        space a Delete needs is not written into). Nothing of the piece is read once this returns."""
        view = memoryview(data).cast("B")
        if self._storage is not None:
            self._storage.check_room()
        try:
            for at in range(0, view.nbytes, SLICE):
                piece = view[at:at + SLICE]
                self.temp.write(piece)
                self.digest.update(piece)
                self.size += piece.nbytes
        except OSError as exc:
            if self._storage is None:
                raise
            raise self._storage.full_error(exc) from exc

    def finish(self) -> BlobInfo:
        """The payload's digest and block checksums; DigestMismatch (the temporary blob
        discarded) when it is not the digest given ahead."""
        blob = self.digest.finish()
        if self.expected is not None and blob.digest != self.expected:
            self.temp.discard()
            raise DigestMismatch(f"its {self.size} bytes hash to SHA-256 {blob.digest}, not to {self.expected}, "
                                 "the digest given ahead of them")
        return blob
