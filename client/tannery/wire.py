"""Hand-written protobuf framing for the hot messages (tensor chunks), shared by client and server.

A generated ``StoreRequest`` copies its ``chunk`` out of the received message (and a
generated ``FetchResponse`` copies it in, then again to serialize). These functions read
the ``chunk`` field as a view of the bytes gRPC hands over, and build a response with a
single join of the pieces to send. The wire format is protobuf's (field numbers from
``archives.proto``); any conforming client interoperates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tannery.v1 import archives_pb2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a valid protobuf message of the expected type."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(data: memoryview):
    """(field number, wire type, value) of each field; LEN values are views."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _varint(data, pos)
        elif wire_type == _LEN:
            size, pos = _varint(data, pos)
            if pos + size > end:
                raise WireError(f"field {number}: {size} bytes announced, {end - pos} left")
            value, pos = data[pos : pos + size], pos + size
        elif wire_type == _I64:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire_type == _I32:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise WireError(f"field {number}: unsupported wire type {wire_type}")
        if pos > end:
            raise WireError(f"field {number}: truncated")
        yield number, wire_type, value


@dataclass(slots=True)
class StoreMessage:
    """A ``StoreRequest`` whose chunk views the received bytes."""

    begin: archives_pb2.StoreBegin | None
    entry: str
    chunk: memoryview
    #: Size of the message on the wire.
    size: int


_EMPTY = memoryview(b"")


def parse_store_request(data: bytes) -> StoreMessage:
    """The request deserializer of ``Store``."""
    view = memoryview(data)
    begin: archives_pb2.StoreBegin | None = None
    entry = ""
    chunk = _EMPTY
    for number, wire_type, value in _fields(view):
        if wire_type != _LEN:
            continue  # no known field of StoreRequest has another wire type
        if number == 1:
            if begin is None:
                begin = archives_pb2.StoreBegin()
            begin.MergeFromString(bytes(value))
        elif number == 2:
            try:
                entry = str(value, "utf-8")
            except UnicodeDecodeError:
                raise WireError("field entry is not valid UTF-8") from None
        elif number == 3:
            chunk = value
    return StoreMessage(begin, entry, chunk, len(view))


def encode_fetch_response(entry: str | None, parts: Sequence[bytes | memoryview]) -> bytes:
    """A serialized ``FetchResponse``: ``entry`` (if given) and the concatenation of ``parts`` as chunk."""
    pieces: list[bytes | memoryview] = []
    if entry:
        name = entry.encode("utf-8")
        pieces += (b"\x0a", encode_varint(len(name)), name)
    size = sum(memoryview(p).nbytes for p in parts)
    if size:
        pieces += (b"\x12", encode_varint(size))
        pieces += parts
    return b"".join(pieces)


def serialize_response(message: object) -> bytes:
    """Response serializer that passes pre-encoded bytes through."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[attr-defined]
