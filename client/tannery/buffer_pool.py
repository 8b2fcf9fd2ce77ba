"""Memory for received payloads: anonymous maps used again once the tensors made of them are
gone, and a fresh buffer's pages faulted in from its end while a receive fills it from its start.

A fresh map costs a page fault and a zeroed page for every 4 KiB a receive writes: 0.2-0.3
client CPU-s per GiB here, and up to 2 s when the virtual machine's host must back the pages
again (docs/benchmarks.md, "Data paths: fourth measurement"). A client that fetches or subscribes
over and over gets pages it already has instead. A map is handed out through an owner (a
numpy array over it) and comes back to the pool when that owner is gone, and with it every
tensor and view made of the map; nothing else ever holds the map. Idle maps are kept for
:data:`IDLE_SECONDS` (a second: the next payload of a stream), and :data:`IDLE_BYTES` of them
at most, then unmapped.

The first receive into fresh pages pays for them all the same (a new process's first 1 GiB
Fetch spent 1.5-2.7 s in the kernel here): :func:`faulting_in_behind` shares that work with
another core.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import sys
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Iterator

from ._lazy import lazy_module

np = lazy_module("numpy")



def _idle_bytes_from_environment(default: int = 2 << 30) -> int:
    """``TANNERY_RECEIVE_POOL_BYTES`` (bytes; 0 turns the pool off), else ``default``; a value that
    is not a number of bytes is warned about and ignored."""
    value = os.environ.get("TANNERY_RECEIVE_POOL_BYTES", "").strip()
    if not value:
        return default
    try:
        limit = int(value)
        if limit < 0:
            raise ValueError
    except ValueError:
        warnings.warn(f"TANNERY_RECEIVE_POOL_BYTES={value!r} is not a number of bytes (0 turns the pool "
                      f"off): the default, {default}, is used", RuntimeWarning, stacklevel=2)
        return default
    return limit


#: Idle maps kept at most, in bytes (the oldest are unmapped first); ``TANNERY_RECEIVE_POOL_BYTES``.
IDLE_BYTES = _idle_bytes_from_environment()
#: An idle map not taken again within this many seconds is unmapped: long enough for a stream
#: of payloads (fetch_iter, a subscription), short enough to leave other processes the pages.
#: Kept 10 s, the maps made the rest of this VM draw pages its host had to back again: beside
#: a client fetching 1 GiB every few seconds, the server's local Store fell from 0.68-0.76x of
#: Flight DoPut to 0.42-0.44x, Flight's DoGet from 1.10-1.18 GB/s to 0.64-0.98.
IDLE_SECONDS = 1.0
#: A pooled map is taken for a request of at least this fraction of its length (a smaller
#: request gets a new map rather than pin a much larger one).
FIT = 7 / 8

# A finalizer runs on whatever thread drops the last reference, in the middle of any code,
# this module's included (a collection inside reuse()). So it never touches the pool: it
# appends to _returned (atomic), and whoever holds _lock moves those maps into _idle, the
# finalizer itself when the lock is free, else the holder once it lets go (_settle).
_lock = threading.Lock()
_returned: collections.deque[tuple[float, mmap.mmap]] = collections.deque()
_idle: list[tuple[float, mmap.mmap]] = []  # (since when idle, map), oldest first; under _lock
_timer: threading.Timer | None = None  # under _lock


def new_map(size: int) -> mmap.mmap:
    """A fresh private anonymous map of ``size`` bytes."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


def reuse(size: int) -> mmap.mmap | None:
    """The smallest idle map of at least ``size`` bytes that fits (its pages are there, holding
    old bytes the caller overwrites); None when there is none."""
    with _lock:
        leaving = _take_returned()
        fitting = [(len(memory), index) for index, (_, memory) in enumerate(_idle)
                   if size <= len(memory) and size >= len(memory) * FIT]
        chosen = _idle.pop(min(fitting)[1])[1] if fitting else None
    _settle(leaving)
    return chosen


def hand_out(memory: mmap.mmap) -> memoryview:
    """A writable view of the whole map that gives the map back to the pool once it, and every
    view and tensor made of it, is gone. The caller keeps no other reference to ``memory``.
    The view's ``obj`` (a numpy array) spans the whole map: bytes outside what the caller
    fills may be an earlier payload's, of this same process."""
    owner = np.frombuffer(memory, dtype=np.uint8)
    weakref.finalize(owner, _give_back, memory).atexit = False
    return memoryview(owner)


def idle_bytes() -> int:
    """Bytes of idle maps in the pool now."""
    with _lock:
        leaving = _take_returned()
        held = sum(len(memory) for _, memory in _idle)
    _settle(leaving)
    return held


def clear() -> None:
    """Unmap every idle map now."""
    global _timer
    with _lock:
        leaving = _take_returned() + [memory for _, memory in _idle]
        _idle.clear()
        if _timer is not None:
            _timer.cancel()
            _timer = None
    _settle(leaving)


