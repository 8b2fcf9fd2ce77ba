"""tannery_protocol.checksums on its own: the block checksum algorithms by name, shared by the server
and a client that checks blobs it reads directly."""

from __future__ import annotations

import array
import mmap
import os
import struct
import subprocess
import sys
import zlib

import crc32c
import pytest

from tannery_protocol import checksums


def crcs_of(data: bytes, block_size: int, function) -> bytes:
    return b"".join(struct.pack("<I", function(data[i : i + block_size])) for i in range(0, len(data), block_size))


def test_the_algorithms_and_the_default():
    assert checksums.DEFAULT == "crc32c"
    assert set(checksums.ALGORITHMS) == {"crc32", "crc32c"}
    assert checksums.DEFAULT in checksums.ALGORITHMS


def test_known_values_are_zlib_crc32_and_crc32c():
    # The check values of the two CRCs' catalogues: CRC-32 (ISO-HDLC) and CRC-32C (ISCSI).
    assert checksums.checksum("crc32", b"123456789") == 0xCBF43926
    assert checksums.checksum("crc32c", b"123456789") == 0xE3069283
    assert checksums.checksum("crc32", b"") == checksums.checksum("crc32c", b"") == 0


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_checksum_is_incremental_over_any_buffer(algorithm):
    data = os.urandom(100_003)
    whole = checksums.checksum(algorithm, data)
    value = 0
    for start in range(0, len(data), 7777):
        value = checksums.checksum(algorithm, memoryview(data)[start : start + 7777], value)
    assert value == whole
    assert checksums.checksum(algorithm, bytearray(data)) == whole
    floats = array.array("f", range(1000))  # a buffer whose items are not bytes
    assert checksums.checksum(algorithm, floats) == checksums.checksum(algorithm, floats.tobytes())


def test_an_unknown_algorithm_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5': expected one of crc32, crc32c"):
        checksums.checksum("md5", b"x")
    with pytest.raises(ValueError, match="'CRC32C'"):
        checksums.first_bad_block(b"x", 1, b"\0" * 4, "CRC32C")


@pytest.mark.parametrize("algorithm, function", [("crc32", zlib.crc32), ("crc32c", crc32c.crc32c)])
def test_first_bad_block_finds_the_first_mismatch(algorithm, function):
    block = 1000
    data = bytearray(os.urandom(5 * block + 17))  # 6 blocks, the last of 17 bytes
    crcs = crcs_of(bytes(data), block, function)
    assert len(crcs) == 6 * 4
    assert checksums.first_bad_block(data, block, crcs, algorithm) is None
    assert checksums.first_bad_block(b"", block, b"", algorithm) is None
    data[5 * block + 16] ^= 0x40  # the short last block
    assert checksums.first_bad_block(data, block, crcs, algorithm) == 5
    data[2 * block] ^= 0x01
    assert checksums.first_bad_block(memoryview(data), block, crcs, algorithm) == 2
    other = "crc32" if algorithm == "crc32c" else "crc32c"
    good = bytes(data[:block])
    assert checksums.first_bad_block(good, block, crcs, other) == 0, "the other algorithm matches nothing"


def test_first_bad_block_of_a_range_of_blocks():
    block = 64
    data = os.urandom(10 * block - 20)  # 10 blocks, the last of 44 bytes
    crcs = crcs_of(data, block, crc32c.crc32c)
    # Blocks 3 to 6 of the blob, with their own checksums (as the data paths send them): indexes
    # are the blob's.
    part = bytearray(data[3 * block : 7 * block])
    assert checksums.first_bad_block(part, block, crcs[4 * 3 : 4 * 7], "crc32c", first_index=3) is None
    assert checksums.first_bad_block(part, block, crcs[4 * 2 : 4 * 6], "crc32c", first_index=2) == 2, "misaligned"
    part[block + 1] ^= 0x10
    assert checksums.first_bad_block(part, block, crcs[4 * 3 : 4 * 7], "crc32c", first_index=3) == 4
    # The end of the blob: blocks 8 and 9, the last one short.
    assert checksums.first_bad_block(data[8 * block :], block, crcs[4 * 8 :], "crc32c", first_index=8) is None
    # A block with no checksum, or a checksum with no block (a file cut at a block boundary).
    assert checksums.first_bad_block(data, block, crcs[: 4 * 7], "crc32c") == 7
    assert checksums.first_bad_block(data[: 6 * block], block, crcs, "crc32c") == 6
    assert checksums.first_bad_block(data[3 * block : 6 * block], block, crcs[4 * 3 :], "crc32c", 3) == 6
    assert checksums.first_bad_block(b"", block, b"", "crc32c") is None
    with pytest.raises(ValueError, match="block size"):
        checksums.first_bad_block(data, 0, crcs, "crc32c")


def test_first_bad_block_over_a_memory_mapped_file(tmp_path):
    block = 4096
    data = os.urandom(3 * block + 100)
    path = tmp_path / "blob"
    path.write_bytes(data)
    crcs = crcs_of(data, block, crc32c.crc32c)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            assert checksums.first_bad_block(view, block, crcs, "crc32c") is None
            assert checksums.first_bad_block(view[block:], block, crcs[4:], "crc32c", first_index=1) is None
            assert checksums.first_bad_block(view[block:], block, crcs[:-4], "crc32c", first_index=1) == 1
        finally:
            view.release()


def test_corrupted_message_is_the_servers_data_loss_text():
    digest = "ab" * 32
    assert checksums.corrupted_message("entry 'w'", digest, 3) == (
        f"entry 'w': stored blob {digest} no longer matches its digest: its checksum in block 3 differs"
    )


def test_checksums_need_neither_torch_nor_numpy():
    """The server has no torch, and a client checking blobs needs no numpy to do it: the module
    imports with both blocked, and computes both algorithms."""
    code = """
import sys
for name in ("torch", "numpy"):
    sys.modules[name] = None  # any import of it now raises ImportError
from tannery_protocol import checksums
assert checksums.checksum("crc32", b"123456789") == 0xCBF43926
assert checksums.checksum("crc32c", b"123456789") == 0xE3069283
assert checksums.first_bad_block(b"abc", 2, b"\\0" * 8, "crc32c") == 0
loaded = [m for m in ("torch", "numpy") if sys.modules.get(m) is not None]
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # Nor is either imported when both are installed.
    code = "import sys, tannery_protocol.checksums; sys.exit(sorted({'torch', 'numpy'} & set(sys.modules)) or None)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
