"""What a channel relays: the pieces of payloads, each one object shared by every subscriber.

A piece is queued in the hub (:mod:`..hub`) once and taken by every subscriber of the
payload, whatever its path, so its bytes are never copied or encoded once per subscriber:

- :class:`Chunk`: some bytes of a payload (published over gRPC or TCP, or come from another
  replica). Data connections send its bytes as they are (``sendall`` of a view); gRPC
  subscribers write its message, made once, by the first of them that needs it.
- :class:`SharedPayload`: one whole payload in a sealed memory file (published on the same
  host). Same-host subscribers get its descriptor, TCP ones its bytes by ``sendfile``, gRPC
  ones messages made from its mapping.
"""

from __future__ import annotations

import os
import weakref
from typing import Iterator

from tannery_protocol.codec import Buffer
from tannery_protocol.v1 import channels_pb2

from .links import sealed_map


class Chunk:
    """Bytes of a payload, relayed as one piece (the server's chunk size at most, or
    :data:`~.channel_tcp.TCP_PIECE` from a TCP publisher)."""

    __slots__ = ("data", "_messages")

    def __init__(self, data: bytes | bytearray) -> None:
        #: The bytes, never written once relayed (data connections send them from worker threads).
        self.data = data
        self._messages: list[channels_pb2.SubscribeResponse] | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def messages(self, chunk_size: int) -> list[channels_pb2.SubscribeResponse]:
        """The gRPC subscribers' messages of at most ``chunk_size`` bytes, made at the first use
        and shared by all of them (protobuf takes ``bytes`` only: received bytes are copied to
        make them, once)."""
        if self._messages is None:
            if isinstance(self.data, bytes) and len(self.data) <= chunk_size:
                self._messages = [channels_pb2.SubscribeResponse(chunk=self.data)]
            else:
                view = memoryview(self.data)
                self._messages = [channels_pb2.SubscribeResponse(chunk=bytes(view[start : start + chunk_size]))
                                  for start in range(0, len(view), chunk_size)]
        return self._messages


class SharedPayload:
    """One whole payload in a sealed memory file, relayed to every subscriber as one piece."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mapped = sealed_map(fd, size, "published payload")
        weakref.finalize(self, os.close, fd)

    def messages(self, chunk_size: int) -> Iterator[channels_pb2.SubscribeResponse]:
        """The payload as the messages of a gRPC subscriber."""
        view = memoryview(self.mapped)
        for start in range(0, self.size, chunk_size):
            yield channels_pb2.SubscribeResponse(chunk=bytes(view[start : start + chunk_size]))


def grpc_messages(piece: object, chunk_size: int) -> Iterator[object]:
    """What a gRPC subscriber writes for a relayed piece (the hub's *abandoned* marker as it is)."""
    if isinstance(piece, (SharedPayload, Chunk)):
        yield from piece.messages(chunk_size)
    else:
        yield piece


def data_of(piece: object) -> Buffer:
    """The payload bytes a relayed piece carries (what the channel fabric sends to other replicas)."""
    if isinstance(piece, SharedPayload):
        return piece.mapped
    assert isinstance(piece, Chunk), piece
    return piece.data
