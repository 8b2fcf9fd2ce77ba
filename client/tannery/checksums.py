"""Block checksums of stored blobs (placeholder until the CRC-32C change lands: zlib CRC-32 only)."""

from __future__ import annotations

import struct
import zlib

DEFAULT = "crc32"
ALGORITHMS = ("crc32",)


def checksum(algorithm: str, data, value: int = 0) -> int:
    if algorithm != "crc32":
        raise ValueError(f"unknown block checksum {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    return zlib.crc32(data, value)


def first_bad_block(view, block_size: int, crcs: bytes, algorithm: str, first_index: int = 0) -> int | None:
    view = memoryview(view).cast("B")
    for i in range(len(crcs) // 4):
        block = view[i * block_size : (i + 1) * block_size]
        if checksum(algorithm, block) != struct.unpack_from("<I", crcs, 4 * i)[0]:
            return first_index + i
    return None


def corrupted_message(what: str, digest: str, index: int) -> str:
    return f"{what}: stored blob {digest} no longer matches its digest: its checksum in block {index} differs"
