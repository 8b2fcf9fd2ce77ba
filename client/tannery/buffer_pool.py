"""Memory for received payloads: anonymous maps used again once the tensors made of them are
gone, and a fresh buffer's pages faulted in from its end while a receive fills it from its start.

A fresh map costs a page fault and a zeroed page for every 4 KiB a receive writes: 0.2-0.3
client CPU-s per GiB here, and up to 2 s when the virtual machine's host must back the pages
again (docs/benchmarks.md, "Receive buffers used again"). A client that fetches or subscribes
over and over gets pages it already has instead. A map is handed out through an owner (a
numpy array over it) and comes back to the pool when that owner is gone, and with it every
tensor and view made of the map; nothing else ever holds the map. Idle maps are kept for
:data:`IDLE_SECONDS`, and :data:`IDLE_BYTES` of them at most, then unmapped.

The first receive into fresh pages pays for them all the same (a new process's first 1 GiB
Fetch spent 1.5-2.7 s in the kernel here): :func:`faulting_in_behind` shares that work with
another core.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator

from ._lazy import lazy_module

np = lazy_module("numpy")

#: Idle maps kept at most, in bytes (the oldest are unmapped first).
IDLE_BYTES = 2 << 30
#: An idle map not taken again within this many seconds is unmapped.
IDLE_SECONDS = 10.0
#: A pooled map is taken for a request of at least this fraction of its length (a smaller
#: request gets a new map rather than pin a much larger one).
FIT = 7 / 8

_lock = threading.RLock()  # a finalizer may run inside take() on the same thread (GC)
_idle: list[tuple[float, mmap.mmap]] = []  # (since when idle, map), oldest first
_timer: threading.Timer | None = None


def new_map(size: int) -> mmap.mmap:
    """A fresh private anonymous map of ``size`` bytes."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


def reuse(size: int) -> mmap.mmap | None:
    """The smallest idle map of at least ``size`` bytes that fits (its pages are there, holding
    old bytes the caller overwrites); None when there is none."""
    with _lock:
        fitting = [(len(memory), index) for index, (_, memory) in enumerate(_idle)
                   if size <= len(memory) and size >= len(memory) * FIT]
        if not fitting:
            return None
        _, index = min(fitting)
        return _idle.pop(index)[1]


def take(size: int) -> mmap.mmap:
    """A map of at least ``size`` bytes: an idle one that fits, else a new one."""
    memory = reuse(size)
    return memory if memory is not None else new_map(size)


def hand_out(memory: mmap.mmap) -> memoryview:
    """A writable view of the whole map that gives the map back to the pool once it, and every
    view and tensor made of it, is gone. The caller keeps no other reference to ``memory``."""
    owner = np.frombuffer(memory, dtype=np.uint8)
    weakref.finalize(owner, _give_back, memory).atexit = False
    return memoryview(owner)


def idle_bytes() -> int:
    """Bytes of idle maps in the pool now."""
    with _lock:
        return sum(len(memory) for _, memory in _idle)


def clear() -> None:
    """Unmap every idle map now."""
    global _timer
    with _lock:
        leaving = [memory for _, memory in _idle]
        _idle.clear()
        if _timer is not None:
            _timer.cancel()
            _timer = None
    for memory in leaving:
        _unmap(memory)


def _unmap(memory: mmap.mmap) -> None:
    """Unmap an idle map now; one an owner going away still exports goes with that export."""
    try:
        memory.close()
    except BufferError:
        pass


def _give_back(memory: mmap.mmap) -> None:
    """The finalizer of an owner: runs as the owner goes, which may still export the map for a
    moment (so a map not kept is left to go with it, not closed here)."""
    if IDLE_BYTES <= 0 or len(memory) > IDLE_BYTES:
        return
    leaving = []
    with _lock:
        _idle.append((time.monotonic(), memory))
        held = sum(len(m) for _, m in _idle)
        while held > IDLE_BYTES:
            _, oldest = _idle.pop(0)
            held -= len(oldest)
            leaving.append(oldest)
        _arm()
    for old in leaving:
        _unmap(old)


def _arm() -> None:
    """Start the timer that unmaps maps left idle, unless one is running (lock held)."""
    global _timer
    if _timer is not None or not _idle:
        return
    delay = max(0.0, _idle[0][0] + IDLE_SECONDS - time.monotonic())
    timer = threading.Timer(delay, _expire)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # the interpreter is shutting down: the maps go with the process
        return
    _timer = timer


def _expire() -> None:
    global _timer
    now = time.monotonic()
    with _lock:
        _timer = None
        leaving = [memory for since, memory in _idle if now - since >= IDLE_SECONDS]
        _idle[:] = [(since, memory) for since, memory in _idle if now - since < IDLE_SECONDS]
        _arm()
    for memory in leaving:
        _unmap(memory)


def _after_fork_in_child() -> None:
    """A forked child starts with an empty pool: it has the idle maps (copy-on-write) but not
    the timer thread that would unmap them, so they go now (with their last reference)."""
    global _timer, _lock
    _lock = threading.RLock()
    _timer = None
    _idle.clear()


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


def _madvise():
    """libc's ``madvise`` through ctypes, which lets go of the GIL for the call (``mmap.madvise``
    holds it); None off Linux or without libc."""
    if sys.platform != "linux":
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_madvise_call = _madvise()


@contextmanager
def faulting_in_behind(buffer: memoryview) -> Iterator[None]:
    """While the body fills ``buffer`` from its start, fault its pages in from its end on another
    thread (``MADV_POPULATE_WRITE``, step by step backwards), so that the two meet in the middle
    and each core pays for half the fresh pages; the thread stops at the first step whose pages
    came cheap (:data:`CHEAP_PAGES`: pages already there, or fresh ones the kernel has at hand).
    The thread is stopped and joined when the body ends, however it ends."""
    if buffer.nbytes < FAULT_BEHIND_FROM or _madvise_call is None:
        yield
        return
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data  # the array goes at once; the buffer stays
    stop = threading.Event()
    thread = threading.Thread(target=_fault_in_backwards, args=(address, buffer.nbytes, stop),
                              name="tannery-fault-in", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _fault_in_backwards(address: int, size: int, stop: threading.Event) -> None:
    page = mmap.PAGESIZE
    end = address + size
    while end > address and not stop.is_set():
        start = max(address, end - FAULT_STEP)
        aligned = start - start % page
        began = time.perf_counter()
        if _madvise_call(aligned, end - aligned, _MADV_POPULATE_WRITE) != 0:
            return  # a kernel without it: the receive faults the pages in itself
        if (end - aligned) > CHEAP_PAGES * (time.perf_counter() - began):
            return
        end = start
