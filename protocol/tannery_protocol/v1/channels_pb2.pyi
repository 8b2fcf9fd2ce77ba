from tannery_protocol.v1 import archives_pb2 as _archives_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("channel", "address", "key", "member", "unreachable", "certificate")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    channel: str
    address: str
    key: bytes
    member: str
    unreachable: str
    certificate: bytes
    def __init__(self, channel: _Optional[str] = ..., address: _Optional[str] = ..., key: _Optional[bytes] = ..., member: _Optional[str] = ..., unreachable: _Optional[str] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class RouteUpdate(_message.Message):
    __slots__ = ("parent", "parent_key", "children", "generation", "address", "parent_certificate")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARENT_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    parent: str
    parent_key: bytes
    children: int
    generation: int
    address: str
    parent_certificate: bytes
    def __init__(self, parent: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., children: _Optional[int] = ..., generation: _Optional[int] = ..., address: _Optional[str] = ..., parent_certificate: _Optional[bytes] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("channel", "chunk", "store_as")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STORE_AS_FIELD_NUMBER: _ClassVar[int]
    channel: str
    chunk: bytes
    store_as: StoreAs
    def __init__(self, channel: _Optional[str] = ..., chunk: _Optional[bytes] = ..., store_as: _Optional[_Union[StoreAs, _Mapping]] = ...) -> None: ...

class StoreAs(_message.Message):
    __slots__ = ("archive", "metadata", "replace", "entries")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    archive: str
    metadata: _containers.ScalarMap[str, str]
    replace: bool
    entries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, archive: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., replace: _Optional[bool] = ..., entries: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("payloads", "bytes", "dropped_subscribers", "stored", "store_error")
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    payloads: int
    bytes: int
    dropped_subscribers: int
    stored: _archives_pb2.ArchiveInfo
    store_error: str
    def __init__(self, payloads: _Optional[int] = ..., bytes: _Optional[int] = ..., dropped_subscribers: _Optional[int] = ..., stored: _Optional[_Union[_archives_pb2.ArchiveInfo, _Mapping]] = ..., store_error: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: str
    def __init__(self, channel: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("chunk", "abandoned")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    abandoned: bool
    def __init__(self, chunk: _Optional[bytes] = ..., abandoned: _Optional[bool] = ...) -> None: ...
