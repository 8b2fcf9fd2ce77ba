"""The torch-free tannic codec: dtypes, payload parsing, limits, and the stream re-framers."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tannery.dataplane import gathering
from tannery_protocol import codec, framing
from tannery_protocol.codec import (
    DEFAULT_LIMITS,
    DIM,
    DTYPES,
    HEADER,
    MAGIC,
    METADATA,
    FormatError,
    Limits,
    encode_numpy,
    encode_prefix,
    parse,
    read_info,
    to_numpy,
)
from tannery_protocol.framing import Deframer
from tannery.dataplane.gathering import Reframer

# The dtype table of issue 2, written out by hand rather than read back from the module.
CODES = {
    "bool": 1,
    "int8": 12,
    "int16": 13,
    "int32": 14,
    "int64": 15,
    "float16": 23,
    "bfloat16": 231,
    "float32": 24,
    "float64": 25,
    "complex64": 37,
    "complex128": 38,
    "uint8": 42,
    "uint16": 43,
    "uint32": 44,
    "uint64": 45,
    "float8_e4m3fn": 22,
    "float8_e5m2": 221,
}


def payload(name: str, shape: tuple[int, ...], seed: int = 0) -> bytes:
    """A valid payload of random buffer bytes (booleans with their padding bits clear)."""
    dtype = DTYPES[name]
    numel = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    if dtype.is_bool:
        buffer = np.packbits(rng.integers(0, 2, numel).astype(bool), bitorder="little").tobytes()
    else:
        buffer = rng.integers(0, 256, numel * dtype.itemsize, dtype=np.uint8).tobytes()
    return encode_prefix(dtype, shape) + buffer


def raw(code: int = 24, shape: tuple[int, ...] = (2,), nbytes: int | None = None, after: int | None = None,
        magic: int = MAGIC, version: int = 1, rank: int | None = None, body: bytes | None = None) -> bytes:
    """A payload built field by field, so each field can lie."""
    rank = len(shape) if rank is None else rank
    if nbytes is None:
        nbytes = codec.dtype_of_code(code).buffer_nbytes(int(np.prod(shape)))
    if body is None:
        body = bytes(nbytes)
    meta = METADATA.pack(code, 0, nbytes, rank) + b"".join(DIM.pack(d) for d in shape)
    if after is None:
        after = len(meta) + len(body)
    return HEADER.pack(magic, version, 0xABCD, after) + meta + body


# ---------------------------------------------------------------------------------- dtypes


def test_dtype_codes_match_the_issue_table():
    assert {name: d.code for name, d in DTYPES.items()} == CODES
    for name, code in CODES.items():
        assert codec.dtype_of_code(code).name == name
        assert codec.dtype_named(name).code == code


def test_tannic_cpp_complex_codes_are_read_as_aliases():
    assert codec.dtype_of_code(35) is DTYPES["complex64"]
    assert codec.dtype_of_code(36) is DTYPES["complex128"]


@pytest.mark.parametrize("code", [0, 2, 11, 16, 26, 35 + 100, 99, 230, 232, 255])
def test_unknown_code_is_a_format_error_naming_it(code):
    with pytest.raises(FormatError, match=f"unknown dcode {code}"):
        codec.dtype_of_code(code)


def test_unknown_name_and_numpy_dtype():
    with pytest.raises(ValueError, match="'float128'"):
        codec.dtype_named("float128")
    with pytest.raises(TypeError, match="float16|complex256|object"):
        codec.dtype_of_numpy(np.dtype(object))


def test_buffer_nbytes_packs_booleans():
    assert DTYPES["bool"].buffer_nbytes(0) == 0
    assert DTYPES["bool"].buffer_nbytes(1) == 1
    assert DTYPES["bool"].buffer_nbytes(8) == 1
    assert DTYPES["bool"].buffer_nbytes(9) == 2
    assert DTYPES["float64"].buffer_nbytes(3) == 24
    assert [n for n, d in DTYPES.items() if d.is_float] == ["float16", "bfloat16", "float32", "float64"]


def test_format_shape():
    assert codec.format_shape(()) == "[]"
    assert codec.format_shape((2, 2)) == "[2, 2]"
    assert codec.format_shape(np.array([3, 1])) == "[3, 1]"


# --------------------------------------------------------------------------- encoding


def test_encode_prefix_hand_computed_bytes():
    prefix = encode_prefix(DTYPES["float32"], (2, 3))
    expected = (
        struct.pack("<IBHQ", 0x43495245, 1, 0xABCD, 18 + 16 + 24)
        + struct.pack("<BQQB", 24, 0, 24, 2)
        + struct.pack("<QQ", 2, 3)
    )
    assert prefix == expected
    assert prefix[:4] == b"ERIC"


def test_encode_prefix_of_a_scalar_and_over_rank():
    assert encode_prefix(DTYPES["int8"], ()) == struct.pack("<IBHQBQQB", MAGIC, 1, 0xABCD, 19, 12, 0, 1, 0)
    with pytest.raises(ValueError, match="rank 256"):
        encode_prefix(DTYPES["int8"], (1,) * 256)


def test_bool_bits_least_significant_first():
    bits = np.array([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0], dtype=bool)
    data = encode_numpy(bits)
    assert data[-2:] == bytes([0b00000001, 0b00000011])
    assert encode_numpy(np.array([[0, 1, 0], [1, 0, 0]], dtype=bool))[-1:] == bytes([0b00001010])
    assert np.array_equal(to_numpy(data), bits)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (3, 4), (2, 1, 3, 2)])
def test_numpy_round_trip(name, shape):
    data = payload(name, shape)
    array = to_numpy(data)
    assert array.dtype == DTYPES[name].numpy and array.shape == shape
    assert encode_numpy(array) == data


def test_numpy_parts_view_the_array():
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    prefix, buffer = codec.numpy_parts(array)
    array[0, 0] = 77
    assert np.frombuffer(buffer, np.int32)[0] == 77
    assert b"".join(codec.numpy_parts(array.T)) == encode_numpy(np.ascontiguousarray(array.T))


def test_to_numpy_views_a_writable_buffer():
    data = bytearray(encode_numpy(np.arange(4, dtype=np.int16)))
    array = to_numpy(data)
    data[-2:] = struct.pack("<h", -5)
    assert array[-1] == -5


@pytest.mark.parametrize("offset", [0, 1, 5, 33, 63])
def test_aligned_buffer(offset):
    buffer = gathering.aligned_buffer(1000, offset)
    assert len(buffer) == 1000 and not buffer.readonly
    address = np.frombuffer(buffer, np.uint8).ctypes.data
    assert (address + offset) % codec.ALIGNMENT == 0


# --------------------------------------------------------------------------- parsing


def test_read_info_fields():
    data = payload("float64", (2, 5))
    info = read_info(data)
    assert info.dtype is DTYPES["float64"] and info.shape == (2, 5)
    assert info.nbytes == 80 and info.data_offset == 15 + 18 + 16 and info.size == len(data)
    assert info.numel == 10 and info.rank == 2 and info.describe() == "float64 [2, 5]"
    assert parse(data) == info


@pytest.mark.parametrize("name,shape", [("float32", (3, 4)), ("int8", ()), ("bool", (0,)), ("uint64", (1,) * 9)])
def test_read_info_is_none_while_the_prefix_is_incomplete(name, shape):
    data = payload(name, shape)
    info = parse(data)
    for n in range(info.data_offset):
        assert read_info(data[:n]) is None, n
    for n in range(info.data_offset, len(data) + 1):
        assert read_info(data[:n]) == info


def test_read_info_needs_no_buffer():
    # A payload claiming 1 GiB: the prefix alone is enough, nothing else is read or allocated.
    prefix = encode_prefix(DTYPES["float32"], (1 << 28,))
    info = read_info(prefix)
    assert info.nbytes == 1 << 30 and info.size == len(prefix) + (1 << 30)


def test_bad_magic_is_refused_from_the_header_alone():
    data = raw(magic=0x12345678)
    with pytest.raises(FormatError, match="bad magic 0x12345678, expected 0x43495245"):
        read_info(data[:15])
    with pytest.raises(FormatError, match="bad magic"):
        parse(data)


def test_unsupported_version():
    with pytest.raises(FormatError, match="unsupported version 2"):
        read_info(raw(version=2)[:15])


def test_unknown_dcode_in_a_payload():
    with pytest.raises(FormatError, match="unknown dcode 99"):
        parse(raw(code=99, nbytes=8))


@pytest.mark.parametrize("cut", [0, 1, 14, 15, 32, 40, 41, 47])
def test_truncated_payload(cut):
    data = raw(code=24, shape=(2,))  # 15 + 18 + 8 + 8 = 49 bytes
    with pytest.raises(FormatError, match=rf"truncated payload: {cut}\b"):
        parse(data[:cut])


def test_truncated_payload_names_both_sizes():
    with pytest.raises(FormatError, match="truncated payload: 45 of 49 bytes"):
        parse(raw(code=24, shape=(2,))[:45])


def test_trailing_bytes():
    with pytest.raises(FormatError, match="trailing bytes: 52 bytes for a payload of 49"):
        parse(raw(code=24, shape=(2,)) + b"abc")


def test_buffer_size_that_does_not_match_the_shape():
    with pytest.raises(FormatError, match=r"buffer nbytes 12 does not match shape \[2, 2\] of float32 \(16 bytes\)"):
        parse(raw(code=24, shape=(2, 2), nbytes=12))
    assert parse(raw(code=1, shape=(9,))).nbytes == 2  # (9 + 7) // 8
    with pytest.raises(FormatError, match=r"buffer nbytes 1 does not match shape \[9\] of bool \(2 bytes\)"):
        parse(raw(code=1, shape=(9,), nbytes=1))


def test_header_nbytes_inconsistent_with_the_metadata():
    with pytest.raises(FormatError, match="header nbytes 50 is inconsistent with the metadata: 26 bytes .* 8 of buffer = 34"):
        parse(raw(code=24, shape=(2,), after=50))


def test_header_nbytes_too_small_for_the_metadata():
    with pytest.raises(FormatError, match="header nbytes 17 is too small for the tensor metadata"):
        read_info(raw(after=17)[:15])


def test_header_nbytes_too_small_for_the_shape_it_announces():
    # The header says 18 bytes follow, the metadata announces rank 3: that is a lie, not a
    # truncation, and it is known as soon as the rank is read.
    data = HEADER.pack(MAGIC, 1, 0xABCD, 18) + METADATA.pack(24, 0, 0, 3)
    with pytest.raises(FormatError, match="header nbytes 18 .* rank 3"):
        read_info(data)


def test_offset_field_is_ignored_on_read():
    data = bytearray(raw(code=14, shape=(3,), body=struct.pack("<3i", 1, 2, 3)))
    struct.pack_into("<Q", data, 16, 12345)
    assert to_numpy(data).tolist() == [1, 2, 3]


def test_checksum_is_not_verified():
    data = bytearray(raw())
    struct.pack_into("<H", data, 5, 0)
    parse(data)


# ------------------------------------------------------------------------------ limits


def test_default_limits():
    assert DEFAULT_LIMITS == Limits() and Limits().max_rank == 64


def test_payload_over_the_size_limit_is_refused_from_the_header_alone():
    data = payload("float32", (100,))
    limits = Limits(max_payload=len(data) - 1)
    with pytest.raises(FormatError, match=f"payload of {len(data)} bytes is over the limit of {len(data) - 1} bytes"):
        read_info(data[:15], limits)
    assert parse(data, Limits(max_payload=len(data))).size == len(data)


def test_rank_over_the_limit():
    data = raw(code=12, shape=(1,) * 5)
    with pytest.raises(FormatError, match="rank 5 is over the limit of 4"):
        read_info(data[: 15 + 18], Limits(max_rank=4))
    with pytest.raises(FormatError, match="rank 255 is over the limit of 64"):
        read_info(raw(code=12, shape=(1,) * 255))


def test_huge_dimensions_are_refused_without_allocating():
    # Dimensions whose product overflows 64 bits: arithmetic on Python ints, then a clear error.
    data = raw(code=25, shape=(2**63, 2**63, 2**40), nbytes=8)
    with pytest.raises(FormatError, match="too large for an array"):
        parse(data)
    with pytest.raises(FormatError, match=r"buffer nbytes 8 does not match shape \[65536, 65536\] of float64 \(34359738368 bytes\)"):
        parse(raw(code=25, shape=(2**16, 2**16), nbytes=8))


# --------------------------------------------------------- any bytes-like object is a payload


def test_any_bytes_like_object():
    data = payload("int8", (3,))  # 44 bytes: a multiple of 4, so it can be cast to "I"
    assert len(data) % 4 == 0
    expected = to_numpy(data)
    for buffer in (
        bytearray(data),
        memoryview(data),
        memoryview(bytearray(data)).cast("I"),
        memoryview(data).cast("B", (4, len(data) // 4)),
        np.frombuffer(data, np.uint8).reshape(4, -1),
        np.frombuffer(data, np.uint32),
    ):
        assert parse(buffer) == parse(data), type(buffer)
        assert np.array_equal(to_numpy(buffer), expected)


# ------------------------------------------------------------------------------ streams


def stream_of_payloads() -> list[bytes]:
    return [
        payload("float32", (3, 4), 1),
        payload("int8", (), 2),
        payload("bool", (0,), 3),
        payload("bool", (13,), 4),
        payload("complex128", (2, 0, 5), 5),
        payload("uint16", (1,) * 20, 6),  # a long shape: headers split across many chunks
        payload("bfloat16", (300,), 7),
    ]


def chunked(data: bytes, sizes) -> list[bytes]:
    chunks, pos = [], 0
    sizes = iter(sizes)
    while pos < len(data):
        n = next(sizes)
        chunks.append(data[pos : pos + n])
        pos += n
    return chunks


def deframe(chunks, limits: Limits = DEFAULT_LIMITS) -> list[tuple[codec.PayloadInfo, bytes]]:
    """Feed ``chunks`` to a Deframer and reassemble its fragments, checking their flags."""
    deframer = Deframer(limits)
    out, current, info = [], None, None
    for chunk in chunks:
        for fragment in deframer.feed(chunk):
            if fragment.first:
                assert current is None
                current, info = bytearray(), fragment.info
            assert fragment.info == info and current is not None
            current += fragment.data
            assert len(current) <= info.size
            if fragment.last:
                assert len(current) == info.size
                out.append((info, bytes(current)))
                current = None
    assert deframer.inside_payload == (current is not None)
    deframer.close()
    assert deframer.payloads == len(out)
    return out


CHUNK_SIZES = [1, 2, 3, 7, 14, 15, 16, 32, 33, 34, 41, 64, 100, 1000, 1 << 20]


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_deframer_on_fixed_chunk_sizes(size):
    payloads = stream_of_payloads()
    out = deframe(chunked(b"".join(payloads), iter(lambda: size, None)))
    assert [data for _, data in out] == payloads
    assert [info for info, _ in out] == [parse(p) for p in payloads]


@pytest.mark.parametrize("seed", range(20))
def test_deframer_on_random_chunkings(seed):
    rng = random.Random(seed)
    payloads = stream_of_payloads()
    stream = b"".join(payloads)
    sizes = iter(lambda: rng.choice([0, 1, 2, 5, 15, 16, 40, rng.randrange(1, len(stream))]), None)
    out = deframe(chunked(stream, sizes))
    assert [data for _, data in out] == payloads


def test_deframer_accepts_memoryviews_and_bytearrays():
    payloads = stream_of_payloads()
    stream = bytearray(b"".join(payloads))
    chunks = [memoryview(stream)[i : i + 37] for i in range(0, len(stream), 37)]
    assert [data for _, data in deframe(chunks)] == payloads
    assert [data for _, data in deframe([stream])] == payloads


def test_deframer_hands_whole_chunks_over_as_they_are():
    data = payload("float32", (1000,))
    (fragment,) = Deframer().feed(data)
    assert fragment.data is data and fragment.first and fragment.last


def test_deframer_views_the_chunks_it_does_not_hand_over_whole():
    first = payload("float32", (1000,))
    chunk = bytearray(first + payload("int8", (5,)))
    fragments = list(Deframer().feed(chunk))
    assert len(fragments) == 2
    for fragment in fragments:
        assert isinstance(fragment.data, memoryview) and fragment.data.obj is chunk
    chunk[100] ^= 0xFF
    assert fragments[0].data[100] == chunk[100]


def test_deframer_copies_only_split_headers():
    data = payload("float64", (4, 100))
    info = parse(data)
    chunks = [data[:10], data[10:500], data[500:]]
    deframer = Deframer()
    fragments = []
    for chunk in chunks:
        fragments.extend(deframer.feed(chunk))
    # The header, gathered from two chunks, is the one copy; the rest are views of the chunks.
    assert bytes(fragments[0].data) == data[: info.data_offset] and fragments[0].first
    assert fragments[1].data.obj is chunks[1] and len(fragments[1].data) == 500 - info.data_offset
    assert fragments[2].data is chunks[2] and fragments[2].last


def test_deframer_empty_chunks_change_nothing():
    deframer = Deframer()
    assert list(deframer.feed(b"")) == []
    data = payload("int16", (3,))
    assert list(deframer.feed(data[:20])) == []
    assert list(deframer.feed(b"")) == []
    assert deframer.inside_payload
    assert b"".join(bytes(f.data) for f in deframer.feed(data[20:])) == data
    deframer.close()


def test_deframer_checks_each_header_before_its_buffer():
    good, bad = payload("int32", (4,)), raw(magic=0xDEADBEEF)
    deframer = Deframer()
    assert len(list(deframer.feed(good))) == 1
    with pytest.raises(FormatError, match="bad magic 0xDEADBEEF"):
        list(deframer.feed(bad[:15]))


def test_deframer_enforces_limits():
    data = payload("float32", (1000,))
    with pytest.raises(FormatError, match="over the limit"):
        list(Deframer(Limits(max_payload=1000)).feed(data[:15]))
    with pytest.raises(FormatError, match="rank 20 is over the limit of 8"):
        deframe(chunked(payload("uint16", (1,) * 20), iter(lambda: 1, None)), Limits(max_rank=8))


def test_deframer_refuses_a_header_whose_rank_exceeds_its_nbytes_without_reading_on():
    # rank 255 announced in a payload whose header says 18 bytes follow: the Deframer must not
    # take the next payload's bytes for this one's shape.
    lie = HEADER.pack(MAGIC, 1, 0xABCD, 18) + METADATA.pack(24, 0, 0, 3)
    deframer = Deframer()
    with pytest.raises(FormatError, match="rank 3"):
        for b in lie:
            list(deframer.feed(bytes([b])))


def hostile_prefix(claimed: int) -> bytes:
    """A valid prefix of a uint8 payload that claims ``claimed`` bytes in all."""
    buffer = claimed - (15 + 18 + 8)
    return HEADER.pack(MAGIC, 1, 0xABCD, claimed - 15) + METADATA.pack(42, 0, buffer, 1) + DIM.pack(buffer)


#: Run in a fresh process: feed a framer the chunks, and print the address space (VmSize) the
#: feeding took. The process has one thread, and nothing else runs while it measures.
_MEASURE_FEEDING = """
import importlib, sys
module, name, *hex_chunks = sys.argv[1:]
kind = getattr(importlib.import_module(module), name)
chunks = [bytes.fromhex(chunk) for chunk in hex_chunks]

