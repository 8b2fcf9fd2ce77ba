"""Hand-written protobuf framing for the hot messages (tensor chunks), shared by client and server.

A generated message copies its ``chunk`` out of the received bytes (and copies it in,
then again to serialize). These functions read the ``chunk`` field as a view of the
bytes gRPC hands over, and build a message with a single join of the pieces to send
(the tensor's own memory, viewed): the one copy of tensor bytes on each side. The wire
format is protobuf's (field numbers from ``archives.proto`` and ``channels.proto``); any
conforming peer interoperates.

Server: :func:`parse_store_request`, :func:`encode_fetch_response`. Client:
:func:`encode_store_request`, :func:`encode_store_commit`, :func:`encode_publish_request`, :func:`parse_fetch_response`,
:func:`parse_subscribe_response`, and :func:`split_parts` to cut payloads into chunks. Both:
:class:`EntryBatch`, small whole entries several to a message (``StoreRequest.entries``,
``FetchResponse.entries``), read back as :class:`WholeEntry` views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, Union

from google.protobuf.message import DecodeError

from tannery_protocol.v1 import archives_pb2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

#: A piece of a message's bytes field: the field is the concatenation of its pieces.
Piece = Union[bytes, bytearray, memoryview]

#: Payloads below this many bytes are sent whole, several to a message, where the receiver
#: reads ``entries`` (:class:`EntryBatch`): their cost is the message, not the bytes. The
#: senders' choice, not a limit of the protocol: a receiver takes whole entries of any size.
BATCHED_BELOW = 64 << 10
#: The field numbers of ``entries`` in ``StoreRequest`` and ``FetchResponse``.
STORE_ENTRIES, FETCH_ENTRIES = 6, 3
#: The initial metadata of a Fetch that names the version of the archive it reads
#: (``FetchRequest.version`` of a resumed Fetch sends it back).
VERSION_KEY = "tannery-archive-version"
#: The initial metadata a Delete sends before it deletes anything: a client whose attempt
#: broke off after seeing it knows that attempt reached the server (and may have deleted).
RECEIVED_KEY = "tannery-received"


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


def length_delimited_fields(data: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
    """(field number, view of the value) of each length-delimited field of a serialized message,
    in order; WireError where the bytes stop making sense (to name a bad field in an error)."""
    for number, wire_type, value in _fields(memoryview(data)):
        if wire_type == _LEN:
            yield number, value


@dataclass(slots=True)
class WholeEntry:
    """A ``WholeEntry`` of a received message: a name and its whole payload, a view of the message."""

    name: str
    payload: memoryview
    #: The SHA-256 sent ahead of the payload (Store only; empty: none).
    sha256: bytes = b""


@dataclass(slots=True)
class StoreMessage:
    """A ``StoreRequest`` whose chunk views the received bytes."""

    begin: archives_pb2.StoreBegin | None
    entry: str
    chunk: memoryview
    #: Size of the message on the wire.
    size: int
    #: The client's final word (the last message only), else None.
    commit: archives_pb2.StoreCommit | None = None
    #: The SHA-256 the client sent ahead of ``entry``'s payload (empty: none).
    sha256: bytes = b""
    #: Whole entries after ``entry`` and ``chunk``, in order (``StoreRequest.entries``).
    entries: list[WholeEntry] = field(default_factory=list)


_EMPTY = memoryview(b"")


def _merge(message: Any, name: str, value: memoryview) -> Any:
    """``message`` merged with the bytes of its field ``name``; WireError naming the field if they are malformed."""
    try:
        message.MergeFromString(bytes(value))
    except DecodeError as exc:
        raise WireError(f"field {name} is not a valid {type(message).__name__}: {exc}") from None
    return message


def _utf8(value: memoryview, field: str) -> str:
    """A string field's text; WireError naming the field for bytes that are not UTF-8."""
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError:
        raise WireError(f"field {field} is not valid UTF-8") from None


def _whole_entry(value: memoryview, index: int) -> WholeEntry:
    """Entry ``index`` of a message's ``entries``: its payload a view of ``value``."""
    name, payload, sha256 = "", _EMPTY, b""
    for number, wire_type, inner in _fields(value):
        if wire_type != _LEN:
            continue
        if number == 1:
            name = _utf8(inner, f"entries[{index}].name")
        elif number == 2:
            payload = inner
        elif number == 3:
            sha256 = bytes(inner)
    return WholeEntry(name, payload, sha256)


