"""Payloads gathered whole on a receiving client: the one copy a receiver makes.

:class:`Reframer` turns a stream of chunks (cut by :class:`~tannery_protocol.framing.Deframer`)
into whole payloads, each gathered into an aligned buffer (the heap, or an anonymous map of
its own for large ones) that the tensor made of it then shares; :func:`receive_buffer` is
the same buffer for a payload received whole from a data connection.
"""

from __future__ import annotations

import mmap
from typing import Callable, Iterator

from tannery_protocol._lazy import lazy_module
from tannery_protocol.codec import ALIGNMENT, DEFAULT_LIMITS, Buffer, Limits, PayloadInfo
from tannery_protocol.framing import Deframer

from tannery.dataplane import receive_memory

np = lazy_module("numpy")


def aligned_buffer(size: int, data_offset: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose byte ``data_offset`` is aligned to 64.

    Receivers gather a payload into it so that the tensor they view in place is as
    aligned as one torch would allocate.
    """
    raw = np.empty(size + ALIGNMENT, dtype=np.uint8)
    pad = (-(raw.ctypes.data + data_offset)) % ALIGNMENT
    return memoryview(raw[pad : pad + size])


def receive_buffer(size: int, data_offset: int, pool: receive_memory.ReceivePool | None = None) -> memoryview:
    """As :func:`aligned_buffer`, for a payload received whole from a socket: from
    :data:`MAP_GATHER` bytes an anonymous map of 4 KiB pages, one of ``pool``'s when it has
    one that fits (and given back to it once the tensor is gone). numpy would ask for
    transparent huge pages, and the kernel compacts memory to find them on the first touch:
    a fresh process's first 1 GiB Fetch over TCP spent 2.6 s in the kernel that way, 0.4 s in
    pages."""
    if size + ALIGNMENT < MAP_GATHER:
        return aligned_buffer(size, data_offset)
    pad = -data_offset % ALIGNMENT  # a map starts on a page boundary
    memory = pool.reuse(pad + size) if pool is not None else None
    if memory is None:
        memory = _Gathering._new_map(pad + size)
    view = pool.hand_out(memory) if pool is not None else memoryview(memory)
    return view[pad : pad + size]


#: Payloads from this size (with the alignment pad) are gathered into an anonymous map of
#: their own; smaller ones into the heap (``aligned_buffer``), whose memory the allocator
#: reuses. numpy asks for huge pages for arrays from 4 MiB: a map is how we avoid that (zeroing
#: fresh huge pages cost a receiving client 2.5x the CPU: docs/benchmarks.md, "Client memory").
MAP_GATHER = 4 << 20
#: A map is allocated whole up to this size: beyond, nothing more is reserved on the word of
#: a header, and the map grows as the bytes arrive.
EAGER_GATHER = 32 << 20
#: Bytes of a piece read first, as a chunk, when no payload is being gathered: its header, or
#: all of a small payload (the rest of a large one then goes straight into its buffer).
RECEIVE_HEAD = 64 << 10
#: Bytes of a gather map faulted in ahead of the data, in one call
#: (:func:`~tannery.dataplane.receive_memory.populate_write`).
POPULATE_AHEAD = 8 << 20


class _Gathering:
    """A payload being gathered from fragments: the one copy a Reframer makes.

    Up to :data:`EAGER_GATHER` bytes the buffer is allocated whole. Beyond, nothing more is
    reserved on the word of the header: an anonymous map of that size is enlarged, doubling
    up to the payload's size, as the bytes arrive, by ``mremap``, which moves pages without
    copying them; unless ``pool`` has a map the whole payload fits, whose pages are there
    already. Either way the tensor data lands on a 64-byte boundary.
    """

    def __init__(self, info: PayloadInfo, pool: receive_memory.ReceivePool | None = None) -> None:
        self.pool = pool
        if info.size + ALIGNMENT < MAP_GATHER:
            self.pad, self.memory = 0, aligned_buffer(info.size, info.data_offset)
            reused = True  # the heap's pages are left to the allocator
        else:
            self.pad = -info.data_offset % ALIGNMENT  # a map starts on a page boundary
            pooled = pool.reuse(self.pad + info.size) if pool is not None else None
            reused = pooled is not None
            self.memory = pooled if reused else self._new_map(self.pad + min(info.size, EAGER_GATHER))
        self.end = self.pad + info.size
        self.filled = self.pad
        #: The map's bytes below this are faulted in.
        self.populated = self.end if reused or not receive_memory.TUNED else 0

    @staticmethod
    def _new_map(size: int) -> mmap.mmap:
        return receive_memory.new_map(size)

    def add(self, data: Buffer) -> None:
        n = memoryview(data).nbytes
        if self.filled + n > len(self.memory):
            self._grow(min(self.end, max(self.filled + n, 2 * len(self.memory))))
        if self.filled + n > self.populated:
            self._populate(self.filled + n + POPULATE_AHEAD)
        self.memory[self.filled : self.filled + n] = data
        self.filled += n

    def fill(self, size: int, read_into: Callable[[memoryview], None]) -> None:
        """The next ``size`` bytes, written by ``read_into`` straight into the buffer (no copy)."""
        if self.filled + size > len(self.memory):
            self._grow(min(self.end, max(self.filled + size, 2 * len(self.memory))))
        if self.filled + size > self.populated:
            self._populate(self.filled + size + POPULATE_AHEAD)
        with memoryview(self.memory) as whole, whole[self.filled : self.filled + size] as part:
            read_into(part)  # released after: a map is resized as it grows, which no live view allows
        self.filled += size

    def _populate(self, end: int) -> None:
        """Fault in the map's pages from :attr:`populated` to ``end`` (or the map's end)."""
        assert isinstance(self.memory, mmap.mmap)
        start = self.populated - self.populated % mmap.PAGESIZE
        self.populated = min(len(self.memory), end)
        if not receive_memory.populate_write(self.memory, start, self.populated - start):
            self.populated = self.end  # off, or a kernel without it: the copy faults the pages in

    def _grow(self, size: int) -> None:
        assert isinstance(self.memory, mmap.mmap)
        try:
            self.memory.resize(size)
        except (OSError, SystemError):  # no mremap on this platform: move to a new map
            bigger = self._new_map(size)
            bigger[: self.filled] = self.memory[: self.filled]
            self.memory = bigger

    def payload(self) -> memoryview:
        if isinstance(self.memory, mmap.mmap) and self.pool is not None:
            return self.pool.hand_out(self.memory)[self.pad : self.end]
        return memoryview(self.memory)[self.pad : self.end]


class Reframer:
    """Turns a stream of byte chunks of any sizes into whole payloads.

    A payload that arrives in one chunk is returned as a view of it; one spread over
    several is gathered into an aligned, writable buffer, the only copy made. A header
    gets at most :data:`EAGER_GATHER` bytes of memory on its word; the rest comes as the
    bytes it announces arrive.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, pool: receive_memory.ReceivePool | None = None) -> None:
        self._deframer = Deframer(limits)
        self._gathering: _Gathering | None = None
        #: Where large payloads are gathered into maps used before, and given back to (None: fresh maps).
        self.pool = pool

    def feed(self, chunk: Buffer) -> Iterator[Buffer]:
        """The payloads that ``chunk`` completes, in order."""
        for fragment in self._deframer.feed(chunk):
            if fragment.first and fragment.last:
                yield fragment.data
                continue
            if fragment.first:
                self._gathering = _Gathering(fragment.info, self.pool)
            assert self._gathering is not None
            self._gathering.add(fragment.data)
            if fragment.last:
                payload, self._gathering = self._gathering.payload(), None
                yield payload

    def receive(self, size: int, read_into: Callable[[memoryview], None]) -> Iterator[Buffer]:
        """The payloads completed by the stream's next ``size`` bytes, which ``read_into(view)``
        fills (a data connection's ``receive_into``): the bytes that continue a payload being
        gathered go straight into its buffer; a header, and a payload that fits in one piece,
        are read into memory of their own first and fed as a chunk."""
        if not size:
            return
        if self._gathering is None or not size <= self._deframer.remaining:
            head = min(size, RECEIVE_HEAD) if self._gathering is None else size
            chunk = memoryview(bytearray(head))
            read_into(chunk)
            yield from self.feed(chunk)
            size -= head
            if not size:
                return
            if self._gathering is None or not size <= self._deframer.remaining:
                chunk = memoryview(bytearray(size))
                read_into(chunk)
                yield from self.feed(chunk)
                return
        fragment = self._deframer.skip(size)
        self._gathering.fill(size, read_into)
        if fragment.last:
            payload, self._gathering = self._gathering.payload(), None
            yield payload

    def close(self) -> None:
        """Declare the stream over; FormatError if it stopped inside a payload."""
        self._deframer.close()
