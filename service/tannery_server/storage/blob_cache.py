"""A bounded local-disk cache of blobs in front of a remote blob store (an S3 bucket).

A replica serves a hot checkpoint at local-disk speed after its first fetch: the first
:meth:`CachedBlobStore.open` of a blob under 16 MiB returns the remote blob and starts copying
the whole blob to ``cache_dir/<digest>`` in the background; a larger one (a pack of small
entries above all) is cached by the 64 KiB ranges its reads touch, and becomes a whole copy
once all of it was read (:mod:`.range_cache`). Later opens of a whole copy return a local
:class:`~.file_blobs.FileBlob` (with a real ``fileno()``, so the data paths can send or pass it).

- **Bounded**: the least recently used blobs are deleted once the cache would hold more than
  ``max_bytes``; a blob larger than that is never cached.
- **Never a partial or wrong blob**: a copy is hashed as it is written to ``<digest>.part``
  (kept only if its SHA-256 is its name), fsynced and renamed; a cached file whose size is
  not the blob's is dropped, not served. Its bytes are checked by
  the block CRCs of every read, as any blob's (fetching.py); :meth:`CachedBlobStore.evict`
  drops a copy found bad.
- **Rebuilt at start** from the directory (leftover ``.part`` files deleted, the order of use
  taken from the files' modification times, which each hit updates).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

from .base import BlobFile, BlobStore, TempBlob
from .file_blobs import FileBlob
from .private import private_directory, private_opener
from .range_cache import SUFFIX, WHOLE_BELOW, RangeBlob, RangeFile

log = logging.getLogger(__name__)
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: Bytes copied from the inner store per read while filling (its parallel ranges fetch them).
FILL_CHUNK = 32 << 20


class CachedBlobStore(BlobStore):
    """``inner`` with an LRU of whole blobs under ``cache_dir``, at most ``max_bytes`` of them."""

    def __init__(self, inner: BlobStore, cache_dir: Path, max_bytes: int, fillers: int = 2) -> None:
        self.inner = inner
        self.cache_dir = Path(cache_dir)
        self.max_bytes = max_bytes
        private_directory(self.cache_dir)
        self._lock = threading.Lock()
        #: digest -> size, least recently used first.
        self._entries: OrderedDict[str, int] = OrderedDict()
        #: Sizes the entries should have, where only the files told them (rebuilt; checked once).
        self._unverified: set[str] = set()
        self._bytes = 0  # cached plus reserved for fills in progress
        self._filling: set[str] = set()
        self._cancelled: set[str] = set()
        self._fills = ThreadPoolExecutor(fillers, thread_name_prefix="tannery-cache-fill")
        #: Large blobs cached by range (:mod:`.range_cache`), by digest; in ``_entries`` too, with
        #: the bytes they hold.
        self._ranges: dict[str, RangeFile] = {}
        self._rebuild()

    # -- the cache ------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found = []
        for path in self.cache_dir.iterdir():
            if path.name.endswith((".part", SUFFIX)):
                path.unlink(missing_ok=True)  # a fill cut short; ranges whose list was in memory
            elif _DIGEST.fullmatch(path.name) and path.is_file():
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.name, stat.st_size))
        for _, digest, size in sorted(found):
            self._entries[digest] = size
            self._unverified.add(digest)
            self._bytes += size
        with self._lock:
            self._evict_beyond(self.max_bytes)

    def _evict_beyond(self, limit: int) -> None:
        """Delete least recently used copies until at most ``limit`` bytes are held (lock held)."""
        while self._bytes > limit and self._entries:
            digest, size = self._entries.popitem(last=False)
            self._bytes -= size
            self._unverified.discard(digest)
            self._forget(digest)

    def _forget(self, digest: str) -> None:
        """Delete the cached file of ``digest``, whole or ranges (lock held)."""
        ranges = self._ranges.pop(digest, None)
        if ranges is not None:
            ranges.drop()
        else:
            (self.cache_dir / digest).unlink(missing_ok=True)

    def _drop(self, digest: str) -> None:
        with self._lock:
            size = self._entries.pop(digest, None)
            if size is not None:
                self._bytes -= size
            self._unverified.discard(digest)
            self._forget(digest)

    def cached(self) -> dict[str, int]:
        """The blobs cached whole and their sizes, least recently used first."""
        with self._lock:
            return {digest: size for digest, size in self._entries.items() if digest not in self._ranges}

    def cached_ranges(self) -> dict[str, int]:
        """The blobs cached by range and the bytes of each held."""
        with self._lock:
            return {digest: self._entries.get(digest, 0) for digest in self._ranges}

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def evict(self, digest: str) -> None:
        """Drop the cached copy of ``digest`` (one whose bytes failed a check)."""
        self._drop(digest)

    def _open_cached(self, digest: str, size: int | None) -> FileBlob | None:
        with self._lock:
            if digest in self._ranges:
                return None
            recorded = self._entries.get(digest)
            unverified = digest in self._unverified
        if recorded is None:
            return None
        if size is None and unverified:  # a file found at start: its size checked once against the store
            try:
                size = self.inner.open(digest).size
            except FileNotFoundError:
                self._drop(digest)
                raise
        try:
            blob = FileBlob(self.cache_dir / digest)
        except FileNotFoundError:
            self._drop(digest)
            return None
        if blob.size != (size if size is not None else recorded):
            log.warning("cached blob %s has %d bytes, not %d: dropped", digest, blob.size,
                        size if size is not None else recorded)
            blob.close()
            self._drop(digest)
            return None
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                self._unverified.discard(digest)
        try:
            os.utime(blob.fileno())  # the order of use survives a restart
        except OSError:
            pass
        return blob

    def _start_fill(self, digest: str, size: int) -> None:
        with self._lock:
            if size > self.max_bytes or digest in self._filling or digest in self._entries:
                return
            self._evict_beyond(self.max_bytes - size)
            self._bytes += size  # reserved while the copy is written
            self._filling.add(digest)
            self._cancelled.discard(digest)
        try:
            self._fills.submit(self._fill, digest, size)
        except RuntimeError:  # closed
            self._end_fill(digest, size, kept=False)

    def _fill(self, digest: str, size: int) -> None:
        part = self.cache_dir / f"{digest}.part"
        kept = False
        try:
            source = self.inner.open(digest, size)
            hashed = hashlib.sha256()
            try:
                buffer = bytearray(min(FILL_CHUNK, max(size, 1)))
                view = memoryview(buffer)
                with open(part, "wb", opener=private_opener) as out:
                    offset = 0
                    while offset < size:
                        got = source.read_into(view[:min(len(view), size - offset)], offset)
                        if not got:
                            raise EOFError(f"blob {digest} ended at byte {offset} of {size}")
                        hashed.update(view[:got])
                        out.write(view[:got])
                        offset += got
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                source.close()
            if hashed.hexdigest() != digest:  # damaged on the way, or in the bucket: not cached
                raise ValueError(f"its bytes hash to {hashed.hexdigest()}")
            with self._lock:
                if digest not in self._cancelled:
                    os.rename(part, self.cache_dir / digest)
                    kept = True
        except Exception as exc:  # a cache that cannot fill serves from the store, as before
            log.warning("could not cache blob %s: %s", digest, exc)
        finally:
            part.unlink(missing_ok=True)
            self._end_fill(digest, size, kept)

    def _end_fill(self, digest: str, size: int, kept: bool) -> None:
        with self._lock:
            self._filling.discard(digest)
            self._cancelled.discard(digest)
            if kept:
                self._entries[digest] = size
            else:
                self._bytes -= size

    def wait_for_fills(self, timeout: float = 60.0) -> None:
        """Return once no fill is in progress (tests; a clean shutdown)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._filling:
                    return
            time.sleep(0.01)
        raise TimeoutError(f"cache fills still running after {timeout} s: {sorted(self._filling)}")

    # -- BlobStore ------------------------------------------------------------------------------

    def open(self, digest: str, size: int | None = None) -> BlobFile:
        """The local copy when cached; else the inner store's blob, and a copy started."""
        cached = self._open_cached(digest, size)
        if cached is not None:
            return cached
        blob = self.inner.open(digest, size)
        if blob.size < WHOLE_BELOW or blob.size > self.max_bytes:
            self._start_fill(digest, blob.size)
            return blob
        ranges = self._range_file(digest, blob.size)
        if ranges is None:
            return blob
        return RangeBlob(blob, ranges, lambda added: self._ranges_added(digest, ranges, added))

    # -- ranges of large blobs (range_cache.py) -------------------------------------------------

    def _range_file(self, digest: str, size: int) -> RangeFile | None:
        """The range file of ``digest``, begun if there is none (None: it is being made whole)."""
        with self._lock:
            if digest in self._filling:
                return None
            ranges = self._ranges.get(digest)
            if ranges is None:
                try:
                    ranges = RangeFile(self.cache_dir / f"{digest}{SUFFIX}", size)
                except OSError as exc:
                    log.warning("could not cache ranges of blob %s: %s", digest, exc)
                    return None
                self._ranges[digest] = ranges
                self._entries[digest] = 0
            self._entries.move_to_end(digest)
            return ranges

    def _ranges_added(self, digest: str, ranges: RangeFile, added: int) -> None:
        """``added`` bytes more in the range file of ``digest``: counted, older entries evicted to
        make room; once it holds every chunk, it is checked and made the whole cached blob. -1: the
        file failed (a full disk): it is dropped."""
        if added < 0:
            with self._lock:
                if self._ranges.get(digest) is ranges:
                    self._bytes -= self._entries.pop(digest, 0)
                    self._forget(digest)
            return
        with self._lock:
            if self._ranges.get(digest) is not ranges:
                return  # dropped meanwhile (its file is gone)
            self._entries[digest] += added
            self._bytes += added
            self._entries.move_to_end(digest)
            self._evict_beyond(self.max_bytes)
            if not ranges.complete or digest in self._filling or self._ranges.get(digest) is not ranges:
                return
            self._filling.add(digest)
        try:
            self._fills.submit(self._make_whole, digest, ranges)
        except RuntimeError:  # closed
            with self._lock:
                self._filling.discard(digest)

    def _make_whole(self, digest: str, ranges: RangeFile) -> None:
        """Hash a range file that holds every chunk; rename it to the whole blob's name if it is that."""
        try:
            hashed = hashlib.sha256()
            with open(ranges.path, "rb") as source:
                while chunk := source.read(FILL_CHUNK):
                    hashed.update(chunk)
            with self._lock:
                if self._ranges.get(digest) is not ranges:
                    return
                if hashed.hexdigest() != digest:
                    log.warning("cached ranges of blob %s hash to %s: dropped", digest, hashed.hexdigest())
                    self._bytes -= self._entries.pop(digest, 0)
                    self._forget(digest)
                    return
                os.rename(ranges.path, self.cache_dir / digest)
                del self._ranges[digest]
                ranges.drop(unlink=False)
        except Exception as exc:
            log.warning("could not make the cached ranges of blob %s whole: %s", digest, exc)
            self._drop(digest)
        finally:
            with self._lock:
                self._filling.discard(digest)

    @property
    def wants_digests(self) -> bool:
        return self.inner.wants_digests

    def create(self, expected: str | None = None) -> TempBlob:
        return self.inner.create(expected)

    def make_durable(self, digests: Iterable[str]) -> None:
        self.inner.make_durable(digests)

    def remove(self, digest: str) -> int:
        with self._lock:
            if digest in self._filling:
                self._cancelled.add(digest)
        self._drop(digest)
        return self.inner.remove(digest)

    def digests(self) -> Iterator[str]:
        return self.inner.digests()

    def modified_ns(self, digest: str) -> int:
        return self.inner.modified_ns(digest)

    def temporaries(self) -> list[str]:
        return self.inner.temporaries()

    def clear_temporary(self, older_than_ns: int | None = None) -> int:
        return self.inner.clear_temporary(older_than_ns)

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self._fills.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for ranges in self._ranges.values():
                ranges.drop()  # which chunks it holds is known to this process only
            self._ranges.clear()
        self.inner.close()