def parse_store_request(data: bytes) -> StoreMessage:
    """The request deserializer of ``Store``; WireError for bytes that are not a StoreRequest."""
    view = memoryview(data)
    begin: archives_pb2.StoreBegin | None = None
    commit: archives_pb2.StoreCommit | None = None
    entry = ""
    chunk = _EMPTY
    sha256 = b""
    entries: list[WholeEntry] = []
    for number, wire_type, value in _fields(view):
        if wire_type != _LEN:
            continue  # no known field of StoreRequest has another wire type
        if number == 1:
            begin = _merge(begin or archives_pb2.StoreBegin(), "begin", value)
        elif number == 2:
            entry = _utf8(value, "entry")
        elif number == 3:
            chunk = value
        elif number == 4:
            commit = _merge(commit or archives_pb2.StoreCommit(), "commit", value)
        elif number == 5:
            sha256 = bytes(value)
        elif number == STORE_ENTRIES:
            entries.append(_whole_entry(value, len(entries)))
    return StoreMessage(begin, entry, chunk, len(view), commit, sha256, entries)


def _length_delimited(pieces: list[Piece], number: int, parts: Sequence[Piece]) -> None:
    """Append field ``number`` (wire type LEN) holding the concatenation of ``parts``, unless empty."""
    size = sum(memoryview(p).nbytes for p in parts)
    if size:
        pieces += (encode_varint(number << 3 | _LEN), encode_varint(size))
        pieces += parts


def _text(pieces: list[Piece], number: int, text: str | None) -> None:
    if text:
        _length_delimited(pieces, number, [text.encode("utf-8")])


def encode_fetch_response(entry: str | None, parts: Sequence[Piece]) -> bytes:
    """A serialized ``FetchResponse``: ``entry`` (if given) and the concatenation of ``parts`` as chunk."""
    pieces: list[Piece] = []
    _text(pieces, 1, entry)
    _length_delimited(pieces, 2, parts)
    return b"".join(pieces)


def encode_store_request(*, begin: bytes = b"", entry: str | None = None, parts: Sequence[Piece] = (),
                         sha256: bytes = b"") -> bytes:
    """A serialized ``StoreRequest``: ``begin`` (a serialized ``StoreBegin``), ``entry``, the
    concatenation of ``parts`` as chunk and ``sha256`` as entry_sha256, each only when given."""
    pieces: list[Piece] = []
    if begin:
        _length_delimited(pieces, 1, [begin])
    _text(pieces, 2, entry)
    _length_delimited(pieces, 3, parts)
    if sha256:
        _length_delimited(pieces, 5, [sha256])
    return b"".join(pieces)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field_size(size: int) -> int:
    """Bytes of a LEN field of ``size`` bytes (number below 16), tag and length included; 0 when empty."""
    return 1 + _varint_size(size) + size if size else 0


class EntryBatch:
    """Whole small entries gathered for one message (the ``entries`` of a ``StoreRequest`` or
    a ``FetchResponse``), up to ``budget`` bytes of message (one entry alone may pass it),
    then joined once by :meth:`take`: the one copy of their bytes. Parts are views, kept
    until then."""

    def __init__(self, number: int, budget: int) -> None:
        self.number, self.budget = number, budget
        self._tag = encode_varint(number << 3 | _LEN)
        self._pieces: list[Piece] = []
        #: Bytes of the message so far, entries, and their payload bytes.
        self.size = self.count = self.payload_bytes = 0

    @staticmethod
    def cost(name: bytes, size: int, sha256: bytes = b"") -> int:
        """Message bytes an entry of this (encoded) name, payload size and digest takes."""
        inner = _field_size(len(name)) + _field_size(size) + _field_size(len(sha256))
        return 1 + _varint_size(inner) + inner

    def full_for(self, cost: int) -> bool:
        """Whether an entry of ``cost`` bytes must go in the next message (this one is not empty)."""
        return self.count > 0 and self.size + cost > self.budget

    def add(self, name: bytes, parts: Sequence[Piece], size: int, sha256: bytes = b"") -> None:
        """Entry ``name`` (UTF-8) whose payload is the concatenation of ``parts`` (``size`` bytes)."""
        inner = _field_size(len(name)) + _field_size(size) + _field_size(len(sha256))
        pieces = self._pieces
        pieces += (self._tag, encode_varint(inner))
        if name:
            pieces += (b"\x0a", encode_varint(len(name)), name)
        if size:
            pieces.append(b"\x12" + encode_varint(size))
            pieces += parts
        if sha256:
            pieces += (b"\x1a", encode_varint(len(sha256)), sha256)
        self.size += 1 + _varint_size(inner) + inner
        self.count += 1
        self.payload_bytes += size

    def take(self) -> bytes:
        """The message of the entries added, which are forgotten (the batch is empty again)."""
        message = b"".join(self._pieces)
        self._pieces = []
        self.size = self.count = self.payload_bytes = 0
        return message