def virtual_memory():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))

list(kind().feed(chunks[0][:15]))  # the first feed's imports and caches, before measuring
framer = kind()
before = virtual_memory()
got = [piece for chunk in chunks for piece in framer.feed(chunk)]
print(virtual_memory() - before, sum(len(getattr(piece, "data", piece)) for piece in got))
"""


def address_space_of_feeding(kind, chunks: list[bytes]) -> tuple[int, int]:
    """The bytes of address space a fresh ``kind()`` takes while fed ``chunks`` (with what it
    still holds: the pieces it returned), and the bytes of those pieces; measured in a
    process of its own, so no other thread's malloc arena or cache is counted."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/self/status")
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _MEASURE_FEEDING, kind.__module__, kind.__qualname__,
                             *(chunk.hex() for chunk in chunks)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    grown, returned = map(int, result.stdout.split())
    return grown, returned


@pytest.mark.parametrize("claimed", [1 << 34, 1 << 39, (1 << 40) - 1])
@pytest.mark.parametrize("kind", [Deframer, Reframer])
def test_hostile_size_claims_allocate_nothing(kind, claimed):
    """A header claiming up to the 1 TiB default limit gets no memory before its bytes arrive
    (a Reframer maps at most EAGER_GATHER bytes for the payload on its header's word)."""
    chunks = [hostile_prefix(claimed), b"x" * 1000, b"y" * 4096]
    grown, returned = address_space_of_feeding(kind, chunks)
    # A Deframer holds nothing of a payload; a Reframer maps its first EAGER_GATHER (32 MiB).
    bound = 64 << 20 if kind is Reframer else 1 << 20
    assert grown < bound, f"{grown} bytes of address space taken on the word of a header"
    assert returned == (sum(map(len, chunks)) if kind is Deframer else 0)
    framer = kind()
    got = [piece for chunk in chunks for piece in framer.feed(chunk)]
    if kind is Deframer:
        assert sum(len(f.data) for f in got) == len(hostile_prefix(claimed)) + 5096
    else:
        assert got == []
    with pytest.raises(FormatError, match=f"stream ended inside a payload: {len(hostile_prefix(claimed)) + 5096} of {claimed} bytes"):
        framer.close()


