from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PublishRequest(_message.Message):
    __slots__ = ("channel", "chunk")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    channel: str
    chunk: bytes
    def __init__(self, channel: _Optional[str] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("payloads", "bytes", "dropped_subscribers")
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    payloads: int
    bytes: int
    dropped_subscribers: int
    def __init__(self, payloads: _Optional[int] = ..., bytes: _Optional[int] = ..., dropped_subscribers: _Optional[int] = ...) -> None: ...

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
