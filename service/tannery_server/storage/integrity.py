"""Checksums of stored payloads: a SHA-256 of the whole, and a CRC-32C per block.

The SHA-256 names the blob (equal payloads are stored once) and is computed while a
payload is received; ``tannery scrub`` checks it again (:meth:`~.core.StorageBase.scrub`). What is
served is checked by the block checksums (:mod:`tannery_protocol.checksums`: CRC-32C with the CPU's
CRC instructions, about 5x zlib's CRC-32 and 10x SHA-256 here, see docs/benchmarks.md, and
it releases the GIL): each block is checked before any of its bytes are sent, whether the
whole payload or a row range is asked for, so a corrupted block is never served. Blobs
stored before CRC-32C keep their zlib CRC-32s: each blob is checked with the algorithm its
:class:`BlobInfo` names.
"""

from __future__ import annotations

import hashlib
import struct

from tannery_protocol import checksums

from .base import BlobInfo
from .errors import Damaged

#: Bytes covered by one block checksum.
BLOCK_SIZE = 1 << 20


class PayloadDigest:
    """SHA-256 and per-block checksums (``algorithm``, CRC-32C by default) of bytes fed in
    pieces of any sizes."""

    def __init__(self, block_size: int = BLOCK_SIZE, algorithm: str = checksums.DEFAULT) -> None:
        checksums.checksum(algorithm, b"")  # ValueError now for an unknown algorithm
        self.block_size = block_size
        self.algorithm = algorithm
        self.size = 0
        self._sha = hashlib.sha256()
        self._crc = 0
        self._in_block = 0
        self._crcs = bytearray()

    def update(self, data: memoryview | bytes) -> None:
        """Hash the next bytes: the block CRCs, then SHA-256. A payload writer gives slices its
        write has just brought into the CPU's cache, where SHA-256 runs faster."""
        self.update_checksums(data)
        self.update_sha256(data)

    def update_checksums(self, data: memoryview | bytes) -> None:
        """The block checksums (and size) of the next bytes; :meth:`update_sha256` must be given
        the same bytes in the same order (it may run on another thread meanwhile)."""
        view = memoryview(data)
        self.size += view.nbytes
        pos, end = 0, view.nbytes
        while pos < end:
            take = min(self.block_size - self._in_block, end - pos)
            self._crc = checksums.checksum(self.algorithm, view[pos : pos + take], self._crc)
            self._in_block += take
            pos += take
            if self._in_block == self.block_size:
                self._crcs += struct.pack("<I", self._crc)
                self._crc, self._in_block = 0, 0

    def update_sha256(self, data: memoryview | bytes) -> None:
        """SHA-256 of the next bytes."""
        self._sha.update(data)

    def finish(self) -> BlobInfo:
        crcs = bytes(self._crcs)
        if self._in_block:
            crcs += struct.pack("<I", self._crc)
        return BlobInfo(self._sha.hexdigest(), self.size, self.block_size, crcs, self.algorithm)


def _corrupted(what: str, blob: BlobInfo, index: int) -> Damaged:
    return Damaged(checksums.corrupted_message(what, blob.digest, index))


def check_block(what: str, blob: BlobInfo, index: int, data: bytes | memoryview) -> None:
    """Damaged unless ``data`` is block ``index`` of ``blob`` as it was stored (checked with the
    blob's own algorithm)."""
    expected_size = min(blob.block_size, blob.size - index * blob.block_size)
    if len(data) != expected_size:
        raise Damaged(
            f"{what}: stored blob {blob.digest} is truncated: block {index} has {len(data)} of {expected_size} bytes"
        )
    if checksums.checksum(blob.checksum, data) != blob.crc(index):
        raise _corrupted(what, blob, index)


class BlockCheck:
    """Checks a blob read from its start, in pieces of any sizes, block by block.

    :attr:`verified` is how many bytes from the start have been checked: a reader sends
    bytes only below it.
    """

    def __init__(self, what: str, blob: BlobInfo) -> None:
        self.what = what
        self.blob = blob
        self.verified = 0
        self._index = 0
        self._crc = 0
        self._in_block = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        block_size = self.blob.block_size
        while view.nbytes:
            expected = min(block_size, self.blob.size - self._index * block_size)
            take = min(expected - self._in_block, view.nbytes)
            if take <= 0:
                raise Damaged(f"{self.what}: stored blob {self.blob.digest} has more than {self.blob.size} bytes")
            self._crc = checksums.checksum(self.blob.checksum, view[:take], self._crc)
            self._in_block += take
            view = view[take:]
            if self._in_block == expected:
                if self._crc != self.blob.crc(self._index):
                    raise _corrupted(self.what, self.blob, self._index)
                self.verified += expected
                self._index += 1
                self._crc = self._in_block = 0
