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
from tannery.dataplane import gathering
from tannery.dataplane import receive_memory
from tannery.dataplane.receive_memory import ReceivePool
from tannery_protocol import codec
from tannery_protocol.codec import DTYPES, encode_prefix

from .server_harness import running_server, wait_for

MiB = 1 << 20
SIZE = 8 * MiB  # over gathering.MAP_GATHER: a map of its own


def address(buffer: memoryview) -> int:
    """Where ``buffer``'s bytes are in this process's memory."""
    return np.frombuffer(buffer, np.uint8).ctypes.data


def mark(buffer: memoryview, byte: int) -> memoryview:
    """``buffer`` with ``byte`` in its first and last 64 bytes (a fresh map holds zeros)."""
    buffer[:64] = bytes([byte]) * 64
    buffer[-64:] = bytes([byte]) * 64
    return buffer


def marked(buffer: memoryview, byte: int) -> bool:
    """``buffer`` holds what :func:`mark` wrote: its memory is that of the buffer marked, used again."""
    return bytes(buffer[:64]) == bytes(buffer[-64:]) == bytes([byte]) * 64


def maps_of(count: int, size: int = SIZE) -> range:
    """The bytes ``count`` idle maps of buffers of ``size`` may take (a pad aligns their data)."""
    return range(count * size, count * (size + codec.ALIGNMENT))


def mapped(start: int, size: int) -> bool:
    """One mapping of this process covers ``[start, start + size)`` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
        if low <= start and start + size <= high:
            return True
    return False


def on_a_thread(call, timeout: float = 10):
    """``call()`` on another thread; fails (instead of hanging) if it has not returned in ``timeout`` s."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"blocked for {timeout} s"
    return result[0]


def test_a_buffer_comes_back_when_its_tensor_is_gone_and_the_next_receive_takes_its_map():
    pool = ReceivePool()
    buffer = mark(gathering.receive_buffer(SIZE, 56, pool), 7)
    first = address(buffer)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    del buffer
    gc.collect()
    assert pool.idle_bytes() == 0, "given back while a tensor still used it"
    del tensor
    assert pool.idle_bytes() in maps_of(1)
    again = gathering.receive_buffer(SIZE, 56, pool)
    assert address(again) == first and marked(again, 7) and pool.idle_bytes() == 0


def test_without_a_pool_a_receive_buffer_is_a_fresh_map_of_its_own():
    buffer = gathering.receive_buffer(SIZE, 56)
    assert isinstance(buffer.obj, mmap.mmap)
    assert not any(np.frombuffer(buffer, np.uint8))


def test_a_map_in_use_is_never_handed_out_twice_and_its_bytes_stay():
    pool = ReceivePool()
    held = gathering.receive_buffer(SIZE, 8, pool)
    held[:] = b"\x07" * SIZE
    others = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(3)]
    for other in others:
        other[:] = b"\x01" * SIZE
    assert len({address(b) for b in [held, *others]}) == 4
    assert bytes(held[:16]) == b"\x07" * 16 and held[SIZE - 1] == 7


def test_a_numpy_view_alone_keeps_the_map_out_of_the_pool():
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 8, pool)
    every_other = np.frombuffer(buffer, np.uint8)[::2]
    del buffer
    assert pool.idle_bytes() == 0
    del every_other
    assert pool.idle_bytes() in maps_of(1)


def test_a_request_much_smaller_than_an_idle_map_gets_a_new_one():
    pool = ReceivePool()
    big = mark(gathering.receive_buffer(4 * SIZE, 8, pool), 9)
    big_address = address(big)
    del big
    small = gathering.receive_buffer(SIZE, 8, pool)
    assert address(small) != big_address and not marked(small, 9)
    assert pool.idle_bytes() in maps_of(1, 4 * SIZE)