def _give_back(memory: mmap.mmap) -> None:
    """The finalizer of an owner: runs as the owner goes, which may still export the map for a
    moment (so a map not kept is left to go with it, not closed here)."""
    if IDLE_BYTES <= 0 or len(memory) > IDLE_BYTES:
        return
    _returned.append((time.monotonic(), memory))
    _settle([])


def _settle(leaving: list[mmap.mmap]) -> None:
    """Unmap ``leaving`` (maps taken out of the pool under the lock), then move maps given back
    meanwhile into the pool, unless another holder of the lock will (it calls this after)."""
    for memory in leaving:
        _unmap(memory)
    while _returned:
        if not _lock.acquire(blocking=False):
            return  # the holder settles on its way out
        try:
            leaving = _take_returned()
        finally:
            _lock.release()
        for memory in leaving:
            _unmap(memory)


def _take_returned() -> list[mmap.mmap]:
    """Move the maps given back into the pool, oldest out beyond :data:`IDLE_BYTES`, and arm the
    expiry timer (lock held); returns the maps to unmap once the lock is let go."""
    while _returned:
        _idle.append(_returned.popleft())
    leaving = []
    held = sum(len(memory) for _, memory in _idle)
    while held > IDLE_BYTES and _idle:
        _, oldest = _idle.pop(0)
        held -= len(oldest)
        leaving.append(oldest)
    _arm()
    return leaving


def _unmap(memory: mmap.mmap) -> None:
    """Unmap an idle map now; one an owner going away still exports goes with that export."""
    try:
        memory.close()
    except BufferError:
        pass


def _arm() -> None:
    """Start the timer that unmaps maps left idle, unless one is running (lock held)."""
    global _timer
    if _timer is not None or not _idle:
        return
    delay = max(0.0, _idle[0][0] + IDLE_SECONDS - time.monotonic())
    timer = threading.Timer(delay, _expire)
    timer.args = (timer,)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # the interpreter is shutting down: the maps go with the process
        return
    _timer = timer


def _expire(timer: threading.Timer) -> None:
    global _timer
    with _lock:
        if _timer is not timer:
            return  # cancelled (clear) while it waited for the lock
        _timer = None
        leaving = _take_returned()
        now = time.monotonic()
        leaving += [memory for since, memory in _idle if now - since >= IDLE_SECONDS]
        _idle[:] = [(since, memory) for since, memory in _idle if now - since < IDLE_SECONDS]
        _arm()
    _settle(leaving)


def _after_fork_in_child() -> None:
    """A forked child starts with an empty pool: it has the idle maps (copy-on-write) but not
    the timer thread that would unmap them, so they go now (with their last reference)."""
    global _timer, _lock
    _lock = threading.Lock()
    _timer = None
    _idle.clear()
    _returned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- Pages faulted in ahead ---------------------------------------------------------------

#: Buffers from this size get a thread faulting their pages in from the end.
FAULT_BEHIND_FROM = 32 << 20
#: Bytes that thread faults in per call (a receive that has passed them stops it soon).
FAULT_STEP = 16 << 20
#: Pages faulted in faster than this (bytes per second) are cheap: the receive faults them in
#: about as fast itself, and a third busy thread on two cores slowed a 1 GiB Fetch by 15%
#: here, so the thread stops. Pages the host must back again came at 0.4 GB/s.
CHEAP_PAGES = 2e9
_MADV_POPULATE_WRITE = 23  # Linux 5.14


_madvise_function: object = None


def _madvise():
    """libc's ``madvise`` through ctypes, which lets go of the GIL for the call (``mmap.madvise``
    holds it), looked up on first use; None off Linux."""
    global _madvise_function
    if _madvise_function is None:
        function = False
        if sys.platform == "linux":
            try:
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                function.restype = ctypes.c_int
            except (OSError, AttributeError):
                function = False
        _madvise_function = function
    return _madvise_function or None


@contextmanager
def faulting_in_behind(buffer: memoryview) -> Iterator[None]:
    """While the body fills ``buffer`` from its start, fault its pages in from its end on another
    thread (``MADV_POPULATE_WRITE``, step by step backwards), so that the two meet in the middle
    and each core pays for half the fresh pages; the thread stops at the first step whose pages
    came cheap (:data:`CHEAP_PAGES`: pages already there, or fresh ones the kernel has at hand).
    The thread is stopped and joined when the body ends, however it ends."""
    madvise = _madvise() if buffer.nbytes >= FAULT_BEHIND_FROM else None
    if madvise is None:
        yield
        return
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data  # the array goes at once; the buffer stays
    stop = threading.Event()
    thread = threading.Thread(target=_fault_in_backwards, args=(madvise, address, buffer.nbytes, stop),
                              name="tannery-fault-in", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _fault_in_backwards(madvise, address: int, size: int, stop: threading.Event) -> None:
    page = mmap.PAGESIZE
    end = address + size
    while end > address and not stop.is_set():
        start = max(address, end - FAULT_STEP)
        aligned = start - start % page
        began = time.perf_counter()
        if madvise(aligned, end - aligned, _MADV_POPULATE_WRITE) != 0:
            return  # a kernel without it: the receive faults the pages in itself
        if (end - aligned) > CHEAP_PAGES * (time.perf_counter() - began):
            return
        end = start
