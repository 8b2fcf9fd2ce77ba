"""What arrives of a Fetch or a subscription, as the data paths and the readers both name it.

:class:`Arrived` is one whole entry or payload that came on a data connection (a mapped file's
region, or the buffer received into); :class:`TensorPiece` is a piece of an entry's tensor
bytes, as ``fetch_pieces`` yields them. :mod:`tannery.dataplane.links` makes them, :mod:`tannery.dataplane.readers`
turns them into what the clients return; neither needs the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tannery_protocol.codec import PayloadInfo


@dataclass(frozen=True)
class Arrived:
    """One fetched entry: its name, what its payload header says, and its tensor bytes (a view
    of the mapped file or of the buffer received into; writable, so a tensor shares it)."""

    name: str
    info: PayloadInfo
    data: memoryview


@dataclass(frozen=True)
class TensorPiece:
    """A piece of one entry's tensor bytes (its payload's buffer), as it arrived.

    ``data`` views the received message (nothing is copied); it holds the tensor bytes
    ``[offset, offset + len(data))`` of entry ``name``, whose payload header said ``info``
    (dtype, shape, nbytes). Every entry comes as one or more pieces in order, from the
    ``first`` (at offset 0, possibly empty) to the ``last`` (ending at ``info.nbytes``).
    Booleans are bit-packed, eight to a byte, as the payload carries them.
    """

    name: str
    info: PayloadInfo
    offset: int
    data: memoryview
    first: bool
    last: bool


__all__ = ["Arrived", "TensorPiece"]
