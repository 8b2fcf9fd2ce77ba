"""Statistics and a histogram of one stored entry, computed over its checked stored bytes.

The bytes come through the one checked reader (:class:`~..dataplane.blocks.VerifiedBlob`, what
every Fetch reads through): a damaged block is never summarised. The work is bounded for any
size: an entry of at most :data:`FULL_BYTES` of tensor data is read whole; a larger one is
sampled, :data:`WINDOWS` windows of :data:`WINDOW_BYTES` spread evenly over it, and the result
says so. Elements are summarised a window at a time (at most a window's worth of float64
memory: :class:`tannery_protocol.summary.Summary`, what ``tannery get`` computes its statistics
with) and the histogram is drawn from at most :data:`HISTOGRAM_VALUES` of them, evenly spaced.
A deadline (:data:`SECONDS`) stops the reading early, also said in the result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from tannery_protocol.codec import DTYPES
from tannery_protocol.summary import Stats, Summary
from tannery_protocol.v1 import archives_pb2

from ..dataplane.blocks import VerifiedBlob
from ..fetching import digests, resolve
from ..storage import EntryRecord, Storage

#: Entries with at most this many bytes of tensor data are read whole; larger ones are sampled.
FULL_BYTES = 64 << 20
#: A sample: this many windows of this many bytes, spread evenly over the tensor data.
WINDOWS = 64
WINDOW_BYTES = 1 << 20
#: Bytes summarised at a time (a window of a whole read).
STEP_BYTES = 1 << 20
#: Values the histogram is drawn from, at most, and its bins.
HISTOGRAM_VALUES = 1 << 20
BINS = 48
#: Seconds the reading may take; past them the statistics cover what was read.
SECONDS = 10.0


@dataclass
class EntryStats(Stats):
    """What the entry page shows: the statistics (keys as ``tannery get --json``'s ``stats``),
    the histogram (``edges``, ``counts``), and how much of the entry they cover."""

    #: Elements summarised (``count`` is the entry's), bytes of tensor data read, and of the entry.
    summarised: int
    bytes_read: int
    data_bytes: int
    #: Whether a sample was read (an entry over FULL_BYTES), and whether the deadline cut it short.
    sampled: bool
    cut_short: bool
    seconds: float
    edges: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    #: Elements the histogram was drawn from.
    histogram_values: int = 0


def _elements(data: bytes, dtype_name: str, limit: int) -> np.ndarray:
    """The elements in ``data`` (bytes of tensor data), at most ``limit`` of them (a bool
    tensor's last byte holds padding bits)."""
    dtype = DTYPES[dtype_name]
    if dtype.is_bool:
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        return bits[:limit].astype(np.uint8)
    values = np.frombuffer(data, dtype.numpy.newbyteorder("<"))
    return values[:limit]


def _windows(data_bytes: int, align: int) -> tuple[list[tuple[int, int]], bool]:
    """The byte ranges of tensor data to read, and whether they are a sample."""
    if data_bytes <= FULL_BYTES:
        return [(lo, min(data_bytes, lo + STEP_BYTES)) for lo in range(0, data_bytes, STEP_BYTES)], False
    window = WINDOW_BYTES - WINDOW_BYTES % align
    stride = (data_bytes - window) / (WINDOWS - 1)
    ranges = []
    for i in range(WINDOWS):
        lo = int(i * stride)
        lo -= lo % align
        ranges.append((lo, min(data_bytes, lo + window)))
    return ranges, True


def entry_stats(storage: Storage, archive: str, entry: EntryRecord, seconds: float = SECONDS) -> EntryStats:
    """The statistics of ``entry`` of ``archive`` (its own name, as looked up), read now.

    Blocking: call it from a worker thread. The entry's blob is pinned while it is read (as a
    Fetch pins it), so a Delete meanwhile cannot take the bytes away mid-read; Missing when the
    entry went away since the page looked it up, Damaged when a block fails its check.
    """
    started = time.monotonic()
    request = archives_pb2.FetchRequest(archive=archive, entries=[archives_pb2.EntryAsk(name=entry.name)])
    plans = resolve(storage, request)
    try:
        plan = plans[0]
        entry = plan.entry
        dtype = DTYPES[entry.dtype]
        total = math.prod(entry.shape)
        data_bytes = entry.payload_bytes - entry.data_offset
        align = 1 if dtype.is_bool else dtype.itemsize
        ranges, sampled = _windows(data_bytes, align)
        planned = sum(hi - lo for lo, hi in ranges) * (8 if dtype.is_bool else 1) // align
        summary = Summary(dtype.numpy if not dtype.is_bool else np.uint8)
        keep_every = max(1, planned // HISTOGRAM_VALUES)
        kept: list[np.ndarray] = []
        seen = read = 0
        cut_short = False
        with VerifiedBlob(storage, plan) as blob:
            for lo, hi in ranges:
                if time.monotonic() - started > seconds:
                    cut_short = True
                    break
                data = b"".join(blob.blocks(entry.data_offset + lo, entry.data_offset + hi))
                first = lo * 8 if dtype.is_bool else lo // align
                values = _elements(data, entry.dtype, total - first)
                seen += values.size
                kept.append(summary.add(values)[::keep_every].astype(np.float64))
                read += hi - lo
    finally:
        storage.release(digests(plans))
    found = summary.result()
    edges, counts, kept_count = _histogram(kept, found["min"], found["max"])
    return EntryStats(
        count=total, **found, summarised=seen, bytes_read=read, data_bytes=data_bytes, sampled=sampled or cut_short,
        cut_short=cut_short, seconds=time.monotonic() - started, edges=edges, counts=counts,
        histogram_values=kept_count)


def _histogram(kept: list[np.ndarray], low: float | int | None,
               high: float | int | None) -> tuple[list[float], list[int], int]:
    """Bin edges and counts over [low, high] (the min and max) of the values kept (none when there are none)."""
    if low is None or high is None or not kept:
        return [], [], 0
    values = np.concatenate(kept)
    low, high = float(low), float(high)
    if low == high:
        high = low + 1.0
    counts, edges = np.histogram(values, bins=BINS, range=(low, high))
    return [float(e) for e in edges], [int(c) for c in counts], int(values.size)


__all__ = ["EntryStats", "entry_stats"]
