"""The Reframer's gather buffers at each size class: heap, a map allocated whole, a growing map."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from tannery.dataplane import gathering, receive_memory
from tannery_protocol import codec, framing
from tannery_protocol.codec import DTYPES, encode_prefix, parse, to_numpy
from tannery.dataplane.gathering import Reframer

MiB = 1 << 20


def _vma(address: int) -> tuple[set[str], int]:
    """The kernel's flags of the mapping of this process that holds ``address`` (``VmFlags`` in
    /proc/self/smaps: ``hg`` when it was advised ``MADV_HUGEPAGE``) and its ``AnonHugePages`` (kB)."""
    flags: set[str] | None = None
    huge_kb = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: low-high perms ...
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            huge_kb = int(line.split()[1])
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags, huge_kb


@pytest.fixture
def huge_pages_seen() -> None:
    """Skips unless this kernel shows huge pages advice in /proc/self/smaps: a map advised
    ``MADV_HUGEPAGE`` here (as numpy advises its arrays from 4 MiB) has the ``hg`` flag."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists():
        pytest.skip("no transparent huge pages on this platform")
    control = mmap.mmap(-1, 8 * MiB, flags=mmap.MAP_PRIVATE)
    try:
        control.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pytest.skip("this kernel refuses MADV_HUGEPAGE")
    address = np.frombuffer(control, np.uint8).ctypes.data
    if "hg" not in _vma(address)[0]:
        pytest.skip("this kernel does not show huge pages advice in /proc/self/smaps")
    control.close()


def assert_no_huge_pages(buffer: memoryview) -> None:
    """``buffer``'s map was never advised huge pages, and (the kernel giving them only where
    advised) has none."""
    flags, huge_kb = _vma(np.frombuffer(buffer, np.uint8).ctypes.data)
    assert "hg" not in flags, f"the map was advised MADV_HUGEPAGE: {sorted(flags)}"
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert huge_kb == 0, f"{huge_kb} kB of the map are in huge pages"


@pytest.mark.parametrize("size", [MiB + 5, gathering.MAP_GATHER + 7, gathering.EAGER_GATHER + 3 * MiB + 1])
def test_split_payloads_are_gathered_aligned_writable_and_whole(size):
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


@pytest.mark.parametrize("advice", [None, 0x7FFF])  # the tricks off (TANNERY_RECEIVE_TUNING=0), an advice refused
def test_gathering_without_populating_the_map_ahead(advice, monkeypatch):
    if advice is None:
        monkeypatch.setattr(receive_memory, "TUNED", False)
    else:
        monkeypatch.setattr(receive_memory, "_MADV_POPULATE_WRITE", advice)
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


@pytest.mark.parametrize("size", [gathering.MAP_GATHER, 64 * MiB + 3])
def test_receive_maps_and_gather_maps_never_ask_for_huge_pages(size, huge_pages_seen):
    received = gathering.receive_buffer(size, 56)
    received[:] = b"\x01" * size  # every page touched: where huge pages were allowed, they would be there now
    assert_no_huge_pages(received)
    # A gathered payload, its map grown as the bytes arrive beyond EAGER_GATHER.
    data = bytearray(encode_prefix(DTYPES["uint8"], (size,))) + bytes(range(256)) * (size // 256) + bytes(size % 256)
    reframer = Reframer()
    (gathered,) = [p for start in range(0, len(data), MiB) for p in reframer.feed(memoryview(data)[start : start + MiB])]
    assert gathered == memoryview(data)
    assert_no_huge_pages(gathered)