def test_a_pool_keeps_its_newest_maps_up_to_its_limits_unmapping_the_oldest():
    assert receive_memory.IDLE_MAPS == 2
    pool = ReceivePool()
    buffers = [mark(gathering.receive_buffer(SIZE, 8, pool), i + 1) for i in range(3)]
    addresses = [address(b) for b in buffers]
    while buffers:  # given back in order, the first the oldest
        del buffers[0]
    assert pool.idle_bytes() in maps_of(2)
    assert not mapped(addresses[0], SIZE), "the oldest map is still there"
    again = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(3)]
    assert sorted((address(b), marked(b, i + 2)) for i, b in enumerate(again[:2])) == sorted(
        (a, True) for a in addresses[1:])
    assert not any(marked(again[2], byte) for byte in (1, 2, 3))  # a fresh one: the pool had two


def test_a_map_given_back_to_a_pool_that_is_gone_goes_with_its_last_reference():
    pool = ReceivePool()
    buffer = gathering.receive_buffer(SIZE, 8, pool)
    start = address(buffer)
    del pool
    gc.collect()
    del buffer  # the finalizer finds no pool, and nothing fails
    assert not mapped(start, SIZE)


def test_a_map_given_back_while_the_pool_chooses_one_lands_in_it_and_nothing_blocks(monkeypatch):
    """A finalizer may run anywhere, in the pool's own code included (a collection inside
    reuse(), while it chooses a map): it neither waits for the pool nor loses the map."""
    pool = ReceivePool()
    idle = mark(gathering.receive_buffer(SIZE, 8, pool), 1)
    dropped = [mark(gathering.receive_buffer(SIZE, 8, pool), 2)]
    idle_address, dropped_address = address(idle), address(dropped[0])
    del idle  # one idle map, for the next receive to choose
    ran = []

    class DropsWhenUsed:
        """FIT, whose use while the pool weighs its idle maps drops the last reference to a buffer:
        its map is given back in the middle of reuse(), on the same thread."""

        def __rmul__(self, other: int) -> float:
            if dropped:
                ran.append(True)
                dropped.clear()
            return other * FIT

    FIT = receive_memory.FIT
    monkeypatch.setattr(receive_memory, "FIT", DropsWhenUsed())
    chosen = on_a_thread(lambda: gathering.receive_buffer(SIZE, 8, pool))
    assert ran, "no map was given back while the pool chose one"
    assert address(chosen) == idle_address and marked(chosen, 1)
    assert pool.idle_bytes() in maps_of(1)  # the map given back meanwhile is in the pool now
    again = gathering.receive_buffer(SIZE, 8, pool)
    assert address(again) == dropped_address and marked(again, 2)