def test_hostile_size_claims_over_the_limit_are_refused():
    claimed = 1 << 50
    for kind in (Deframer, Reframer):
        with pytest.raises(FormatError, match=f"payload of {claimed} bytes is over the limit of {1 << 40} bytes"):
            list(kind().feed(hostile_prefix(claimed)))


def test_close_inside_a_payload_names_the_bytes():
    data = payload("float32", (10,))
    deframer = Deframer()
    list(deframer.feed(data[:60]))
    with pytest.raises(FormatError, match=f"stream ended inside a payload: 60 of {len(data)} bytes"):
        deframer.close()


def test_close_inside_a_header():
    deframer = Deframer()
    list(deframer.feed(payload("float32", (10,))[:20]))
    with pytest.raises(FormatError, match="stream ended inside a payload header: 20 bytes"):
        deframer.close()


def test_close_between_payloads_is_fine():
    deframer = Deframer()
    list(deframer.feed(payload("float32", (10,)) * 2))
    assert not deframer.inside_payload and deframer.payloads == 2
    deframer.close()


# ------------------------------------------------------------------------------ Reframer


def reframe(chunks) -> list:
    reframer = Reframer()
    out = [p for chunk in chunks for p in reframer.feed(chunk)]
    reframer.close()
    return out


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_reframer_on_fixed_chunk_sizes(size):
    payloads = stream_of_payloads()
    out = reframe(chunked(b"".join(payloads), iter(lambda: size, None)))
    assert [bytes(p) for p in out] == payloads


