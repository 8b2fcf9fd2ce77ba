"""The answers that describe an archive or an alias (``ArchiveInfo``, ``Alias``, ``AliasMove``), made from
the catalog's records: what Store, Union, Derive, a storing Publish and the listings answer."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from tannery_protocol.v1 import archives_pb2

from .calllog import current_call
from .storage import AliasMove, AliasRecord, ArchiveRecord


def archive_info(record: ArchiveRecord) -> archives_pb2.ArchiveInfo:
    created = Timestamp()
    created.FromNanoseconds(record.created_ns)
    return archives_pb2.ArchiveInfo(  # the tensors, and the kept files apart
        name=record.name, entries=record.tensors, nbytes=record.nbytes - record.file_nbytes,
        payload_bytes=record.payload_bytes - record.file_payload_bytes, created=created,
        already_stored=record.already_stored, files=record.files, file_bytes=record.file_nbytes,
    )


def alias_info(record: AliasRecord) -> archives_pb2.Alias:
    moved = Timestamp()
    moved.FromNanoseconds(record.moved_ns)
    return archives_pb2.Alias(alias=record.alias, archive=record.archive, moved=moved)


def move_info(move: AliasMove) -> archives_pb2.AliasMove:
    moved = Timestamp()
    moved.FromNanoseconds(move.moved_ns)
    return archives_pb2.AliasMove(alias=move.alias, previous=move.previous, archive=move.archive, moved=moved,
                                  by=move.by)


def written(record: ArchiveRecord) -> archives_pb2.ArchiveInfo:
    """The answer of a Store or Union; the call's log line says when it found the archive
    already holding exactly its content (and stored nothing)."""
    if record.already_stored:
        current_call().note("already_stored", True)
    return archive_info(record)


__all__ = ["alias_info", "archive_info", "move_info", "written"]
