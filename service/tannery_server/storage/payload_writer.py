"""One payload going to a temporary blob, hashed (SHA-256 and block CRCs) as it is written."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from .base import BlobInfo, TempBlob
from .errors import DigestMismatch
from .integrity import PayloadDigest

if TYPE_CHECKING:
    from .catalog_and_blobs import Storage


#: Hashes pieces of payloads while their bytes are written (hashlib and the CRCs release the
#: GIL, so hashing one piece overlaps writing it and receiving the next).
_HASHING = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="tannery-hash")
#: Pieces smaller than this are hashed inline: a thread hand-off would cost more.
HASH_INLINE_BELOW = 256 << 10


class PayloadWriter:
    """One payload going to a temporary blob, hashed as it is written.

    A large piece is hashed by another thread while this one writes it; that hash is
    awaited before the next piece is hashed (so pieces are hashed in order) and by
    :meth:`finish`. At most one piece per payload is in flight.
    """

    def __init__(self, temp: TempBlob, block_size: int, storage: "Storage | None" = None,
                 expected: str | None = None) -> None:
        self.temp = temp
        self.digest = PayloadDigest(block_size)
        #: The SHA-256 (hex) the sender gave ahead of the payload, which it must hash to.
        self.expected = expected
        #: Bytes written so far.
        self.size = 0
        self._hashing: Future | None = None
        self._storage = storage

    def write(self, data: memoryview | bytes) -> None:
        """Write a piece; StorageFull when the disk is full or its space reserve is released (the
        space a Delete needs is not written into)."""
        view = memoryview(data)
        if self._storage is not None:
            self._storage.check_room()
        self._wait()
        if view.nbytes < HASH_INLINE_BELOW:
            self.digest.update(view)
        else:
            self._hashing = _HASHING.submit(self.digest.update, view)
        try:
            self.temp.write(view)
        except OSError as exc:
            if self._storage is None:
                raise
            raise self._storage.full_error(exc) from exc
        self.size += view.nbytes

    def finish(self) -> BlobInfo:
        """The payload's digest and block checksums, once every piece is hashed; DigestMismatch
        (the temporary blob discarded) when it is not the digest given ahead."""
        self._wait()
        blob = self.digest.finish()
        if self.expected is not None and blob.digest != self.expected:
            self.temp.discard()
            raise DigestMismatch(f"its {self.size} bytes hash to SHA-256 {blob.digest}, not to {self.expected}, "
                                 "the digest given ahead of them")
        return blob

    def _wait(self) -> None:
        if self._hashing is not None:
            hashing, self._hashing = self._hashing, None
            hashing.result()
