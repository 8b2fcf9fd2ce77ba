"""A stream's receive buffers used again once its tensors are gone, and pages faulted in from the end."""

from __future__ import annotations

import gc
import mmap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tannery
from tannery_protocol import framing
from tannery import gathering
from tannery import buffer_pool
from tannery.buffer_pool import ReceivePool
from tannery_protocol.codec import DTYPES, encode_prefix

from .server_harness import running_server, wait_for

MiB = 1 << 20
SIZE = 8 * MiB  # over gathering.MAP_GATHER: a map of its own


def backing(view: memoryview) -> mmap.mmap:
    """The map behind a buffer a pool handed out (its owner is a numpy array over the map)."""
    owner = view.obj
    assert isinstance(owner, np.ndarray) and isinstance(owner.base, memoryview), owner
    return owner.base.obj


def test_a_buffer_comes_back_when_its_tensor_is_gone_and_the_next_receive_takes_its_map():
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 56, pool)
    first = backing(buffer)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    del buffer
    gc.collect()
    assert pool.idle_bytes() == 0, "given back while a tensor still used it"
    del tensor
    assert pool.idle_bytes() == len(first)
    again = gathering.receive_buffer(SIZE, 56, pool)
    assert backing(again) is first and pool.idle_bytes() == 0


def test_without_a_pool_a_receive_buffer_is_a_fresh_map_of_its_own():
    buffer = gathering.receive_buffer(SIZE, 56)
    assert isinstance(buffer.obj, mmap.mmap)


def test_a_map_in_use_is_never_handed_out_twice_and_its_bytes_stay():
    pool = ReceivePool()
    held = gathering.receive_buffer(SIZE, 8, pool)
    held[:] = b"\x07" * SIZE
    others = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(3)]
    for other in others:
        other[:] = b"\x01" * SIZE
    assert len({id(backing(b)) for b in [held, *others]}) == 4
    assert bytes(held[:16]) == b"\x07" * 16 and held[SIZE - 1] == 7


def test_a_numpy_view_alone_keeps_the_map_out_of_the_pool():
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 8, pool)
    every_other = np.frombuffer(buffer, np.uint8)[::2]
    del buffer
    assert pool.idle_bytes() == 0
    del every_other
    assert pool.idle_bytes() > SIZE


def test_a_request_much_smaller_than_an_idle_map_gets_a_new_one():
    pool = ReceivePool()
    big = gathering.receive_buffer(4 * SIZE, 8, pool)
    big_map = backing(big)
    del big
    small = gathering.receive_buffer(SIZE, 8, pool)
    assert backing(small) is not big_map and pool.idle_bytes() == len(big_map)


def test_a_pool_keeps_its_newest_maps_up_to_its_limits_unmapping_the_oldest():
    pool = ReceivePool()
    buffers = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(buffer_pool.IDLE_MAPS + 1)]
    maps = [backing(b) for b in buffers]
    while buffers:  # given back in order, the first the oldest
        del buffers[0]
    assert pool.idle_bytes() == sum(len(m) for m in maps[1:])
    assert maps[0].closed and not any(m.closed for m in maps[1:])


def test_a_map_given_back_to_a_pool_that_is_gone_goes_with_its_last_reference():
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 8, pool)
    del pool
    gc.collect()
    del buffer  # the finalizer finds no pool, and nothing fails


def test_a_map_given_back_while_the_pool_is_busy_waits_for_the_holder_and_nothing_blocks():
    """A finalizer may run anywhere, in the pool's own code included (a collection inside
    reuse()): it neither waits for the lock nor changes the pool under its holder."""
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 8, pool)
    memory = backing(buffer)
    with pool._lock:  # the pool busy, on this very thread
        del buffer  # the finalizer runs here, and must not block
        assert pool._idle == []  # not moved in under the holder
    assert pool.idle_bytes() == len(memory)  # the next holder moved it in
    assert backing(gathering.receive_buffer(SIZE, 8, pool)) is memory


