"""Property tests: valid payloads round trip; anything else is a FormatError, never another exception or a hang.

Every parser here (one payload, a stream of chunks through the Deframer and Reframer, a
pair's metadata file) gets valid input, valid input with truncations, bit flips,
insertions and deletions, and random bytes. Each either returns something consistent with
its input or raises FormatError.
"""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tannery_protocol import codec
from tannery.formats import checkpoint
from tannery_protocol.codec import DTYPES, FormatError, Limits, encode_numpy, encode_prefix, parse, to_numpy
from tannery_protocol.framing import Deframer
from tannery.dataplane.gathering import Reframer

torch = pytest.importorskip("torch")
from tannery import torch as tt  # noqa: E402

# A hang shows as a deadline miss; 2 s is far above any input here, even on a loaded machine.
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])
NAMES = sorted(DTYPES)


# --------------------------------------------------------------------------- strategies


@st.composite
def payloads(draw, max_rank: int = 5) -> bytes:
    """A valid payload: any dtype, rank 0 to ``max_rank``, empty dimensions included."""
    dtype = DTYPES[draw(st.sampled_from(NAMES))]
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=max_rank)))
    numel = math.prod(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype.is_bool:
        buffer = np.packbits(rng.integers(0, 2, numel).astype(bool), bitorder="little").tobytes()
    else:
        buffer = rng.integers(0, 256, numel * dtype.itemsize, dtype=np.uint8).tobytes()
    return encode_prefix(dtype, shape) + buffer


@st.composite
def mutated(draw, valid: st.SearchStrategy[bytes]) -> bytes:
    """``valid`` bytes after one to three truncations, bit flips, byte sets, insertions or deletions."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["truncate", "flip", "set", "insert", "delete"]))
        at = draw(st.integers(0, len(data)))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


def anything(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Valid, mutated, random, or random after a valid magic and version."""
    return st.one_of(
        valid,
        mutated(valid),
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b"ERIC\x01" + b),
    )


def chunkings(data: bytes) -> st.SearchStrategy[list[int]]:
    """Sorted cut points splitting ``data`` into chunks of any sizes, empty ones included."""
    return st.lists(st.integers(0, len(data)), max_size=12).map(sorted)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------- one payload


def check_payload(data: bytes, limits: Limits = codec.DEFAULT_LIMITS) -> codec.PayloadInfo | None:
    """Parse ``data``; when it parses, check that everything agrees with it."""
    try:
        info = parse(data, limits)
    except FormatError as e:
        assert str(e)
        return None
    assert info.size == len(data) <= limits.max_payload
    assert info.rank <= limits.max_rank and info.data_offset == 15 + 18 + 8 * info.rank
    assert info.nbytes == info.dtype.buffer_nbytes(info.numel)
    array = to_numpy(data, limits)
    assert array.shape == info.shape and array.dtype == info.dtype.numpy
    again = encode_numpy(array)
    assert parse(again).shape == info.shape and parse(again).dtype.name == info.dtype.name
    if not info.dtype.is_bool:  # booleans may carry padding bits the re-encoding clears
        assert again[info.data_offset :] == data[info.data_offset :]
    return info


@FUZZ
@given(payloads())
def test_valid_payloads_round_trip(data):
    info = check_payload(data)
    assert info is not None
    assert encode_numpy(to_numpy(data)) == data
    tensor = tt.deserialize(bytearray(data))
    assert tuple(tensor.shape) == info.shape and tt.serialize(tensor) == data
    assert tt.serialize(tt.deserialize(data)) == data


