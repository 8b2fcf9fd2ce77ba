import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataPathsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPathsResponse(_message.Message):
    __slots__ = ("socket_path", "data_port", "data_tls", "server_id", "wants_digests", "batched_entries")
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TLS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    WANTS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    data_port: int
    data_tls: bool
    server_id: str
    wants_digests: bool
    batched_entries: bool
    def __init__(self, socket_path: _Optional[str] = ..., data_port: _Optional[int] = ..., data_tls: _Optional[bool] = ..., server_id: _Optional[str] = ..., wants_digests: _Optional[bool] = ..., batched_entries: _Optional[bool] = ...) -> None: ...

class StoreBegin(_message.Message):
    __slots__ = ("archive", "replace", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    archive: str
    replace: bool
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, archive: _Optional[str] = ..., replace: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StoreCommit(_message.Message):
    __slots__ = ("entries", "payload_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    payload_bytes: int
    def __init__(self, entries: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("begin", "entry", "chunk", "commit", "entry_sha256", "entries")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    begin: StoreBegin
    entry: str
    chunk: bytes
    commit: StoreCommit
    entry_sha256: bytes
    entries: _containers.RepeatedCompositeFieldContainer[WholeEntry]
    def __init__(self, begin: _Optional[_Union[StoreBegin, _Mapping]] = ..., entry: _Optional[str] = ..., chunk: _Optional[bytes] = ..., commit: _Optional[_Union[StoreCommit, _Mapping]] = ..., entry_sha256: _Optional[bytes] = ..., entries: _Optional[_Iterable[_Union[WholeEntry, _Mapping]]] = ...) -> None: ...

class WholeEntry(_message.Message):
    __slots__ = ("name", "payload", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    payload: bytes
    sha256: bytes
    def __init__(self, name: _Optional[str] = ..., payload: _Optional[bytes] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class ArchiveInfo(_message.Message):
    __slots__ = ("name", "entries", "nbytes", "payload_bytes", "created", "already_stored", "files", "file_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    entries: int
    nbytes: int
    payload_bytes: int
    created: _timestamp_pb2.Timestamp
    already_stored: bool
    files: int
    file_bytes: int
    def __init__(self, name: _Optional[str] = ..., entries: _Optional[int] = ..., nbytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., already_stored: _Optional[bool] = ..., files: _Optional[int] = ..., file_bytes: _Optional[int] = ...) -> None: ...

class DeriveBegin(_message.Message):
    __slots__ = ("archive", "base", "replace", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    archive: str
    base: str
    replace: bool
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, archive: _Optional[str] = ..., base: _Optional[str] = ..., replace: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DeriveEntry(_message.Message):
    __slots__ = ("name", "change", "crc32c", "payload_bytes")
    class Change(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CHANGE_UNSPECIFIED: _ClassVar[DeriveEntry.Change]
        SAME: _ClassVar[DeriveEntry.Change]
        DELTA: _ClassVar[DeriveEntry.Change]
        WHOLE: _ClassVar[DeriveEntry.Change]
    CHANGE_UNSPECIFIED: DeriveEntry.Change
    SAME: DeriveEntry.Change
    DELTA: DeriveEntry.Change
    WHOLE: DeriveEntry.Change
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    change: DeriveEntry.Change
    crc32c: int
    payload_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., change: _Optional[_Union[DeriveEntry.Change, str]] = ..., crc32c: _Optional[int] = ..., payload_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class DeriveCommit(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    def __init__(self, entries: _Optional[int] = ...) -> None: ...

class DeriveRequest(_message.Message):
    __slots__ = ("begin", "entry", "chunk", "commit")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    begin: DeriveBegin
    entry: DeriveEntry
    chunk: bytes
    commit: DeriveCommit
    def __init__(self, begin: _Optional[_Union[DeriveBegin, _Mapping]] = ..., entry: _Optional[_Union[DeriveEntry, _Mapping]] = ..., chunk: _Optional[bytes] = ..., commit: _Optional[_Union[DeriveCommit, _Mapping]] = ...) -> None: ...

class UnionSource(_message.Message):
    __slots__ = ("archive", "prefix")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    archive: str
    prefix: str
    def __init__(self, archive: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class UnionRequest(_message.Message):
    __slots__ = ("target", "sources", "replace", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    target: str
    sources: _containers.RepeatedCompositeFieldContainer[UnionSource]
    replace: bool
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, target: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[UnionSource, _Mapping]]] = ..., replace: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Shape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class EntryAsk(_message.Message):
    __slots__ = ("name", "shape", "dtype", "cast", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: Shape
    dtype: str
    cast: str
    rows: RowRange
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Union[Shape, _Mapping]] = ..., dtype: _Optional[str] = ..., cast: _Optional[str] = ..., rows: _Optional[_Union[RowRange, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("archive", "entries", "prefix", "batched_entries", "version")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    archive: str
    entries: _containers.RepeatedCompositeFieldContainer[EntryAsk]
    prefix: str
    batched_entries: bool
    version: str
    def __init__(self, archive: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[EntryAsk, _Mapping]]] = ..., prefix: _Optional[str] = ..., batched_entries: _Optional[bool] = ..., version: _Optional[str] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("entry", "chunk", "entries")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entry: str
    chunk: bytes
    entries: _containers.RepeatedCompositeFieldContainer[WholeEntry]
    def __init__(self, entry: _Optional[str] = ..., chunk: _Optional[bytes] = ..., entries: _Optional[_Iterable[_Union[WholeEntry, _Mapping]]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("archive", "names", "no_entries")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    NO_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    archive: str
    names: _containers.RepeatedScalarFieldContainer[str]
    no_entries: bool
    def __init__(self, archive: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., no_entries: _Optional[bool] = ...) -> None: ...

class EntryInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "payload_bytes", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    payload_bytes: int
    digest: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ArchiveDescription(_message.Message):
    __slots__ = ("info", "entries", "metadata", "lost_entries")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LOST_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    info: ArchiveInfo
    entries: _containers.RepeatedCompositeFieldContainer[EntryInfo]
    metadata: _containers.ScalarMap[str, str]
    lost_entries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, info: _Optional[_Union[ArchiveInfo, _Mapping]] = ..., entries: _Optional[_Iterable[_Union[EntryInfo, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., lost_entries: _Optional[_Iterable[str]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("prefix", "page_size", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    page_size: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("archives", "next_page_token")
    ARCHIVES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    archives: _containers.RepeatedCompositeFieldContainer[ArchiveInfo]
    next_page_token: str
    def __init__(self, archives: _Optional[_Iterable[_Union[ArchiveInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("archive", "force")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    archive: str
    force: bool
    def __init__(self, archive: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "blobs_removed", "bytes_freed", "aliases_removed", "aliases_removed_count")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    ALIASES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALIASES_REMOVED_COUNT_FIELD_NUMBER: _ClassVar[int]
    deleted: ArchiveInfo
    blobs_removed: int
    bytes_freed: int
    aliases_removed: _containers.RepeatedScalarFieldContainer[str]
    aliases_removed_count: int
    def __init__(self, deleted: _Optional[_Union[ArchiveInfo, _Mapping]] = ..., blobs_removed: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., aliases_removed: _Optional[_Iterable[str]] = ..., aliases_removed_count: _Optional[int] = ...) -> None: ...

class Alias(_message.Message):
    __slots__ = ("alias", "archive", "moved")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    alias: str
    archive: str
    moved: _timestamp_pb2.Timestamp
    def __init__(self, alias: _Optional[str] = ..., archive: _Optional[str] = ..., moved: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TagRequest(_message.Message):
    __slots__ = ("alias", "archive", "expect")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    alias: str
    archive: str
    expect: str
    def __init__(self, alias: _Optional[str] = ..., archive: _Optional[str] = ..., expect: _Optional[str] = ...) -> None: ...

class TagResponse(_message.Message):
    __slots__ = ("alias", "previous", "changed")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    alias: Alias
    previous: str
    changed: bool
    def __init__(self, alias: _Optional[_Union[Alias, _Mapping]] = ..., previous: _Optional[str] = ..., changed: _Optional[bool] = ...) -> None: ...

class UntagRequest(_message.Message):
    __slots__ = ("alias",)
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    alias: str
    def __init__(self, alias: _Optional[str] = ...) -> None: ...

class UntagResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: Alias
    def __init__(self, removed: _Optional[_Union[Alias, _Mapping]] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("archive", "alias")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    archive: str
    alias: Alias
    def __init__(self, archive: _Optional[str] = ..., alias: _Optional[_Union[Alias, _Mapping]] = ...) -> None: ...

class ListAliasesRequest(_message.Message):
    __slots__ = ("prefix", "archive", "archive_prefix", "page_size", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    archive: str
    archive_prefix: str
    page_size: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., archive: _Optional[str] = ..., archive_prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAliasesResponse(_message.Message):
    __slots__ = ("aliases", "next_page_token")
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    aliases: _containers.RepeatedCompositeFieldContainer[Alias]
    next_page_token: str
    def __init__(self, aliases: _Optional[_Iterable[_Union[Alias, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("alias",)
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    alias: str
    def __init__(self, alias: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("archive", "moved")
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    archive: str
    moved: _timestamp_pb2.Timestamp
    def __init__(self, archive: _Optional[str] = ..., moved: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DiffRequest(_message.Message):
    __slots__ = ("a", "b", "names", "prefix", "list_same")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIST_SAME_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    names: _containers.RepeatedScalarFieldContainer[str]
    prefix: str
    list_same: bool
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., prefix: _Optional[str] = ..., list_same: _Optional[bool] = ...) -> None: ...

class ValueChange(_message.Message):
    __slots__ = ("elements", "differing", "max_abs", "relative_l2", "nan_appeared", "inf_appeared")
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DIFFERING_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_L2_FIELD_NUMBER: _ClassVar[int]
    NAN_APPEARED_FIELD_NUMBER: _ClassVar[int]
    INF_APPEARED_FIELD_NUMBER: _ClassVar[int]
    elements: int
    differing: int
    max_abs: float
    relative_l2: float
    nan_appeared: int
    inf_appeared: int
    def __init__(self, elements: _Optional[int] = ..., differing: _Optional[int] = ..., max_abs: _Optional[float] = ..., relative_l2: _Optional[float] = ..., nan_appeared: _Optional[int] = ..., inf_appeared: _Optional[int] = ...) -> None: ...

class EntryDiff(_message.Message):
    __slots__ = ("name", "change", "dtype_a", "dtype_b", "shape_a", "shape_b", "nbytes_a", "nbytes_b", "values", "file")
    class Change(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CHANGE_UNSPECIFIED: _ClassVar[EntryDiff.Change]
        SAME: _ClassVar[EntryDiff.Change]
        ADDED: _ClassVar[EntryDiff.Change]
        REMOVED: _ClassVar[EntryDiff.Change]
        TYPE: _ClassVar[EntryDiff.Change]
        VALUE: _ClassVar[EntryDiff.Change]
    CHANGE_UNSPECIFIED: EntryDiff.Change
    SAME: EntryDiff.Change
    ADDED: EntryDiff.Change
    REMOVED: EntryDiff.Change
    TYPE: EntryDiff.Change
    VALUE: EntryDiff.Change
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_A_FIELD_NUMBER: _ClassVar[int]
    DTYPE_B_FIELD_NUMBER: _ClassVar[int]
    SHAPE_A_FIELD_NUMBER: _ClassVar[int]
    SHAPE_B_FIELD_NUMBER: _ClassVar[int]
    NBYTES_A_FIELD_NUMBER: _ClassVar[int]
    NBYTES_B_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    change: EntryDiff.Change
    dtype_a: str
    dtype_b: str
    shape_a: _containers.RepeatedScalarFieldContainer[int]
    shape_b: _containers.RepeatedScalarFieldContainer[int]
    nbytes_a: int
    nbytes_b: int
    values: ValueChange
    file: bool
    def __init__(self, name: _Optional[str] = ..., change: _Optional[_Union[EntryDiff.Change, str]] = ..., dtype_a: _Optional[str] = ..., dtype_b: _Optional[str] = ..., shape_a: _Optional[_Iterable[int]] = ..., shape_b: _Optional[_Iterable[int]] = ..., nbytes_a: _Optional[int] = ..., nbytes_b: _Optional[int] = ..., values: _Optional[_Union[ValueChange, _Mapping]] = ..., file: _Optional[bool] = ...) -> None: ...

class MetadataChange(_message.Message):
    __slots__ = ("key", "a", "b")
    KEY_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    key: str
    a: str
    b: str
    def __init__(self, key: _Optional[str] = ..., a: _Optional[str] = ..., b: _Optional[str] = ...) -> None: ...

class DiffSummary(_message.Message):
    __slots__ = ("same", "added", "removed", "type_changed", "value_changed", "bytes_read", "files_same", "files_changed")
    SAME_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TYPE_CHANGED_FIELD_NUMBER: _ClassVar[int]
    VALUE_CHANGED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    FILES_SAME_FIELD_NUMBER: _ClassVar[int]
    FILES_CHANGED_FIELD_NUMBER: _ClassVar[int]
    same: int
    added: int
    removed: int
    type_changed: int
    value_changed: int
    bytes_read: int
    files_same: int
    files_changed: int
    def __init__(self, same: _Optional[int] = ..., added: _Optional[int] = ..., removed: _Optional[int] = ..., type_changed: _Optional[int] = ..., value_changed: _Optional[int] = ..., bytes_read: _Optional[int] = ..., files_same: _Optional[int] = ..., files_changed: _Optional[int] = ...) -> None: ...

class DiffResponse(_message.Message):
    __slots__ = ("a", "b", "entries", "metadata", "summary")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    entries: _containers.RepeatedCompositeFieldContainer[EntryDiff]
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataChange]
    summary: DiffSummary
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[EntryDiff, _Mapping]]] = ..., metadata: _Optional[_Iterable[_Union[MetadataChange, _Mapping]]] = ..., summary: _Optional[_Union[DiffSummary, _Mapping]] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("alias", "limit")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    alias: str
    limit: int
    def __init__(self, alias: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class AliasMove(_message.Message):
    __slots__ = ("alias", "previous", "archive", "moved", "by")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    alias: str
    previous: str
    archive: str
    moved: _timestamp_pb2.Timestamp
    by: str
    def __init__(self, alias: _Optional[str] = ..., previous: _Optional[str] = ..., archive: _Optional[str] = ..., moved: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., by: _Optional[str] = ...) -> None: ...

class HistoryResponse(_message.Message):
    __slots__ = ("moves",)
    MOVES_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[AliasMove]
    def __init__(self, moves: _Optional[_Iterable[_Union[AliasMove, _Mapping]]] = ...) -> None: ...
