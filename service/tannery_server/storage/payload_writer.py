"""One payload going to a temporary blob, hashed (SHA-256 and block CRCs) as it is written."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

from .base import BlobInfo, TempBlob
from .errors import DigestMismatch
from .integrity import PayloadDigest

#: Bytes written and checksummed (and, in a small piece, hashed) at a time. The write brings a
#: slice this small into the CPU's cache, where the CRC and SHA-256 then read it (SHA-256 runs
#: at 2 GB/s on cached bytes here, 1.2-1.6 GB/s from memory; docs/benchmarks.md, "Store
#: path").
SLICE = 64 << 10
#: Pieces from this size are hashed (SHA-256) on a thread of :data:`_HASHING` while the caller
#: writes and checksums them, so that the Store's slowest thread does half the work: on 2
#: vCPUs, 1 GiB Stores took 7-14% less time over gRPC and the same-host socket (TCP's
#: receive thread leaves no core free), for 0.1-0.2 server CPU-s more, as SHA-256 then reads
#: from memory (docs/benchmarks.md, "Store path"). A hand-over costs tens
#: of microseconds: as much as hashing 64 KiB, a 60th of hashing 1 MiB.
PARALLEL_FROM = 1 << 20
#: The threads that hash large pieces; a payload has at most one piece there at a time.
_HASHING = ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="tannery-sha256")


class Room(Protocol):
    """What a payload writer asks of the storage it writes for (the embedded one keeps a space
    reserve): whether there is room for more bytes, and what a failed write means."""

    def check_room(self) -> None:
        """StorageFull when the disk has no room for more bytes (its space reserve released)."""
        ...

    def full_error(self, exc: BaseException) -> BaseException:
        """StorageFull for a write that failed for want of room, else ``exc`` itself."""
        ...


class PayloadWriter:
    """One payload going to a temporary blob, checksummed as it is written, slice by slice, on
    the caller's thread, and hashed there too or, for a large piece, beside it (hashlib, the
    CRC and the write release the GIL: a data path receives the next piece meanwhile)."""

    def __init__(self, temp: TempBlob, block_size: int, storage: Room | None = None,
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
            if view.nbytes < PARALLEL_FROM:
                self._write_slices(view, self.digest.update)
                return
            hashed = _HASHING.submit(self.digest.update_sha256, view)
            try:
                self._write_slices(view, self.digest.update_checksums)
            except BaseException:
                hashed.cancel()
                wait([hashed])  # done with the piece, whatever it raises: the write's error is the one
                raise
            hashed.result()  # the piece is read to its end before the caller may reuse it
        except OSError as exc:
            if self._storage is None:
                raise
            raise self._storage.full_error(exc) from exc

    def _write_slices(self, view: memoryview, digest: Callable[[memoryview], None]) -> None:
        """Write ``view`` slice by slice, each slice then given to ``digest`` (from the cache)."""
        for at in range(0, view.nbytes, SLICE):
            piece = view[at:at + SLICE]
            self.temp.write(piece)
            digest(piece)
            self.size += piece.nbytes

    def finish(self) -> BlobInfo:
        """The payload's digest and block checksums; DigestMismatch (the temporary blob
        discarded) when it is not the digest given ahead."""
        blob = self.digest.finish()
        if self.expected is not None and blob.digest != self.expected:
            self.temp.discard()
            raise DigestMismatch(f"its {self.size} bytes hash to SHA-256 {blob.digest}, not to {self.expected}, "
                                 "the digest given ahead of them")
        return blob


class _Nowhere(TempBlob):
    """A temporary blob that keeps nothing: the bytes of a payload that is only hashed."""

    def write(self, data: memoryview | bytes) -> None:
        pass

    def seal(self, digest: str) -> bool:
        raise AssertionError("a payload that is only hashed is never sealed")

    def discard(self) -> None:
        pass


class PayloadHash(PayloadWriter):
    """A payload hashed (SHA-256 only) and written nowhere: one a Store compares with an entry
    already stored under its name, which it never stores (equal, it is there already; not,
    the Store is refused). No disk, bucket or space reserve is touched, on any blob store."""

    def __init__(self, block_size: int, expected: str | None = None) -> None:
        super().__init__(_Nowhere(), block_size, None, expected)

    def write(self, data: memoryview | bytes) -> None:
        """Hash a piece (hashlib releases the GIL); nothing of it is read once this returns."""
        view = memoryview(data).cast("B")
        self.digest.update_sha256(view)
        self.digest.size += view.nbytes
        self.size += view.nbytes