def test_maps_given_back_from_many_threads_at_once_all_land_in_the_pool(monkeypatch):
    monkeypatch.setattr(buffer_pool, "IDLE_MAPS", 8)
    pool = ReceivePool()
    buffers: list = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(8)]
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
    assert {id(memory) for memory in pool._idle} | {id(m) for m in pool._returned} == maps
    assert pool.idle_bytes() == 8 * len(next(iter(pool._idle)))


def test_a_gathered_payload_takes_an_idle_map_of_its_stream_it_fits_whole():
    size = 64 * MiB
    data = memoryview(bytearray(encode_prefix(DTYPES["uint8"], (size,))) + bytes(range(256)) * (size // 256))
    pool = ReceivePool()

    def gather() -> memoryview:
        reframer = gathering.Reframer(pool=pool)
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
    buffer = gathering.receive_buffer(64 * MiB, 8)
    assert _resident_bytes(buffer) < MiB  # a fresh map: nothing there yet
    with buffer_pool.faulting_in_behind(buffer):
        assert wait_for(lambda: _resident_bytes(buffer) == 64 * MiB + mmap.PAGESIZE, timeout=10), \
            "the pages were not faulted in"
    assert not _fault_in_threads()


def test_the_fault_in_thread_stops_once_cheap_steps_in_a_row_cover_a_quarter_of_the_buffer(monkeypatch):
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", 0.0)  # every step is cheap
    buffer = gathering.receive_buffer(8 * buffer_pool.FAULT_STEP, 8)
    with buffer_pool.faulting_in_behind(buffer):
        assert wait_for(lambda: not _fault_in_threads(), timeout=10)
        resident = _resident_bytes(buffer)
    assert 2 * buffer_pool.FAULT_STEP <= resident <= 2 * buffer_pool.FAULT_STEP + mmap.PAGESIZE


def test_a_slow_step_after_cheap_ones_keeps_the_fault_in_thread_going(monkeypatch):
    """A warm patch of free pages before cold ones must not stop it: the count starts again."""
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", buffer_pool.FAULT_STEP / 0.1)  # over 100 ms a step: cold
    calls = []

    def second_step_slow(address, length, advice):  # no pages faulted: only the timing matters here
        calls.append(length)
        if len(calls) == 2:
            time.sleep(0.3)
        return 0

    size = 16 * buffer_pool.FAULT_STEP  # a quarter: four steps
    buffer_pool._fault_in_backwards(second_step_slow, 1 << 30, size, threading.Event())
    assert calls == [buffer_pool.FAULT_STEP] * 6  # cheap, cold, then four cheap in a row


def test_the_fault_in_thread_stops_when_the_body_fails(monkeypatch):
    monkeypatch.setattr(buffer_pool, "CHEAP_PAGES", float("inf"))
    buffer = gathering.receive_buffer(256 * MiB, 8)
    with pytest.raises(ConnectionError):
        with buffer_pool.faulting_in_behind(buffer):
            raise ConnectionError("cut off")
    assert not _fault_in_threads()
    assert _resident_bytes(buffer) < 256 * MiB  # stopped before it had faulted everything in


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_fetch_iter_receives_entries_into_the_maps_of_the_ones_dropped_before(tmp_path: Path, transport, monkeypatch):
    tensors = {f"w{i}": torch.full((4 * MiB,), float(i)) for i in range(6)}  # 16 MiB each
    made = []
    fresh = buffer_pool.new_map
    monkeypatch.setattr(buffer_pool, "new_map", lambda size: made.append(size) or fresh(size))
    with running_server(tmp_path) as server, tannery.Client(server.target, transport=transport) as client:
        client.store("m", tensors)
        for name, tensor in client.fetch_iter("m"):
            assert torch.equal(tensor, tensors[name])
            tensor.fill_(-1)  # the user's to write: the next entries' bytes are their own
            del tensor
        # The entry before is still referenced while the next one arrives: two maps take turns.
        assert 1 <= len(made) <= 2, f"{len(made)} fresh maps for 6 entries dropped as they came"
        made.clear()
        kept = [tensor for _, tensor in client.fetch_iter("m")]  # all held: nothing to reuse
        assert len(made) == 6
        assert all(torch.equal(t, tensors[f"w{i}"]) for i, t in enumerate(kept))
