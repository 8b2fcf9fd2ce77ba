"""The client's memory tricks for received payloads, behind one door (:data:`TUNED`): the
anonymous maps of one stream's tensors used again by its later payloads, a fresh buffer's
pages faulted in from its end while a receive fills it from its start, and pages populated
ahead in one call (:func:`populate_write`, :func:`populate_read`) instead of one fault per
4 KiB page. ``TANNERY_RECEIVE_TUNING=0`` turns every one of them off (plain maps filled as
they come), which is how ``make bench`` measures what they are worth (docs/benchmarks.md,
"Client memory").

A fresh map costs a page fault and a zeroed page for every 4 KiB a receive writes: 0.2-0.3
client CPU-s per GiB here, and up to 2 s when the virtual machine's host must back the pages
again (docs/benchmarks.md, "Client memory"). A stream of payloads (a
``fetch_iter``, a subscription) whose tensors are dropped as they come gets pages it already
has instead: each reader owns a :class:`ReceivePool`; a map is handed out through an owner (a
numpy array over it) and comes back to that pool when the owner is gone, and with it every
tensor and view made of the map. The pool lives as long as its stream's reader: kept longer,
across calls, its maps made the rest of this VM draw the cold pages (same section).

The first receive into fresh pages pays for them all the same (a new process's first 1 GiB
Fetch spent 1.5-2.7 s in the kernel here): :func:`faulting_in_behind` shares that work with
another core.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import sys
import threading
import time
import weakref
import os
from contextlib import contextmanager
from typing import Iterator

from tannery_protocol._lazy import lazy_module

np = lazy_module("numpy")

#: Whether the tricks of this module are on (``TANNERY_RECEIVE_TUNING``, on unless 0/off/false).
TUNED = os.environ.get("TANNERY_RECEIVE_TUNING", "1").strip().lower() not in ("0", "off", "false", "no")
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14

#: Maps one pool keeps idle at most (a stream cycles through one or two), and bytes of them.
IDLE_MAPS = 2
IDLE_BYTES = 2 << 30
#: A pooled map is taken for a request of at least this fraction of its length (a smaller
#: request gets a new map rather than pin a much larger one).
FIT = 7 / 8


def new_map(size: int) -> mmap.mmap:
    """A fresh private anonymous map of ``size`` bytes."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


class ReceivePool:
    """The idle maps of one stream's dropped tensors, for its next payloads.

    A finalizer runs on whatever thread drops the last reference, in the middle of any code,
    this class's included (a collection inside :meth:`reuse`). So it never touches the pool:
    it appends to ``_returned`` (atomic), and whoever holds the lock moves those maps in, the
    finalizer itself when the lock is free, else the holder once it lets go (:meth:`_settle`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._idle: list[mmap.mmap] = []  # oldest first; under _lock

    def reuse(self, size: int) -> mmap.mmap | None:
        if not TUNED:
            return None
        return self._reuse(size)

    def _reuse(self, size: int) -> mmap.mmap | None:
        """The smallest idle map of at least ``size`` bytes that fits (its pages are there,
        holding old bytes the caller overwrites); None when there is none."""
        with self._lock:
            leaving = self._take_returned()
            fitting = [(len(memory), index) for index, memory in enumerate(self._idle)
                       if size <= len(memory) and size >= len(memory) * FIT]
            chosen = self._idle.pop(min(fitting)[1]) if fitting else None
        self._settle(leaving)
        return chosen

    def hand_out(self, memory: mmap.mmap) -> memoryview:
        """A writable view of the whole map that gives the map back to this pool (if it is still
        there) once it, and every view and tensor made of it, is gone. The caller keeps no other
        reference to ``memory``. The view's ``obj`` (a numpy array) spans the whole map: bytes
        outside what the caller fills may be an earlier payload's of the same stream."""
        owner = np.frombuffer(memory, dtype=np.uint8)
        if TUNED:
            weakref.finalize(owner, _give_back, weakref.ref(self), memory).atexit = False
        return memoryview(owner)

    def idle_bytes(self) -> int:
        """Bytes of idle maps in the pool now."""
        with self._lock:
            leaving = self._take_returned()
            held = sum(len(memory) for memory in self._idle)
        self._settle(leaving)
        return held

    def _settle(self, leaving: list[mmap.mmap]) -> None:
        """Unmap ``leaving`` (maps taken out under the lock), then move maps given back meanwhile
        into the pool, unless another holder of the lock will (it calls this after)."""
        for memory in leaving:
            _unmap(memory)
        while self._returned:
            if not self._lock.acquire(blocking=False):
                return  # the holder settles on its way out
            try:
                leaving = self._take_returned()
            finally:
                self._lock.release()
            for memory in leaving:
                _unmap(memory)

    def _take_returned(self) -> list[mmap.mmap]:
        """Move the maps given back into the pool, the oldest out beyond :data:`IDLE_MAPS` and
        :data:`IDLE_BYTES` (lock held); the maps to unmap once the lock is let go."""
        while self._returned:
            self._idle.append(self._returned.popleft())
        leaving = []
        while self._idle and (len(self._idle) > IDLE_MAPS or sum(map(len, self._idle)) > IDLE_BYTES):
            leaving.append(self._idle.pop(0))
        return leaving


