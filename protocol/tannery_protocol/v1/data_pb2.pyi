from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataFrame(_message.Message):
    __slots__ = ("welcome", "hello", "entry", "mapped", "piece", "end", "failure", "abandoned", "taken")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    hello: Hello
    entry: EntryBytes
    mapped: MappedEntry
    piece: SealedPiece
    end: DataEnd
    failure: DataFailure
    abandoned: Abandoned
    taken: Taken
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., entry: _Optional[_Union[EntryBytes, _Mapping]] = ..., mapped: _Optional[_Union[MappedEntry, _Mapping]] = ..., piece: _Optional[_Union[SealedPiece, _Mapping]] = ..., end: _Optional[_Union[DataEnd, _Mapping]] = ..., failure: _Optional[_Union[DataFailure, _Mapping]] = ..., abandoned: _Optional[_Union[Abandoned, _Mapping]] = ..., taken: _Optional[_Union[Taken, _Mapping]] = ...) -> None: ...

class Taken(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: int
    def __init__(self, payloads: _Optional[int] = ...) -> None: ...

class Abandoned(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("server_id",)
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    def __init__(self, server_id: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class EntryBytes(_message.Message):
    __slots__ = ("name", "payload_bytes", "sha256", "inline")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    name: str
    payload_bytes: int
    sha256: bytes
    inline: bool
    def __init__(self, name: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., inline: _Optional[bool] = ...) -> None: ...

class MappedEntry(_message.Message):
    __slots__ = ("name", "prefix", "offset", "length", "digest", "file_size", "block_size", "first_block", "block_crcs", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRCS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    prefix: bytes
    offset: int
    length: int
    digest: str
    file_size: int
    block_size: int
    first_block: int
    block_crcs: bytes
    checksum: str
    def __init__(self, name: _Optional[str] = ..., prefix: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., digest: _Optional[str] = ..., file_size: _Optional[int] = ..., block_size: _Optional[int] = ..., first_block: _Optional[int] = ..., block_crcs: _Optional[bytes] = ..., checksum: _Optional[str] = ...) -> None: ...

class SealedPiece(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class DataEnd(_message.Message):
    __slots__ = ("entries", "payload_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    payload_bytes: int
    def __init__(self, entries: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class DataFailure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