@FUZZ
@given(anything(payloads()))
def test_any_bytes_parse_consistently_or_raise_format_error(data):
    info = check_payload(data)
    for prefix_length in (15, 33, len(data) // 2):
        try:
            partial = codec.read_info(data[:prefix_length])
        except FormatError:
            assert info is None
            continue
        assert partial is None or info is None or partial == info


@FUZZ
@given(anything(payloads()))
def test_torch_deserialize_returns_a_consistent_tensor_or_raises_format_error(data):
    try:
        tensor = tt.deserialize(bytearray(data))
    except FormatError:
        assert check_payload(data) is None
        return
    info = parse(data)
    assert tuple(tensor.shape) == info.shape and tt.codec_dtype(tensor.dtype).name == info.dtype.name


@FUZZ
@given(anything(payloads()), st.integers(40, 200), st.integers(0, 8))
def test_limits_hold_on_any_bytes(data, max_payload, max_rank):
    check_payload(data, Limits(max_payload=max_payload, max_rank=max_rank))


# --------------------------------------------------------------------------- streams


def deframe(chunks: list[bytes], limits: Limits = codec.DEFAULT_LIMITS) -> tuple[list[bytes], bool]:
    """Feed chunks; return the whole payloads seen and whether the stream raised FormatError.

    Checks, as it goes, that fragments come in order with flags and sizes that agree with
    their payload's header, and that each whole payload parses to that header.
    """
    deframer = Deframer(limits)
    done: list[bytes] = []
    current: bytearray | None = None
    info = None
    try:
        for chunk in chunks:
            for fragment in deframer.feed(chunk):
                if fragment.first:
                    assert current is None
                    current, info = bytearray(), fragment.info
                assert current is not None and fragment.info == info
                current += fragment.data
                assert len(current) <= info.size
                if fragment.last:
                    assert len(current) == info.size and parse(current, limits) == info
                    done.append(bytes(current))
                    current = None
        assert deframer.payloads == len(done)
        assert deframer.inside_payload or current is None
        deframer.close()
    except FormatError as e:
        assert str(e)
        return done, True
    assert current is None
    return done, False


streams = st.lists(payloads(max_rank=3), min_size=1, max_size=4)


@FUZZ
@given(streams, st.data())
def test_deframer_reassembles_any_chunking(parts, data):
    stream = b"".join(parts)
    points = data.draw(chunkings(stream))
    done, failed = deframe(cut(stream, points))
    assert not failed and done == parts


@FUZZ
@given(anything(streams.map(b"".join)), st.data())
def test_deframer_on_any_bytes_and_chunking_is_consistent(stream, data):
    points = data.draw(chunkings(stream))
    done, failed = deframe(cut(stream, points))
    assert sum(map(len, done)) <= len(stream)
    # How the bytes are cut changes nothing: the same payloads and the same verdict in one chunk.
    assert deframe([stream]) == (done, failed)


@FUZZ
@given(anything(streams.map(b"".join)), st.data())
def test_reframer_on_any_bytes_and_chunking_is_consistent(stream, data):
    points = data.draw(chunkings(stream))
    expected, failed = deframe([stream])
    reframer = Reframer()
    got = []
    try:
        for chunk in cut(stream, points):
            got.extend(bytes(p) for p in reframer.feed(chunk))
        reframer.close()
    except FormatError:
        assert failed
    else:
        assert not failed
    assert got == expected


# -------------------------------------------------------------------- metadata files


@st.composite
def metadata_files(draw) -> tuple[bytes, int, list[checkpoint.PairEntry]]:
    """A valid metadata file, the size of its data, and its entries (gaps between buffers allowed)."""
    names = draw(st.lists(st.text(min_size=1, max_size=12), max_size=6, unique=True))
    entries, offset = [], 0
    for name in names:
        dtype = DTYPES[draw(st.sampled_from(NAMES))]
        offset += draw(st.integers(0, 8))
        nbytes = dtype.buffer_nbytes(draw(st.integers(0, 20)))
        entries.append(checkpoint.PairEntry(name, dtype, offset, nbytes))
        offset += nbytes
    return checkpoint.encode_metadata(entries), offset + draw(st.integers(0, 8)), entries


def check_metadata(data: bytes, data_nbytes: int) -> list[checkpoint.PairEntry] | None:
    try:
        entries = checkpoint.parse_metadata(data, data_nbytes)
    except FormatError as e:
        assert str(e)
        return None
    names = [e.name for e in entries]
    assert all(names) and len(set(names)) == len(names)
    spans = sorted((e.offset, e.offset + e.nbytes) for e in entries if e.nbytes)
    assert all(end <= data_nbytes for _, end in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(e.dtype.is_bool or e.nbytes % e.dtype.itemsize == 0 for e in entries)
    assert checkpoint.parse_metadata(checkpoint.encode_metadata(entries), data_nbytes) == entries
    return entries


@FUZZ
@given(metadata_files())
def test_valid_metadata_files_parse_to_their_entries(case):
    data, data_nbytes, entries = case
    assert check_metadata(data, data_nbytes) == entries


@FUZZ
@given(metadata_files(), st.data())
def test_any_metadata_bytes_parse_consistently_or_raise_format_error(case, data):
    valid, data_nbytes, _ = case
    raw = data.draw(anything(st.just(valid)))
    check_metadata(raw, data_nbytes)
    check_metadata(raw, data.draw(st.integers(0, 2**64 - 1)))