@pytest.mark.parametrize("seed", range(10))
def test_reframer_on_random_chunkings(seed):
    rng = random.Random(seed)
    payloads = stream_of_payloads() + [payload("float64", (70_000,), 9)]
    stream = b"".join(payloads)
    sizes = iter(lambda: rng.choice([1, 16, 333, 4096, 65536, rng.randrange(1, len(stream))]), None)
    assert [bytes(p) for p in reframe(chunked(stream, sizes))] == payloads


def test_reframer_returns_a_payload_in_one_chunk_as_it_is():
    data = payload("int64", (50,))
    assert reframe([data])[0] is data


def test_reframer_gathers_split_payloads_aligned_and_writable():
    payloads = [payload("float32", (1, 2, 3, 1000)), payload("float64", (5000,))]
    stream = b"".join(payloads)
    for gathered, data in zip(reframe(chunked(stream, iter(lambda: 1000, None))), payloads):
        view = memoryview(gathered)
        assert not view.readonly and bytes(view) == data
        info = parse(view)
        address = np.frombuffer(view, np.uint8).ctypes.data
        assert (address + info.data_offset) % codec.ALIGNMENT == 0
        array = to_numpy(view)
        assert array.flags.writeable and np.shares_memory(array, np.frombuffer(view, np.uint8))