def test_maps_given_back_from_many_threads_at_once_all_land_in_the_pool(monkeypatch):
    monkeypatch.setattr(receive_memory, "IDLE_MAPS", 8)
    pool = ReceivePool()
    buffers: list = [mark(gathering.receive_buffer(SIZE, 8, pool), i + 1) for i in range(8)]
    addresses = {address(b): i + 1 for i, b in enumerate(buffers)}
    start = threading.Barrier(8)

    def drop(index: int) -> None:
        start.wait()
        buffers[index] = None

    threads = [threading.Thread(target=drop, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert pool.idle_bytes() in maps_of(8)
    again = [gathering.receive_buffer(SIZE, 8, pool) for _ in range(8)]
    assert {address(b) for b in again} == set(addresses)
    assert all(marked(b, addresses[address(b)]) for b in again)
    assert pool.idle_bytes() == 0


def test_a_gathered_payload_takes_an_idle_map_of_its_stream_it_fits_whole():
    size = 64 * MiB
    data = memoryview(bytearray(encode_prefix(DTYPES["uint8"], (size,))) + bytes(range(256)) * (size // 256))
    pool = ReceivePool()

    def gather() -> memoryview:
        reframer = gathering.Reframer(pool=pool)
        (payload,) = [p for start in range(0, len(data), MiB) for p in reframer.feed(data[start : start + MiB])]
        return payload

    first = gather()
    first_address = address(first)
    assert first == data
    del first
    assert pool.idle_bytes() in maps_of(1, len(data))
    second = gather()  # while the first map is idle in the pool, no new map can be where it is
    assert address(second) == first_address and second == data and pool.idle_bytes() == 0


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
    monkeypatch.setattr(receive_memory, "CHEAP_PAGES", float("inf"))  # never cheap: the thread goes on to the start
    buffer = gathering.receive_buffer(64 * MiB, 8)
    assert _resident_bytes(buffer) < MiB  # a fresh map: nothing there yet
    with receive_memory.faulting_in_behind(buffer):
        assert wait_for(lambda: _resident_bytes(buffer) == 64 * MiB + mmap.PAGESIZE, timeout=10), \
            "the pages were not faulted in"
    assert not _fault_in_threads()


def test_the_fault_in_thread_stops_once_cheap_steps_in_a_row_cover_a_quarter_of_the_buffer(monkeypatch):
    monkeypatch.setattr(receive_memory, "CHEAP_PAGES", 0.0)  # every step is cheap
    buffer = gathering.receive_buffer(8 * receive_memory.FAULT_STEP, 8)
    with receive_memory.faulting_in_behind(buffer):
        assert wait_for(lambda: not _fault_in_threads(), timeout=10)
        resident = _resident_bytes(buffer)
    assert 2 * receive_memory.FAULT_STEP <= resident <= 2 * receive_memory.FAULT_STEP + mmap.PAGESIZE


def test_a_slow_step_after_cheap_ones_keeps_the_fault_in_thread_going(monkeypatch):
    """A warm patch of free pages before cold ones must not stop it: the count starts again."""
    monkeypatch.setattr(receive_memory, "CHEAP_PAGES", receive_memory.FAULT_STEP / 0.1)  # over 100 ms a step: cold
    calls = []

    def second_step_slow(address, length, advice):  # no pages faulted: only the timing matters here
        calls.append(length)
        if len(calls) == 2:
            time.sleep(0.3)
        return 0

    size = 16 * receive_memory.FAULT_STEP  # a quarter: four steps
    receive_memory.fault_in_backwards(second_step_slow, 1 << 30, size, threading.Event())
    assert calls == [receive_memory.FAULT_STEP] * 6  # cheap, cold, then four cheap in a row


def test_the_fault_in_thread_stops_when_the_body_fails(monkeypatch):
    monkeypatch.setattr(receive_memory, "CHEAP_PAGES", float("inf"))
    buffer = gathering.receive_buffer(256 * MiB, 8)
    with pytest.raises(ConnectionError):
        with receive_memory.faulting_in_behind(buffer):
            raise ConnectionError("cut off")
    assert not _fault_in_threads()
    assert _resident_bytes(buffer) < 256 * MiB  # stopped before it had faulted everything in


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_fetch_iter_receives_entries_into_the_maps_of_the_ones_dropped_before(tmp_path: Path, transport, monkeypatch):
    tensors = {f"w{i}": torch.full((4 * MiB,), float(i)) for i in range(6)}  # 16 MiB each
    made = []
    fresh = receive_memory.new_map
    monkeypatch.setattr(receive_memory, "new_map", lambda size: made.append(size) or fresh(size))
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


def test_with_the_tricks_turned_off_no_map_comes_back_or_is_faulted_in(monkeypatch):
    """TANNERY_RECEIVE_TUNING=0: the pool keeps nothing, no thread faults pages in."""
    monkeypatch.setattr(receive_memory, "TUNED", False)
    pool = ReceivePool()
    buffer = mark(gathering.receive_buffer(SIZE, 56, pool), 7)
    del buffer
    gc.collect()
    assert pool.idle_bytes() == 0
    again = gathering.receive_buffer(SIZE, 56, pool)
    assert not marked(again, 7)  # a fresh map, not the one before
    big = gathering.receive_buffer(64 * MiB, 8)
    with receive_memory.faulting_in_behind(big):
        assert not any(t.name == "tannery-fault-in" for t in threading.enumerate())
    assert not receive_memory.populate_write(mmap.mmap(-1, MiB), 0, MiB)
