"""The one reader of stored bytes: a blob read in blocks, each checked against the checksum
recorded for it (:mod:`.integrity`) before any of its bytes are used.

A Fetch reads through it on every transport (:mod:`tannery_server.dataplane.blocks` adds what
an entry needs: its place in a pack, the messages of the gRPC stream) and ``tannery scrub``
reads every blob with it, so a corrupted block is never served and always found.
"""

from __future__ import annotations

import mmap
from typing import Callable, Iterator

from .base import BlobFile, BlobInfo
from .integrity import check_block


class BlockReader:
    """Checked blocks of an open ``blob`` recorded as ``info``; ``what`` names it in the Damaged
    a failed check raises (an entry, or a blob)."""

    def __init__(self, blob: BlobFile, info: BlobInfo, what: str, shelf: "BlobShelf | None" = None) -> None:
        self.blob = blob
        self.info = info
        self.what = what
        #: Where the last block checked is kept for the next reader of the same blob (a pack's).
        self.shelf = shelf

    def checked(self, start: int, stop: int, block: Callable[[int, int], bytes | memoryview], *,
                shelved: bool = True) -> Iterator[tuple[int, bytes | memoryview]]:
        """Each block that covers bytes [start, stop) of the blob: its offset and its bytes
        (``block(offset, size)``), checked. A view that fails its check is released at once: a
        slice of a map that a traceback keeps would make closing the map fail (BufferError)
        in place of Damaged."""
        size = self.info.block_size
        for index in range(start // size, -(-stop // size)):
            offset = index * size
            kept = self.shelf.block(self.info.digest, index) if self.shelf is not None and shelved else None
            if kept is not None:
                yield offset, kept
                continue
            data = block(offset, min(size, self.info.size - offset))
            try:
                check_block(self.what, self.info, index, data)
            except BaseException:
                if isinstance(data, memoryview):
                    data.release()
                raise
            if self.shelf is not None and shelved and isinstance(data, bytes):
                self.shelf.keep(self.info.digest, index, data)
            yield offset, data

    def blocks(self, start: int, stop: int) -> Iterator[memoryview]:
        """Bytes [start, stop) of the blob, read block by block, each covering block checked first."""
        # A bucket's blob reads ahead no further than the range needs (a file's ignores it).
        self.blob.read_ahead_until(min(self.info.size, -(-stop // self.info.block_size) * self.info.block_size))
        for offset, data in self.checked(start, stop, self.blob.read):
            lo, hi = max(start, offset), min(stop, offset + len(data))
            yield memoryview(data)[lo - offset : hi - offset]

    def regions(self, start: int, stop: int, batch: int) -> Iterator[tuple[int, int]]:
        """Regions [lo, hi) of bytes [start, stop) of the blob's file, each once the ``batch``
        blocks that cover it (fewer at the end) are checked in place, in a map of the file."""
        with mmap.mmap(self.blob.fileno(), self.info.size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                checked, lo = 0, start
                for offset, data in self.checked(start, stop, lambda at, size: view[at : at + size], shelved=False):
                    data.release()  # type: ignore[union-attr]
                    checked += 1
                    hi = min(stop, offset + self.info.block_size)
                    if checked % batch == 0 or hi == stop:
                        yield lo, hi
                        lo = hi
            finally:
                view.release()


class BlobShelf:
    """The blob a Fetch reads, kept open while the entries after it read the same one, with its
    last checked block: a Fetch of a pack's many small entries opens it once, and reads and
    checks each of its blocks once (one ranged GET per block on a bucket, not one per entry).

    ``open_blob(digest, size)`` opens a blob (:meth:`~.core.StorageBase.open_blob`). Used by
    one thread at a time; :meth:`close` when the Fetch ends.
    """

    def __init__(self, open_blob: Callable[[str, int | None], BlobFile]) -> None:
        self._open = open_blob
        self._digest: str | None = None
        self._blob: BlobFile | None = None
        self._block: tuple[int, bytes] | None = None

    def open(self, digest: str, size: int | None) -> BlobFile:
        """Blob ``digest``: the one open already, or opened now (the one before it closed)."""
        if digest != self._digest or self._blob is None:
            self.close()
            self._blob = self._open(digest, size)
            self._digest = digest
        return self._blob

    def block(self, digest: str, index: int) -> bytes | None:
        """Block ``index`` of blob ``digest`` as checked last, if it is the one kept."""
        if digest == self._digest and self._block is not None and self._block[0] == index:
            return self._block[1]
        return None

    def keep(self, digest: str, index: int, data: bytes) -> None:
        if digest == self._digest:
            self._block = (index, data)

    def close(self) -> None:
        """Close the blob kept open (one found damaged is closed too: the next read opens it anew)."""
        blob, self._blob, self._digest, self._block = self._blob, None, None, None
        if blob is not None:
            blob.close()


__all__ = ["BlobShelf", "BlockReader"]
