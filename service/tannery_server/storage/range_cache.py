"""Ranges of a large blob cached as they are read, not the whole blob (issue #43).

The read cache (:mod:`.blob_cache`) copied every blob it saw whole: one read of a 4 KiB entry
of a 64 MiB pack copied 64 MiB into ``--cache-dir``. A blob of :data:`WHOLE_BELOW` bytes or
more is now cached by :data:`CHUNK` (64 KiB, a pack's block): a :class:`RangeBlob` reads what
it is asked from the cache file where each chunk is there, and from the bucket otherwise
(whole chunks), writing what it read into a sparse ``<digest>.ranges`` file. Once every chunk is
there, the file is hashed against its name and becomes the whole cached blob (a local file the
data paths send or pass, as before). Which chunks a file holds lives in memory only: a
``.ranges`` file found at start is deleted. Every byte served is checked against the block
CRCs by the reader (fetching.py), as any blob's, and a cached file found bad is dropped.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from .base import BlobFile
from .private import open_private

log = logging.getLogger("tannery_server.storage")
#: Bytes per cached range (a pack's checksum block: reading one small entry caches about it).
CHUNK = 64 << 10
#: Blobs at least this large are cached by range; smaller ones are copied whole in the background.
WHOLE_BELOW = 16 << 20
#: The suffix of a blob's file while it holds only some ranges.
SUFFIX = ".ranges"


class RangeFile:
    """The cached chunks of one blob: a sparse file the size of the blob, and which chunks it holds.

    Its descriptor is used under :attr:`lock` only; it is closed once the file was dropped (or
    became the whole blob) and no :class:`RangeBlob` uses it any more."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.chunks = (size + CHUNK - 1) // CHUNK
        self._have = bytearray(self.chunks)
        #: How many chunks the file holds.
        self.count = 0
        self.lock = threading.Lock()
        self.gone = False  # dropped, or made the whole cached blob: read from the store meanwhile
        self._users = 0
        self._fd = open_private(path, os.O_RDWR | os.O_TRUNC)
        os.ftruncate(self._fd, size)

    def has(self, first: int, last: int) -> bool:
        return all(self._have[first:last + 1])

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Chunks held (lock held): ``buffer`` filled from ``offset``."""
        done = 0
        while done < buffer.nbytes:
            got = os.preadv(self._fd, [buffer[done:]], offset + done)
            if not got:
                break
            done += got
        return done

    def write(self, start: int, data: memoryview) -> int:
        """Whole chunks read from the store, from chunk-aligned ``start`` (lock held): those not
        held yet are written; their bytes."""
        added = 0
        for at in range(0, data.nbytes, CHUNK):
            index = (start + at) // CHUNK
            if self._have[index]:
                continue
            piece = data[at:at + CHUNK]
            done = 0
            while done < piece.nbytes:
                done += os.pwrite(self._fd, piece[done:], start + at + done)
            self._have[index] = 1
            self.count += 1
            added += piece.nbytes
        return added

    @property
    def complete(self) -> bool:
        return self.count == self.chunks

    def descriptor(self) -> int:
        return self._fd

    def use(self) -> None:
        with self.lock:
            self._users += 1

    def release(self) -> None:
        with self.lock:
            self._users -= 1
            self._close_if_unused()

    def drop(self, unlink: bool = True) -> None:
        """No more reads from this file (lock not held): deleted (``unlink``) or renamed away."""
        with self.lock:
            self.gone = True
            if unlink:
                self.path.unlink(missing_ok=True)
            self._close_if_unused()

    def _close_if_unused(self) -> None:
        if self.gone and self._users <= 0 and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RangeBlob(BlobFile):
    """A large blob read through its :class:`RangeFile`: chunks held are read from it, the others
    from ``inner`` (whole chunks) and added to it; ``added(n)`` tells the cache of ``n`` new bytes
    (``added(-1)``: the file failed, drop it)."""

    def __init__(self, inner: BlobFile, ranges: RangeFile, added: Callable[[int], None]) -> None:
        self.inner = inner
        self.size = inner.size
        self._ranges = ranges
        self._added = added
        self._failure = False
        ranges.use()

    def read(self, offset: int, size: int) -> bytes:
        buffer = bytearray(max(0, min(size, self.size - offset)))
        got = self.read_into(memoryview(buffer), offset)
        return bytes(buffer[:got])

    def read_into(self, buffer: memoryview, offset: int) -> int:
        end = min(offset + buffer.nbytes, self.size)
        if end <= offset:
            return 0
        ranges = self._ranges
        first, last = offset // CHUNK, (end - 1) // CHUNK
        with ranges.lock:
            if not ranges.gone and ranges.has(first, last):
                try:
                    return ranges.read_into(buffer[:end - offset], offset)
                except OSError as exc:
                    self._failed(exc)
        if ranges.gone:
            if self._failure:
                self._failure = False
                self._added(-1)
            return self.inner.read_into(buffer, offset)
        start, stop = first * CHUNK, min((last + 1) * CHUNK, self.size)
        direct = start == offset and stop == end  # aligned: straight into the caller's buffer
        if not direct and last - first > 1:
            return self._in_pieces(buffer, offset, end)
        view = buffer[:end - offset] if direct else memoryview(bytearray(stop - start))
        got = self.inner.read_into(view, start)
        if got < stop - start:  # the store ended early: the reader's checks say so; nothing cached
            if direct:
                return got
            n = max(0, min(got - (offset - start), end - offset))
            buffer[:n] = view[offset - start:offset - start + n]
            return n
        added = 0
        with ranges.lock:
            if not ranges.gone:
                try:
                    added = ranges.write(start, view)
                except OSError as exc:  # a full cache disk: served from the store, as before the cache
                    self._failed(exc)
        if not direct:
            buffer[:end - offset] = view[offset - start:end - start]
        if added or self._failure:
            self._added(-1 if self._failure else added)
            self._failure = False
        return end - offset

    def _failed(self, exc: OSError) -> None:
        """The cache file failed (lock held): reads of this blob go to the store, and the cache
        drops the file (``added(-1)``)."""
        log.warning("cached ranges of a blob of %d bytes failed (%s): read from the store", self.size, exc)
        self._ranges.gone = True
        self._failure = True

    def _in_pieces(self, buffer: memoryview, offset: int, end: int) -> int:
        """A read over several chunks that starts or ends inside one: its first and last chunks
        read on their own, the aligned middle straight into ``buffer`` (no copy of it all)."""
        head = min(end, (offset // CHUNK + 1) * CHUNK)
        tail = max(head, end // CHUNK * CHUNK if end < self.size else end)
        done = 0
        for start, stop in ((offset, head), (head, tail), (tail, end)):
            if stop > start:
                got = self.read_into(buffer[start - offset:stop - offset], start)
                done += got
                if got < stop - start:
                    break
        return done

    def read_ahead_until(self, stop: int) -> None:
        self.inner.read_ahead_until(stop)

    def close(self) -> None:
        self.inner.close()
        self._ranges.release()


__all__ = ["CHUNK", "RangeBlob", "RangeFile", "SUFFIX", "WHOLE_BELOW"]
