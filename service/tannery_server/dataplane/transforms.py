"""What a Fetch makes of stored bytes that the client does not get as stored: the rows of a
bool entry re-packed from bit 0, and floats cast on the server.

Each takes the checked pieces of :class:`~.blocks.VerifiedBlob` and yields new ones; a
cast converts one window of elements at a time, so memory stays bounded.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from tannery_protocol.codec import DType

from ..fetching import Plan


def made_pieces(plan: Plan, blocks: Iterator[memoryview], window: int) -> Iterator[memoryview]:
    """The payload of a plan with a new prefix (rows, a cast): the prefix, then the bytes made
    from ``blocks``, the checked bytes [plan.start, plan.stop) of its blob."""
    yield memoryview(plan.prefix)
    pieces: Iterable[memoryview] = blocks
    if plan.source.is_bool and plan.blob is not None:
        pieces = _shift_bits(pieces, plan.skip_bits, plan.send_bits)
    elif plan.target is not None:
        pieces = _cast(pieces, plan.source, plan.target, window)
    yield from pieces


def _elements(pieces: Iterable[memoryview], itemsize: int) -> Iterator[memoryview]:
    """The same bytes, re-cut so that no element is split between two pieces."""
    carry = b""
    for piece in pieces:
        if carry:
            piece = memoryview(carry + piece)
        cut = piece.nbytes - piece.nbytes % itemsize
        carry = bytes(piece[cut:])
        if cut:
            yield piece[:cut]
    if carry:
        raise AssertionError("a range that is not a whole number of elements")


def _cast(pieces: Iterable[memoryview], source: DType, target: DType, chunk_size: int) -> Iterator[memoryview]:
    """Elements converted from ``source`` to ``target`` a window at a time.

    float64 goes to float16 and bfloat16 through float32, as torch's ``.to`` does, so that
    a cast on the server gives the same bits as one in the client.
    """
    via32 = source.name == "float64" and target.name in ("float16", "bfloat16")
    for piece in _elements(pieces, source.itemsize):
        values = np.frombuffer(piece, dtype=source.numpy)
        with np.errstate(over="ignore", invalid="ignore"):
            if via32:
                values = values.astype(np.float32)
            out = values.astype(target.numpy)
        yield memoryview(out.view(np.uint8))


def _shift_bits(pieces: Iterable[memoryview], skip: int, count: int) -> Iterator[memoryview]:
    """Bit-packed booleans (LSB first) from bit ``skip`` of the stream, ``count`` of them,
    packed again from bit 0: the rows of a bool entry that start inside a byte."""
    if skip == 0:
        sent = 0
        full, tail_bits = divmod(count, 8)
        needed = full + (1 if tail_bits else 0)
        for piece in pieces:
            take = min(piece.nbytes, needed - sent)
            out = piece[:take]
            sent += take
            if sent == needed and tail_bits:
                # Clear the pad bits of the last byte, which belong to the next row.
                last = bytes([out[-1] & ((1 << tail_bits) - 1)])
                yield out[:-1]
                yield memoryview(last)
            else:
                yield out
        return
    carry = np.zeros(0, dtype=np.uint8)  # unpacked bits not yet sent (fewer than 8)
    remaining = count
    first = True
    for piece in pieces:
        bits = np.unpackbits(np.frombuffer(piece, dtype=np.uint8), bitorder="little")
        if first:
            bits, first = bits[skip:], False
        bits = np.concatenate((carry, bits[:remaining + 8]))
        usable = min(len(bits), remaining)
        whole = usable - usable % 8 if usable < remaining else usable
        if whole:
            yield memoryview(np.packbits(bits[:whole], bitorder="little"))
            remaining -= whole
        carry = bits[whole:usable] if remaining else carry[:0]
    if remaining:
        raise AssertionError("bool rows ended early")
