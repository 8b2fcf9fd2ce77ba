"""The Reframer's gather buffers at each size class: heap, a map allocated whole, a growing map."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tannery import gathering
from tannery_protocol import codec, framing
from tannery_protocol.codec import DTYPES, encode_prefix, parse, to_numpy
from tannery.gathering import Reframer

MiB = 1 << 20


@pytest.mark.parametrize("size", [MiB + 5, gathering.MAP_GATHER + 7, gathering.EAGER_GATHER + 3 * MiB + 1])
@pytest.mark.parametrize("huge_pages", [False, True])
def test_split_payloads_are_gathered_aligned_writable_and_whole(size, huge_pages, monkeypatch):
    monkeypatch.setattr(gathering, "HUGE_PAGES", huge_pages)
    data = bytearray(encode_prefix(DTYPES["uint8"], (size,)))
    data += np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    view = memoryview(data)
    reframer = Reframer()
    out = [p for start in range(0, len(data), 300_001) for p in reframer.feed(view[start : start + 300_001])]
    reframer.close()
    (gathered,) = out
    assert gathered.nbytes == len(data) and gathered == view and not gathered.readonly
    array = to_numpy(gathered)
    assert (array.ctypes.data % codec.ALIGNMENT) == 0
    assert np.shares_memory(array, np.frombuffer(gathered, np.uint8))
    owner = gathered.obj
    assert isinstance(owner, mmap.mmap) == (size + codec.ALIGNMENT >= gathering.MAP_GATHER)


def test_a_map_is_never_larger_than_its_payload_needs():
    size = gathering.MAP_GATHER * 2
    data = bytearray(encode_prefix(DTYPES["uint8"], (size,))) + bytes(size)
    reframer = Reframer()
    (gathered,) = [p for start in range(0, len(data), MiB) for p in reframer.feed(memoryview(data)[start : start + MiB])]
    assert len(gathered.obj) < len(data) + codec.ALIGNMENT
    assert parse(gathered).size == len(data)


@pytest.mark.parametrize("advice", [None, 0x7FFF])  # no such advice (not Linux), one the kernel refuses
def test_gathering_without_populating_the_map_ahead(advice, monkeypatch):
    monkeypatch.setattr(gathering, "_MADV_POPULATE_WRITE", advice)
    size = gathering.EAGER_GATHER + 3 * MiB + 1
    data = bytearray(encode_prefix(DTYPES["uint8"], (size,)))
    data += np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    reframer = Reframer()
    (gathered,) = [p for start in range(0, len(data), MiB) for p in reframer.feed(memoryview(data)[start : start + MiB])]
    assert gathered == memoryview(data) and isinstance(gathered.obj, mmap.mmap)


@pytest.mark.parametrize("size", [MiB, gathering.MAP_GATHER, 64 * MiB + 3])
@pytest.mark.parametrize("data_offset", [8, 56, 120])
def test_receive_buffers_are_aligned_writable_and_large_ones_are_maps_without_huge_pages(size, data_offset):
    buffer = gathering.receive_buffer(size, data_offset)
    assert buffer.nbytes == size and not buffer.readonly
    assert np.frombuffer(buffer, np.uint8)[data_offset:].ctypes.data % codec.ALIGNMENT == 0
    buffer[-1] = 7  # the whole size is there
    large = size + codec.ALIGNMENT >= gathering.MAP_GATHER
    assert isinstance(buffer.obj, mmap.mmap) == large  # numpy's arrays would ask for huge pages
    if large:
        assert len(buffer.obj) < size + codec.ALIGNMENT