def test_reframer_close_inside_a_payload():
    data = payload("float32", (100,))
    reframer = Reframer()
    assert list(reframer.feed(data[:200])) == []
    with pytest.raises(FormatError, match=f"stream ended inside a payload: 200 of {len(data)} bytes"):
        reframer.close()


def test_codec_does_not_import_torch():
    import subprocess

    code = "import sys, tannery_protocol.codec, tannery.formats.checkpoint, tannery_protocol.errors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("shape", [(0, 2**62, 4), (0, 2**63), (2**64 - 1, 0), (0, 2**31, 2**31, 2)])
def test_empty_shapes_no_array_can_describe_are_refused(shape):
    # No elements, so nbytes 0 is consistent; but numpy and torch cannot build such a shape.
    with pytest.raises(FormatError, match="too large for an array"):
        parse(raw(code=24, shape=shape, nbytes=0))


def test_empty_shapes_with_large_dimensions_are_fine():
    data = raw(code=24, shape=(0, 2**40), nbytes=0)
    assert to_numpy(data).shape == (0, 2**40)


def test_reframer_gathers_a_payload_larger_than_its_eager_buffer():
    size = gathering.EAGER_GATHER + (5 << 20) + 3
    data = encode_prefix(DTYPES["uint8"], (size,)) + np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes()
    view = memoryview(data)
    reframer = Reframer()
    out = [p for start in range(0, len(data), 1 << 20) for p in reframer.feed(view[start : start + (1 << 20)])]
    reframer.close()
    (gathered,) = out
    assert memoryview(gathered).nbytes == len(data) and gathered == view
    assert (np.frombuffer(gathered, np.uint8).ctypes.data + parse(data).data_offset) % codec.ALIGNMENT == 0
    assert not memoryview(gathered).readonly


def test_the_dtype_table_agrees_with_numpy() -> None:
    """The table names each dtype's element size without importing numpy; numpy's dtypes
    (ml_dtypes' for bfloat16 and float8), made on first use, agree with it."""
    for dtype in codec.DTYPES.values():
        assert dtype.numpy.itemsize == dtype.itemsize, dtype
        assert codec.dtype_of_numpy(dtype.numpy) is dtype
    assert codec.DTYPES["bfloat16"].numpy.name == "bfloat16" and codec.DTYPES["bool"].numpy == np.bool_
