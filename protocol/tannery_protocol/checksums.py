"""The block checksums of stored blobs, by name: the server computes and checks them, and a
client reading a blob's bytes directly checks them too. Torch-free and numpy-free.

A blob's bytes are cut into blocks of a fixed size (1 MiB on the server), the last one
possibly shorter, and each block has a 32-bit checksum, kept as little-endian uint32s one
after the other. The algorithm is named with the blob:

- ``"crc32"``: zlib's CRC-32, what blobs stored before CRC-32C were given;
- ``"crc32c"``: CRC-32C (Castagnoli) from the ``crc32c`` package, computed with the CPU's
  CRC instructions (several times zlib's speed), the default for new blobs.

Both release the GIL over large buffers, so several threads check blocks at once.
"""

from __future__ import annotations

import struct
import zlib
from typing import Callable

#: The algorithm of new blobs.
DEFAULT = "crc32c"
#: Every algorithm a blob's checksums may be computed with.
ALGORITHMS = ("crc32", "crc32c")

_FUNCTIONS: dict[str, Callable[..., int]] = {"crc32": zlib.crc32}


def _function(algorithm: str) -> Callable[..., int]:
    try:
        return _FUNCTIONS[algorithm]
    except KeyError:
        pass
    if algorithm == "crc32c":
        # Imported on first use: the package's import reads its distribution's metadata
        # (tens of milliseconds), which a command that checks no block should not pay.
        from crc32c import crc32c

        _FUNCTIONS[algorithm] = crc32c
        return crc32c
    raise ValueError(f"unknown checksum algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")


def checksum(algorithm: str, data, value: int = 0) -> int:
    """The checksum of ``data`` (any contiguous buffer) with ``algorithm``, continuing from
    ``value``: ``checksum(a, y, checksum(a, x)) == checksum(a, x + y)``, like ``zlib.crc32``.

    ValueError for an algorithm not in :data:`ALGORITHMS`."""
    return _function(algorithm)(data, value)


def first_bad_block(view, block_size: int, crcs: bytes, algorithm: str, first_index: int = 0) -> int | None:
    """The index of the first block of ``view`` whose checksum is not the one recorded, or None.

    ``view`` (any contiguous buffer) holds consecutive whole blocks of ``block_size`` bytes
    (the last possibly shorter), blocks ``first_index``, ``first_index + 1``, ... of a blob;
    ``crcs`` holds their checksums, little-endian uint32s, the first for block
    ``first_index``. The index returned is the blob's. A block of ``view`` without a
    checksum, or a checksum whose block ``view`` lacks (a truncated file), counts as bad.
    """
    if block_size <= 0:
        raise ValueError(f"block size must be positive, not {block_size}")
    function = _function(algorithm)
    data = memoryview(view).cast("B")
    have, recorded = -(-data.nbytes // block_size), len(crcs) // 4
    for number in range(max(have, recorded)):
        if number >= have or number >= recorded:
            return first_index + number
        block = data[number * block_size : (number + 1) * block_size]
        if function(block) != struct.unpack_from("<I", crcs, 4 * number)[0]:
            return first_index + number
    return None


def corrupted_message(what: str, digest: str, index: int) -> str:
    """The DATA_LOSS message for block ``index`` of blob ``digest`` not matching its checksum
    (``what``: the archive and entry being read), worded the same by the server and a client."""
    return f"{what}: stored blob {digest} no longer matches its digest: its checksum in block {index} differs"
