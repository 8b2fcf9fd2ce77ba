"""A bounded local-disk cache of whole blobs in front of a remote blob store (an S3 bucket).

A replica serves a hot checkpoint at local-disk speed after its first fetch: the first
:meth:`CachedBlobStore.open` of a blob returns the remote blob and starts copying the whole
blob to ``cache_dir/<digest>`` in the background; later opens return a local
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
        self._rebuild()

    # -- the cache ------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found = []
        for path in self.cache_dir.iterdir():
            if path.name.endswith(".part"):
                path.unlink(missing_ok=True)  # a fill cut short
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
            (self.cache_dir / digest).unlink(missing_ok=True)

    def _drop(self, digest: str) -> None:
        with self._lock:
            size = self._entries.pop(digest, None)
            if size is not None:
                self._bytes -= size
            self._unverified.discard(digest)
            (self.cache_dir / digest).unlink(missing_ok=True)

    def cached(self) -> dict[str, int]:
        """The cached blobs and their sizes, least recently used first."""
        with self._lock:
            return dict(self._entries)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def evict(self, digest: str) -> None:
        """Drop the cached copy of ``digest`` (one whose bytes failed a check)."""
        self._drop(digest)

    def _open_cached(self, digest: str, size: int | None) -> FileBlob | None:
        with self._lock:
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
        self._start_fill(digest, blob.size)
        return blob

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
        self.inner.close()