def encode_store_commit(entries: int, payload_bytes: int) -> bytes:
    """The last ``StoreRequest`` of a Store: ``commit`` with what the client sent."""
    commit = archives_pb2.StoreCommit(entries=entries, payload_bytes=payload_bytes)
    return archives_pb2.StoreRequest(commit=commit).SerializeToString()


def encode_publish_request(channel: str | None, parts: Sequence[Piece], store_as: bytes = b"") -> bytes:
    """A serialized ``PublishRequest``: ``channel`` (the first message's), the concatenation of
    ``parts``, and ``store_as`` (a serialized ``StoreAs``, the first message's; b"" for none)."""
    pieces: list[Piece] = []
    _text(pieces, 1, channel)
    _length_delimited(pieces, 2, parts)
    if store_as:
        _length_delimited(pieces, 3, [store_as])
    return b"".join(pieces)


def split_parts(parts: Iterable[Piece], size: int) -> Iterator[list[memoryview]]:
    """The bytes of ``parts``, in order, as lists of views of exactly ``size`` bytes (the last
    list shorter; none for no bytes). Nothing is copied: a part is sliced where a chunk ends."""
    if size < 1:
        raise ValueError(f"chunk size {size} must be at least 1")
    chunk: list[memoryview] = []
    filled = 0
    for part in parts:
        view = memoryview(part)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            chunk.append(view[:take] if take < view.nbytes else view)
            view = view[take:]
            filled += take
            if filled == size:
                yield chunk
                chunk, filled = [], 0
    if chunk:
        yield chunk


@dataclass(slots=True)
class FetchMessage:
    """A ``FetchResponse`` whose chunk views the received bytes."""

    #: The entry this message starts, or "" for a continuation.
    entry: str
    chunk: memoryview
    #: Whole entries after ``entry`` and ``chunk``, in order (``FetchResponse.entries``).
    entries: Sequence[WholeEntry] = ()


def parse_fetch_response(data: bytes) -> FetchMessage:
    """The response deserializer of ``Fetch`` (client side)."""
    entry = ""
    chunk = _EMPTY
    entries: list[WholeEntry] = []
    for number, wire_type, value in _fields(memoryview(data)):
        if wire_type != _LEN:
            continue
        if number == 1:
            entry = _utf8(value, "entry")
        elif number == 2:
            chunk = value
        elif number == FETCH_ENTRIES:
            entries.append(_whole_entry(value, len(entries)))
    return FetchMessage(entry, chunk, entries)


class _Abandoned:
    """The type of :data:`ABANDONED`."""

    def __repr__(self) -> str:
        return "ABANDONED"


#: What :func:`parse_subscribe_response` returns for a message saying the payload in progress
#: was cut off by its publisher: its bytes received so far must be discarded.
ABANDONED = _Abandoned()


def parse_subscribe_response(data: bytes) -> memoryview | _Abandoned:
    """The response deserializer of ``Subscribe`` (client side): the chunk, a view of ``data``,
    or :data:`ABANDONED` when the message says the payload in progress was abandoned."""
    chunk = _EMPTY
    abandoned = False
    for number, wire_type, value in _fields(memoryview(data)):
        if number == 1 and wire_type == _LEN:
            chunk = value
        elif number == 2 and wire_type == _VARINT:
            abandoned = bool(value)
    if abandoned:
        if chunk.nbytes:
            raise WireError(f"a SubscribeResponse marks the payload abandoned and carries {chunk.nbytes} chunk bytes")
        return ABANDONED
    return chunk


def serialize_response(message: object) -> bytes:
    """Serializer that passes pre-encoded bytes through (and serializes a generated message)."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[attr-defined]
