"""Receive buffers used again once their tensors are gone, and pages faulted in from the end."""

from __future__ import annotations

import gc
import mmap
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

import tannery
from tannery import buffer_pool, framing

from .server_harness import running_server, wait_for

MiB = 1 << 20
SIZE = 8 * MiB  # over framing.MAP_GATHER: a map of its own


def backing(view: memoryview) -> mmap.mmap:
    """The map behind a buffer the pool handed out (its owner is a numpy array over the map)."""
    owner = view.obj
    assert isinstance(owner, np.ndarray) and isinstance(owner.base, memoryview), owner
    return owner.base.obj


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch) -> Iterator[None]:
    """An empty pool whose maps stay idle long enough for a loaded machine (the expiry test sets its own)."""
    monkeypatch.setattr(buffer_pool, "IDLE_SECONDS", 60.0)
    buffer_pool.clear()
    yield
    buffer_pool.clear()


def test_a_buffer_comes_back_when_its_tensor_is_gone_and_the_next_receive_takes_its_map():
    buffer = framing.receive_buffer(SIZE, 56)
    first = backing(buffer)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    del buffer
    gc.collect()
    assert buffer_pool.idle_bytes() == 0, "given back while a tensor still used it"
    del tensor
    assert buffer_pool.idle_bytes() == len(first)
    again = framing.receive_buffer(SIZE, 56)
    assert backing(again) is first and buffer_pool.idle_bytes() == 0


def test_a_map_in_use_is_never_handed_out_twice_and_its_bytes_stay():
    held = framing.receive_buffer(SIZE, 8)
    held[:] = b"\x07" * SIZE
    others = [framing.receive_buffer(SIZE, 8) for _ in range(3)]
    for other in others:
        other[:] = b"\x01" * SIZE
    maps = {id(backing(b)) for b in [held, *others]}
    assert len(maps) == 4
    assert bytes(held[:16]) == b"\x07" * 16 and held[SIZE - 1] == 7


def test_a_request_much_smaller_than_an_idle_map_gets_a_new_one():
    big = framing.receive_buffer(4 * SIZE, 8)
    big_map = backing(big)
    del big
    small = framing.receive_buffer(SIZE, 8)
    assert backing(small) is not big_map and buffer_pool.idle_bytes() == len(big_map)


def test_the_pool_keeps_no_more_than_its_limit_unmapping_the_oldest(monkeypatch):
    monkeypatch.setattr(buffer_pool, "IDLE_BYTES", 2 * SIZE + 2 * mmap.PAGESIZE)
    buffers = [framing.receive_buffer(SIZE, 8) for _ in range(3)]
    maps = [backing(b) for b in buffers]
    while buffers:  # given back in order, the first the oldest
        del buffers[0]
    assert buffer_pool.idle_bytes() == len(maps[1]) + len(maps[2])
    assert maps[0].closed and not maps[1].closed and not maps[2].closed


def test_idle_maps_are_unmapped_after_the_idle_time(monkeypatch):
    monkeypatch.setattr(buffer_pool, "IDLE_SECONDS", 0.2)
    buffer = framing.receive_buffer(SIZE, 8)
    memory = backing(buffer)
    del buffer
    assert buffer_pool.idle_bytes() == len(memory)
    assert wait_for(lambda: buffer_pool.idle_bytes() == 0, timeout=5)
    assert memory.closed


