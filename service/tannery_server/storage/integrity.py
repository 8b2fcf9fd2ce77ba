"""Checksums of stored payloads: a SHA-256 of the whole, and a CRC-32 per block.

The SHA-256 names the blob and is checked again whenever a whole payload is served.
The block CRCs (zlib.crc32, several GB/s and it releases the GIL) let a row range be
checked by reading only the blocks that cover it.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from ..failures import DataLoss
from .base import BlobInfo

#: Bytes covered by one CRC-32.
BLOCK_SIZE = 1 << 20


class PayloadDigest:
    """SHA-256 and per-block CRC-32s of bytes fed in pieces of any sizes."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.size = 0
        self._sha = hashlib.sha256()
        self._crc = 0
        self._in_block = 0
        self._crcs = bytearray()

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        self._sha.update(view)
        self.size += view.nbytes
        pos, end = 0, view.nbytes
        while pos < end:
            take = min(self.block_size - self._in_block, end - pos)
            self._crc = zlib.crc32(view[pos : pos + take], self._crc)
            self._in_block += take
            pos += take
            if self._in_block == self.block_size:
                self._crcs += struct.pack("<I", self._crc)
                self._crc, self._in_block = 0, 0

    def finish(self) -> BlobInfo:
        crcs = bytes(self._crcs)
        if self._in_block:
            crcs += struct.pack("<I", self._crc)
        return BlobInfo(self._sha.hexdigest(), self.size, self.block_size, crcs)


class Sha256Check:
    """Hashes a blob as it is read, to compare with its name at the end."""

    def __init__(self, what: str, digest: str) -> None:
        self.what = what
        self.digest = digest
        self._sha = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        self._sha.update(data)

    def verify(self) -> None:
        actual = self._sha.hexdigest()
        if actual != self.digest:
            raise DataLoss(f"{self.what}: stored blob {self.digest} no longer matches its digest (reads as {actual})")


def check_block(what: str, blob: BlobInfo, index: int, data: bytes) -> None:
    """DataLoss unless ``data`` is block ``index`` of ``blob`` as it was stored."""
    expected_size = min(blob.block_size, blob.size - index * blob.block_size)
    if len(data) != expected_size:
        raise DataLoss(
            f"{what}: stored blob {blob.digest} is truncated: block {index} has {len(data)} of {expected_size} bytes"
        )
    if zlib.crc32(data) != blob.crc(index):
        raise DataLoss(f"{what}: stored blob {blob.digest} no longer matches its checksum in block {index}")