def _give_back(pool_ref: "weakref.ref[ReceivePool]", memory: mmap.mmap) -> None:
    """The finalizer of an owner: runs as the owner goes, which may still export the map for a
    moment (so a map not kept is left to go with it, not closed here)."""
    pool = pool_ref()
    if pool is None or len(memory) > IDLE_BYTES:
        return
    pool._returned.append(memory)
    pool._settle([])


def _unmap(memory: mmap.mmap) -> None:
    """Unmap an idle map now; one an owner going away still exports goes with that export."""
    try:
        memory.close()
    except BufferError:
        pass


# -- Pages faulted in ahead ---------------------------------------------------------------

#: Buffers from this size get a thread faulting their pages in from the end.
FAULT_BEHIND_FROM = 32 << 20
#: Bytes that thread faults in per call (a receive that has passed them stops it soon).
FAULT_STEP = 16 << 20
#: Pages faulted in faster than this (bytes per second) are cheap: the receive faults them in
#: about as fast itself. Pages the host must back again came at 0.4 GB/s.
CHEAP_PAGES = 2e9
#: The thread stops once the steps in a row that came cheap cover this share of the buffer
#: (at least one step; 256 MiB of 1 GiB): a third busy thread on two cores would slow a
#: Fetch on warm memory (one that never stops, by 0.08-0.1 s per GiB). Not at the first cheap
#: step: the free pages a fresh map gets are often a warm patch of 80-190 MiB (what was freed
#: last), then cold ones. On cold memory, 1 GiB TCP Fetches took 1.25-3.2 s (9 rounds) when
#: it stopped at the first cheap step, 1.49-1.95 s (3 rounds) with this rule; on warm memory
#: it cost about 1% (docs/benchmarks.md, "Client memory").
CHEAP_SHARE = 0.25
_MADV_POPULATE_WRITE = 23  # Linux 5.14


@functools.cache
def _madvise():
    """libc's ``madvise`` through ctypes, which lets go of the GIL for the call (``mmap.madvise``
    holds it), looked up on first use; None off Linux."""
    if sys.platform != "linux":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


@contextmanager
def faulting_in_behind(buffer: memoryview) -> Iterator[None]:
    """While the body fills ``buffer`` from its start, fault its pages in from its end on another
    thread (``MADV_POPULATE_WRITE``, step by step backwards), so that the two meet in the middle
    and each core pays for half the fresh pages; the thread stops once the steps in a row that
    came cheap (:data:`CHEAP_PAGES`: pages already there, or fresh ones the kernel has at hand)
    cover :data:`CHEAP_SHARE` of the buffer. The thread is stopped and joined when the body
    ends, however it ends."""
    madvise = _madvise() if TUNED and buffer.nbytes >= FAULT_BEHIND_FROM else None
    if madvise is None:
        yield
        return
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data  # the array goes at once; the buffer stays
    stop = threading.Event()
    thread = threading.Thread(target=fault_in_backwards, args=(madvise, address, buffer.nbytes, stop),
                              name="tannery-fault-in", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fault_in_backwards(madvise, address: int, size: int, stop: threading.Event) -> None:
    """Fault in ``size`` bytes from ``address`` a step at a time from the end (``madvise(address,
    length, advice)``: the libc call, or a stand-in), until ``stop`` is set or the steps stay
    cheap (the pages were there already: the receive is ahead, nothing to win)."""
    page = mmap.PAGESIZE
    end = address + size
    enough = max(FAULT_STEP, CHEAP_SHARE * size)
    cheap = 0
    while end > address and not stop.is_set():
        start = max(address, end - FAULT_STEP)
        aligned = start - start % page
        began = time.perf_counter()
        if madvise(aligned, end - aligned, _MADV_POPULATE_WRITE) != 0:
            return  # a kernel without it: the receive faults the pages in itself
        done = end - aligned
        cheap = cheap + done if done > CHEAP_PAGES * (time.perf_counter() - began) else 0
        if cheap >= enough:
            return
        end = start


def populate_write(memory: mmap.mmap, start: int, length: int) -> bool:
    """Fault in ``length`` bytes of ``memory`` from ``start`` for writing, in one call
    (``MADV_POPULATE_WRITE``) rather than one fault per page the copy touches; False when it is
    off (:data:`TUNED`) or the kernel refuses it: the copy then faults the pages in itself."""
    if not TUNED or sys.platform != "linux":
        return False
    try:
        memory.madvise(_MADV_POPULATE_WRITE, start, length)
    except OSError:
        return False
    return True


def populate_read(memory: mmap.mmap) -> None:
    """Map the page cache's pages of a file's map in at once, read-only (``MADV_POPULATE_READ``):
    not ``MAP_POPULATE``, which on a private writable map faults every page in for writing and
    so copies the whole file (about 0.6 s per GiB here); a page is copied only if the tensor is
    written. Nothing when off or refused: the reads fault the pages in."""
    if not TUNED:
        return
    try:
        memory.madvise(_MADV_POPULATE_READ)
    except (OSError, AttributeError):
        pass
