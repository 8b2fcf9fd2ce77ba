"""Framing: a stream of byte chunks of any sizes cut into tannic payloads by their headers.

:class:`Deframer` splits the stream into pieces of payloads (:class:`Fragment`) without
copying: what the server relays and stores, and what a client's
:class:`~tannery.dataplane.gathering.Reframer` gathers into whole payloads. The payload format itself
(headers, dtypes, numpy views) is :mod:`tannery_protocol.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .codec import DEFAULT_LIMITS, DIM, FIXED_PREFIX, HEADER, Buffer, FormatError, Limits, PayloadInfo, byte_buffer, read_info

@dataclass(frozen=True)
class Fragment:
    """A piece of one payload in a stream of chunks.

    ``data`` is the chunk itself when the piece is a whole chunk, otherwise a view of
    it; only the first few bytes of a payload whose header was split across chunks are
    ever copied.
    """

    info: PayloadInfo
    data: Buffer
    first: bool
    last: bool


class Deframer:
    """Splits a stream of byte chunks of any sizes into payloads, piece by piece.

    Where a payload ends is read from its own header. Each header is checked (limits
    included) before any of its buffer is accepted, and nothing is buffered but the
    header bytes of a payload split across chunks.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._head = bytearray()
        self._info: PayloadInfo | None = None
        self._remaining = 0
        self.payloads = 0

    @property
    def inside_payload(self) -> bool:
        """True between a payload's first byte and its last."""
        return bool(self._head) or self._info is not None

    def feed(self, chunk: Buffer) -> Iterator[Fragment]:
        """The fragments of payloads that ``chunk`` completes or continues."""
        view = byte_buffer(chunk)
        pos, end = 0, len(view)
        while pos < end:
            if self._info is None:
                pos = yield from self._start(chunk, view, pos)
                continue
            take = min(self._remaining, end - pos)
            self._remaining -= take
            info, last = self._info, self._remaining == 0
            if last:
                self._info = None
                self.payloads += 1
            piece = chunk if (take == end and isinstance(chunk, bytes)) else view[pos : pos + take]
            yield Fragment(info, piece, first=False, last=last)
            pos += take

    def _start(self, chunk: Buffer, view: memoryview, pos: int) -> Iterator[Fragment]:
        """Read a new payload's header from ``view[pos:]``; returns the position after what it used."""
        if not self._head:
            info = read_info(view[pos:], self.limits)
            if info is not None:
                take = min(info.size, len(view) - pos)
                whole = pos == 0 and take == len(view) and isinstance(chunk, bytes)
                yield from self._begin(info, chunk if whole else view[pos : pos + take], take)
                return pos + take
        # The header is split across chunks: gather it byte range by byte range, no further
        # than the parser asks for, so a hostile header cannot make us buffer more.
        while pos < len(view):
            need = self._prefix_need()
            take = min(need - len(self._head), len(view) - pos)
            self._head += view[pos : pos + take]
            pos += take
            info = read_info(self._head, self.limits)
            if info is not None:
                head, self._head = bytes(self._head), bytearray()
                yield from self._begin(info, head, len(head))
                return pos
        return pos

    def _prefix_need(self) -> int:
        """How many bytes of header the parser needs next, given what is gathered."""
        if len(self._head) < HEADER.size:
            return HEADER.size
        if len(self._head) < FIXED_PREFIX:
            return FIXED_PREFIX
        return FIXED_PREFIX + DIM.size * self._head[FIXED_PREFIX - 1]

    def _begin(self, info: PayloadInfo, piece: Buffer, taken: int) -> Iterator[Fragment]:
        self._remaining = info.size - taken
        last = self._remaining == 0
        self._info = None if last else info
        if last:
            self.payloads += 1
        yield Fragment(info, piece, first=True, last=last)

    @property
    def remaining(self) -> int:
        """Bytes still to come of the payload in progress once its header is read (0 otherwise)."""
        return self._remaining if self._info is not None else 0

    def skip(self, size: int) -> Fragment:
        """Count ``size`` bytes of the payload in progress (at most :attr:`remaining`) as received
        elsewhere, straight into where they go (a data connection's bytes into the payload's
        memory): the fragment they are, with no data."""
        info = self._info
        if info is None or not 0 < size <= self._remaining:
            raise ValueError(f"skip({size}) with {self.remaining} bytes of a payload to come")
        self._remaining -= size
        last = self._remaining == 0
        if last:
            self._info = None
            self.payloads += 1
        return Fragment(info, b"", first=False, last=last)

    def close(self) -> None:
        """Declare the stream over; FormatError if it stopped inside a payload."""
        if self._info is not None:
            got = self._info.size - self._remaining
            raise FormatError(f"stream ended inside a payload: {got} of {self._info.size} bytes")
        if self._head:
            raise FormatError(
                f"stream ended inside a payload header: {len(self._head)} bytes, too few for its header, "
                "metadata and shape"
            )
