"""Small payloads packed into one blob, not one blob each (docs/packs.md).

A Store writes each payload below :data:`PACK_BELOW` bytes into its open pack: a blob like
any other (a temporary file or upload, hashed and block-checksummed as it is written, sealed
under its own SHA-256, durable before the catalog references it), whose entries each record
where their payload starts in it and their payload's own SHA-256. A pack is sealed once it
holds :data:`PACK_TARGET` bytes, or at the Store's commit, so a Store of thousands of small
tensors writes, fsyncs and uploads a few blobs instead of thousands, and a Fetch reads them
in few requests.

Identical payloads in one pack are stored once (the later entry points at the first copy);
across Stores small payloads are not deduplicated (an identical Store makes an identical pack,
which is).
"""

from __future__ import annotations

import hashlib

from .base import BlobInfo
from .errors import DigestMismatch
from .payload_writer import PayloadWriter

#: Payloads smaller than this are packed; larger ones keep a blob of their own.
PACK_BELOW = 1 << 20
#: A pack is sealed (and a new one begun) once it holds this many bytes: at most one blob, and
#: one bucket object, per 64 MiB of small payloads.
PACK_TARGET = 64 << 20
#: A pack's block checksums cover 64 KiB each (a blob of its own: 1 MiB), so reading one small
#: entry checks little more than its own bytes.
PACK_BLOCK_SIZE = 64 << 10
#: Bytes gathered in memory before they are written to the pack's blob (one write, one
#: checksum pass, for many small payloads).
_FLUSH = 1 << 20


class Pack:
    """The open pack of a Store: payloads appended one at a time (:meth:`begin`, :meth:`write`,
    :meth:`end`), then :attr:`writer` sealed by the storage."""

    def __init__(self, writer: PayloadWriter) -> None:
        self.writer = writer
        #: Bytes in the pack so far (written or gathered).
        self.size = 0
        self._gathered = bytearray()
        self._sha = hashlib.sha256()
        self._start = 0
        #: Where each payload of this pack starts, by its SHA-256 and size.
        self._stored: dict[tuple[str, int], int] = {}

    def begin(self) -> None:
        """The next payload starts here."""
        self._sha = hashlib.sha256()
        self._start = self.size

    def write(self, data: memoryview | bytes) -> None:
        """The next bytes of the current payload."""
        self._sha.update(data)
        self._gathered += data
        self.size += len(data) if isinstance(data, bytes) else data.nbytes
        if len(self._gathered) >= _FLUSH:
            self.flush()

    @property
    def payload_size(self) -> int:
        """Bytes of the current payload so far."""
        return self.size - self._start

    def end(self, expected: str | None = None) -> tuple[str, int]:
        """The current payload, complete: its SHA-256 (hex) and where it starts in the pack.

        DigestMismatch when it is not ``expected`` (the SHA-256 its sender gave ahead). A
        payload the pack already holds is dropped when its bytes are still in memory, and
        points at the first copy."""
        digest = self._sha.hexdigest()
        size = self.size - self._start
        if expected is not None and digest != expected:
            raise DigestMismatch(f"its {size} bytes hash to SHA-256 {digest}, not to {expected}, "
                                 "the digest given ahead of them")
        first = self._stored.get((digest, size))
        if first is not None and len(self._gathered) >= size:
            del self._gathered[len(self._gathered) - size:]
            self.size = self._start
            return digest, first
        self._stored.setdefault((digest, size), self._start)
        return digest, self._start

    def flush(self) -> None:
        """Write what is gathered to the pack's blob."""
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self.writer.write(memoryview(gathered))

    def finish(self) -> BlobInfo:
        """Everything written: the pack's digest and checksums (:meth:`PayloadWriter.finish`)."""
        self.flush()
        return self.writer.finish()

    def discard(self) -> None:
        self._gathered = bytearray()
        self.writer.temp.discard()


__all__ = ["PACK_BELOW", "PACK_BLOCK_SIZE", "PACK_TARGET", "Pack"]