def test_a_gathered_payload_takes_an_idle_map_it_fits_whole():
    from tannery.codec import DTYPES, encode_prefix

    size = 64 * MiB
    data = memoryview(bytearray(encode_prefix(DTYPES["uint8"], (size,))) + bytes(range(256)) * (size // 256))

    def gather() -> memoryview:
        reframer = framing.Reframer()
        (payload,) = [p for start in range(0, len(data), MiB) for p in reframer.feed(data[start : start + MiB])]
        return payload

    first = gather()
    first_map = backing(first)
    assert first == data
    del first
    second = gather()
    assert backing(second) is first_map and second == data


def _resident_bytes(view: memoryview) -> int:
    """Bytes of ``view``'s pages in memory now (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    address = np.frombuffer(view, np.uint8).ctypes.data
    start = address - address % mmap.PAGESIZE
    pages = (address + view.nbytes - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vector) == 0
    return sum(1 for v in vector if v & 1) * mmap.PAGESIZE


def _fault_in_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tannery-fault-in"]


def test_fresh_pages_are_faulted_in_from_the_end_while_the_body_runs(monkeypatch):
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", float("inf"))  # never cheap: the thread goes on to the start
    buffer = framing.receive_buffer(64 * MiB, 8)
    assert _resident_bytes(buffer) < MiB  # a fresh map: nothing there yet
    with buffer_pool.faulting_in_behind(buffer):
        assert wait_for(lambda: _resident_bytes(buffer) == 64 * MiB + mmap.PAGESIZE, timeout=10), \
            "the pages were not faulted in"
    assert not _fault_in_threads()


def test_the_fault_in_thread_stops_after_a_step_whose_pages_came_cheap(monkeypatch):
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", 0.0)  # every step is cheap
    buffer = framing.receive_buffer(64 * MiB, 8)
    with buffer_pool.faulting_in_behind(buffer):
        assert wait_for(lambda: not _fault_in_threads(), timeout=10)
        resident = _resident_bytes(buffer)
    assert buffer_pool.FAULT_STEP <= resident <= buffer_pool.FAULT_STEP + mmap.PAGESIZE


def test_the_fault_in_thread_stops_when_the_body_fails(monkeypatch):
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", float("inf"))
    buffer = framing.receive_buffer(256 * MiB, 8)
    with pytest.raises(ConnectionError):
        with buffer_pool.faulting_in_behind(buffer):
            raise ConnectionError("cut off")
    assert not _fault_in_threads()
    assert _resident_bytes(buffer) < 256 * MiB  # stopped before it had faulted everything in


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_client_fetching_again_receives_into_the_map_of_the_tensor_it_dropped(tmp_path: Path, transport):
    tensor = torch.arange(16 * MiB, dtype=torch.float32)  # 64 MiB
    with running_server(tmp_path) as server, tannery.Client(server.target, transport=transport) as client:
        client.store("m", {"w": tensor})
        first = client.fetch("m").find("w")
        assert torch.equal(first, tensor)
        address = first.data_ptr()
        del first
        gc.collect()
        assert buffer_pool.idle_bytes() > 64 * MiB - 1
        second = client.fetch("m").find("w")
        assert torch.equal(second, tensor) and second.data_ptr() == address
        assert buffer_pool.idle_bytes() == 0  # taken from the pool, not a new map at the same address
        second.fill_(0)  # the tensor is the user's to write, and the store keeps its bytes
        del second
        assert torch.equal(client.fetch("m").find("w"), tensor)


def test_a_forked_child_starts_with_an_empty_pool():
    import os

    buffer = framing.receive_buffer(SIZE, 8)
    del buffer
    assert buffer_pool.idle_bytes() > 0
    child = os.fork()
    if child == 0:
        os._exit(0 if buffer_pool.idle_bytes() == 0 else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buffer_pool.idle_bytes() > 0  # the parent's pool is its own


def test_a_numpy_view_alone_keeps_the_map_out_of_the_pool():
    buffer = framing.receive_buffer(SIZE, 8)
    every_other = np.frombuffer(buffer, np.uint8)[::2]
    del buffer
    assert buffer_pool.idle_bytes() == 0
    del every_other
    assert buffer_pool.idle_bytes() > SIZE


def test_a_map_given_back_while_the_pool_is_busy_waits_for_the_holder_and_nothing_blocks():
    """A finalizer may run anywhere, in the pool's own code included (a collection inside
    reuse()): it neither waits for the lock nor changes the pool under its holder."""
    buffer = framing.receive_buffer(SIZE, 8)
    memory = backing(buffer)
    with buffer_pool._lock:  # the pool busy, on this very thread
        del buffer  # the finalizer runs here, and must not block
        assert buffer_pool._idle == []  # not moved in under the holder
    assert buffer_pool.idle_bytes() == len(memory)  # the next holder moved it in
    assert backing(framing.receive_buffer(SIZE, 8)) is memory


def test_maps_given_back_from_many_threads_at_once_all_land_in_the_pool():
    buffers: list = [framing.receive_buffer(SIZE, 8) for _ in range(8)]
    maps = {id(backing(b)) for b in buffers}
    start = threading.Barrier(8)

    def drop(index: int) -> None:
        start.wait()
        buffers[index] = None

    threads = [threading.Thread(target=drop, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    length = len(backing(framing.receive_buffer(SIZE, 8)))  # taken from the pool, and given back
    assert buffer_pool.idle_bytes() == 8 * length
    assert {id(memory) for _, memory in buffer_pool._idle} == maps


@pytest.mark.parametrize("value, limit", [("", 2 << 30), ("0", 0), ("1048576", MiB), ("lots", 2 << 30), ("-1", 2 << 30)])
def test_the_pool_limit_comes_from_the_environment_and_a_bad_value_is_warned_about(monkeypatch, value, limit):
    monkeypatch.setenv("TANNERY_RECEIVE_POOL_BYTES", value)
    bad = value in ("lots", "-1")
    with pytest.warns(RuntimeWarning, match="TANNERY_RECEIVE_POOL_BYTES") if bad else _no_warning():
        assert buffer_pool._idle_bytes_from_environment() == limit


def test_a_pool_limit_of_zero_keeps_nothing(monkeypatch):
    monkeypatch.setattr(buffer_pool, "IDLE_BYTES", 0)
    buffer = framing.receive_buffer(SIZE, 8)
    memory = backing(buffer)
    del buffer
    assert buffer_pool.idle_bytes() == 0 and memory.closed is False  # left to go with its last reference
    assert backing(framing.receive_buffer(SIZE, 8)) is not memory


def _no_warning():
    import warnings
    from contextlib import contextmanager

    @contextmanager
    def checking():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield

    return checking()
