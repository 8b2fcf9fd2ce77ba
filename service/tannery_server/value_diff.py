"""How the values of two stored entries of one dtype and shape differ, read a window at a time.

Both payloads come through the one checked reader (:class:`~.dataplane.blocks.VerifiedBlob`,
what every Fetch reads through), block by block, side by side: a damaged block is DATA_LOSS
naming the entry, never compared. The two block streams are cut into windows of the same
elements (:func:`windows`: a view into a block when the window lies in it, a copy into one
reused buffer when it straddles two), so memory stays a few windows whatever the entry's size.

Per window (:class:`ValueTally`): elements whose bits differ (so a NaN equals the same NaN);
over the elements finite in both, max |b - a| and the sum of |b - a|^2; over a's finite
elements, the sum of |a|^2 (the norm the difference is relative to); NaN and Inf appearing in
b where a had none. A window whose bits all agree costs one comparison and a's norm.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np

from tannery_protocol.codec import DTYPES, DType
from tannery_protocol.v1 import archives_pb2

from .dataplane.blocks import VerifiedBlob
from .fetching import Plan
from .storage import EntryRecord, Storage

#: Bytes of each side compared at a time (a multiple of every element size; a quarter of a
#: stored block, so that most windows are views into a block, not copies).
WINDOW_BYTES = 256 << 10

#: The unsigned integer whose bits a window's elements are compared as, by element size.
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}


def windows(pieces: Iterator[memoryview], size: int) -> Iterator[memoryview]:
    """The bytes of ``pieces`` in consecutive windows of exactly ``size`` bytes (the last may be
    shorter): a view into a piece that holds the whole window, else a copy into one buffer, reused
    (a window is valid until the next is asked for)."""
    buffer = bytearray(size)
    filled = 0
    for piece in pieces:
        at, length = 0, piece.nbytes
        if filled:
            take = min(size - filled, length)
            buffer[filled : filled + take] = piece[:take]
            filled, at = filled + take, take
            if filled < size:
                continue
            yield memoryview(buffer)
            filled = 0
        while length - at >= size:
            yield piece[at : at + size]
            at += size
        if at < length:
            buffer[: length - at] = piece[at:]
            filled = length - at
    if filled:
        yield memoryview(buffer)[:filled]


class ValueTally:
    """The running figures of one entry's comparison, a window pair at a time, computed in work
    arrays made once (a new array per window would cost page faults that outweigh the sums)."""

    def __init__(self, dtype: DType, elements: int, window: int = WINDOW_BYTES) -> None:
        self.dtype = dtype
        self.elements = elements
        self.complex = dtype.name.startswith("complex")
        self.integer = not dtype.is_bool and not self.complex and dtype.numpy.kind in "iu"
        self.seen = 0
        self.differing = 0
        self.max_abs = 0.0
        self.diff_squares = 0.0
        self.a_squares = 0.0
        self.nan_appeared = 0
        self.inf_appeared = 0
        if dtype.is_bool:
            return
        size = min(window // dtype.itemsize, max(elements, 1))
        wide = np.complex128 if self.complex else np.float64
        self._a, self._b, self._d = (np.empty(size, wide) for _ in range(3))
        self._finite = np.empty(size, np.bool_)
        self._differ = np.empty(size * (2 if dtype.itemsize == 16 else 1), np.bool_)

    def add(self, a: memoryview, b: memoryview) -> None:
        """One window of each side: the same elements of a and of b."""
        if self.dtype.is_bool:
            self._add_bools(a, b)
            return
        bits = _BITS[self.dtype.itemsize]
        raw_a, raw_b = np.frombuffer(a, bits), np.frombuffer(b, bits)
        differ = np.not_equal(raw_a, raw_b, out=self._differ[: raw_a.size])
        if self.dtype.itemsize == 16:  # complex128: two 64-bit halves an element
            differ = differ.reshape(-1, 2).any(axis=1)
        differing = int(np.count_nonzero(differ))
        numpy_dtype = self.dtype.numpy.newbyteorder("<")
        count = raw_a.size // (2 if self.dtype.itemsize == 16 else 1)
        va = self._a[:count]
        va[...] = np.frombuffer(a, numpy_dtype)
        self.seen += count
        self.a_squares += _squares(va if self.integer else self._finite_of(va))
        if not differing:
            return
        self.differing += differing
        vb = self._b[:count]
        vb[...] = np.frombuffer(b, numpy_dtype)
        d = np.subtract(vb, va, out=self._d[:count])
        if not self.integer:
            finite = np.isfinite(d, out=self._finite[:count])
            if not finite.all():
                d = d[finite]
                self.nan_appeared += int(np.count_nonzero(np.isnan(vb) & ~np.isnan(va)))
                self.inf_appeared += int(np.count_nonzero(np.isinf(vb) & ~np.isinf(va)))
        if d.size:
            self.max_abs = max(self.max_abs, float(np.abs(d).max() if self.complex else max(d.max(), -d.min())))
            self.diff_squares += _squares(d)

    def _finite_of(self, values: np.ndarray) -> np.ndarray:
        """The finite ones of ``values`` (``values`` itself, uncopied, when all are)."""
        finite = np.isfinite(values, out=self._finite[: values.size])
        return values if finite.all() else values[finite]

    def _add_bools(self, a: memoryview, b: memoryview) -> None:
        count = min(a.nbytes * 8, self.elements - self.seen)
        va = np.unpackbits(np.frombuffer(a, np.uint8), count=count, bitorder="little")
        vb = np.unpackbits(np.frombuffer(b, np.uint8), count=count, bitorder="little")
        self.seen += count
        differing = int(np.count_nonzero(va != vb))
        self.differing += differing
        self.a_squares += float(np.count_nonzero(va))
        self.diff_squares += differing
        if differing:
            self.max_abs = 1.0

    def result(self) -> archives_pb2.ValueChange:
        if self.diff_squares == 0:
            relative = 0.0
        elif self.a_squares == 0:
            relative = math.inf
        else:
            relative = math.sqrt(self.diff_squares) / math.sqrt(self.a_squares)
        return archives_pb2.ValueChange(
            elements=self.elements, differing=self.differing, max_abs=self.max_abs, relative_l2=relative,
            nan_appeared=self.nan_appeared, inf_appeared=self.inf_appeared)


def _squares(values: np.ndarray) -> float:
    """The sum of |v|^2, by einsum (no array of squares made, and no BLAS call: OpenBLAS's
    threads, woken for each window on a busy server, made np.dot a thousand times slower)."""
    if not values.size:
        return 0.0
    if values.dtype.kind == "c":
        return float(np.einsum("i,i->", values.real, values.real) + np.einsum("i,i->", values.imag, values.imag))
    return float(np.einsum("i,i->", values, values))


def compare_values(storage: Storage, a: EntryRecord, b: EntryRecord, check: Callable[[], None]
                   ) -> tuple[archives_pb2.ValueChange, int]:
    """How ``b``'s values differ from ``a``'s (the same dtype and shape), and the bytes of tensor
    data read; ``check()`` runs before each window (it raises to stop: a cancelled call).
    Blocking: run it on a worker thread, with both blobs pinned."""
    dtype = DTYPES[a.dtype]
    tally = ValueTally(dtype, math.prod(a.shape), WINDOW_BYTES)
    read = 0
    with VerifiedBlob(storage, _plan(a)) as blob_a, VerifiedBlob(storage, _plan(b)) as blob_b:
        pieces_a = windows(blob_a.blocks(a.data_offset, a.payload_bytes), WINDOW_BYTES)
        pieces_b = windows(blob_b.blocks(b.data_offset, b.payload_bytes), WINDOW_BYTES)
        for window_a, window_b in zip(pieces_a, pieces_b):
            check()
            tally.add(window_a, window_b)
            read += window_a.nbytes + window_b.nbytes
    return tally.result(), read


def _plan(entry: EntryRecord) -> Plan:
    return Plan(entry, None, 0, entry.payload_bytes, DTYPES[entry.dtype])


__all__ = ["ValueTally", "WINDOW_BYTES", "compare_values", "windows"]
