"""What the SQLite and PostgreSQL catalogs share: the same columns, how a row becomes a record
and a record a row, and the rules of a union and of an archive that already holds a Store's
or Union's content, written once for both.

The two differ in their placeholders (``?`` and ``%s``), given to the queries here as ``mark``.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping, Sequence

from .base import ArchiveLimits, ArchiveRecord, EntryRecord
from .errors import InvalidRequest, TooManyEntries
from .same_content import AlreadyThere, require_same

#: Columns of an entry (``e``: the entries table), in :class:`EntryRecord`'s order. ``blob`` is
#: the blob that holds the payload (what collection counts), ``digest`` the payload's SHA-256.
ENTRY_COLUMNS = "e.name, e.dtype, e.shape, e.nbytes, e.payload_bytes, e.data_offset, e.digest, e.blob, e.blob_offset"
#: The columns an entry keeps when a union copies it under a new name (all but the name).
ENTRY_COPIED = "dtype, shape, nbytes, payload_bytes, data_offset, digest, blob, blob_offset"
#: Columns an entry is inserted with (:func:`entry_values`' order).
ENTRY_INSERT = f"archive_id, name, {ENTRY_COPIED}"
#: Whether entry ``f`` is a file kept with its archive, not a tensor: named ``@file:NAME``, or
#: ``P.@file:NAME`` under a prefix (the client's ``tannery.records.MARK``; docs/model-folders.md).
#: In the SQL both catalogs speak (substr and replace, case-sensitive in both).
IS_FILE = "(substr(f.name, 1, 6) = '@file:' OR replace(f.name, '.@file:', '') <> f.name)"
_FILES = f"FROM entries f WHERE f.archive_id = archives.id AND {IS_FILE}"
#: Columns of an archive (of the table ``archives``, unaliased), in :class:`ArchiveRecord`'s order:
#: its totals over every entry, the metadata, then the kept files' count, tensor bytes and payload
#: bytes, which Describe, List and a Store's answer count apart from the tensors.
ARCHIVE_COLUMNS = ("name, entries, nbytes, payload_bytes, created_ns, metadata, "
                   f"(SELECT count(*) {_FILES}), (SELECT coalesce(sum(f.nbytes), 0) {_FILES}), "
                   f"(SELECT coalesce(sum(f.payload_bytes), 0) {_FILES})")
#: Columns of a blob, in :class:`~.base.BlobInfo`'s order.
BLOB_COLUMNS = "digest, size, block_size, block_crcs, checksum"

#: A query of a catalog's: its rows for ``(sql, args)``, in the catalog's own transaction.
Query = Callable[[str, tuple], Sequence[tuple]]


def entry_from_row(row: tuple) -> EntryRecord:
    """An entry from its columns (:data:`ENTRY_COLUMNS`; the shape as JSON text)."""
    name, dtype, shape, nbytes, payload_bytes, data_offset, digest, blob, blob_offset = row
    return EntryRecord(name, dtype, tuple(json.loads(shape)), nbytes, payload_bytes, data_offset, digest, blob,
                       blob_offset)


def entry_values(archive_id: int, e: EntryRecord) -> tuple:
    """The row of ``e`` in archive ``archive_id`` (:data:`ENTRY_INSERT`)."""
    return (archive_id, e.name, e.dtype, json.dumps(list(e.shape)), e.nbytes, e.payload_bytes, e.data_offset,
            e.digest, e.blob, e.blob_offset)


def archive_from_row(row: tuple) -> ArchiveRecord:
    """An archive from its columns (:data:`ARCHIVE_COLUMNS`; the metadata as JSON text)."""
    *fields, metadata, files, file_nbytes, file_payload_bytes = row
    return ArchiveRecord(*fields, metadata=json.loads(metadata) if metadata else {}, files=int(files),
                         file_nbytes=int(file_nbytes), file_payload_bytes=int(file_payload_bytes))


def metadata_text(metadata: Mapping[str, str] | None) -> str:
    """An archive's metadata as its column holds it: a JSON object, keys sorted."""
    return json.dumps(dict(metadata or {}), sort_keys=True, ensure_ascii=False)


def entries_under_query(mark: str, prefix: str) -> tuple[str, tuple]:
    """The query of the entries of archive (``args[0]``, to prepend) that ``prefix`` owns, by name,
    and its arguments after the archive's name."""
    query = f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id WHERE a.name = {mark}"
    args: tuple = ()
    if prefix:
        # The prefix itself and the names in [prefix + ".", prefix + "/"): '/' follows '.'.
        query += f" AND (e.name = {mark} OR (e.name >= {mark} AND e.name < {mark}))"
        args = (prefix, prefix + ".", prefix + "/")
    return query + " ORDER BY e.name", args


def check_union_limits(target: str, count: int, longest: int, longest_name: Callable[[], str],
                       limits: ArchiveLimits) -> None:
    """TooManyEntries for a union of more than ``limits.max_entries`` entries, InvalidRequest when its
    longest name (``longest`` bytes, ``longest_name()``) is over ``limits.max_name_bytes``."""
    if count > limits.max_entries:
        raise TooManyEntries(f"union {target!r}: {count} entries, over the limit of {limits.max_entries}")
    if longest > limits.max_name_bytes:
        name = longest_name()
        raise InvalidRequest(
            f"union {target!r}: entry name {name[:64]!r}... is {longest} bytes, over the limit of "
            f"{limits.max_name_bytes}"
        )


def duplicate_error(name: str, sources: Sequence[tuple[str, str]], ids: Sequence[int],
                    has_entry: Callable[[int, str], bool]) -> InvalidRequest:
    """The error for the last of ``sources``, which gives the entry ``name`` that an earlier
    source already gave; ``has_entry(archive_id, entry)`` finds which one."""
    archive = sources[-1][0]
    first = "?"
    for (other, other_prefix), other_id in zip(sources[:-1], ids):
        if other_prefix and not (name == other_prefix or name.startswith(other_prefix + ".")):
            continue
        inner = name[len(other_prefix) + 1 :] if other_prefix else name
        if has_entry(other_id, inner):
            first = other
            break
    return InvalidRequest(f"union: {name!r} is in two sources, {first!r} and {archive!r}")


def compare_union_first(query: Query, mark: str, target: str, sources: Sequence[tuple[int, str]],
                        metadata: Mapping[str, str] | None, limits: ArchiveLimits) -> None:
    """Before a union without ``replace`` is built: return when no archive ``target`` exists, or
    when its sources (``(archive id, prefix)``) give a name twice (the build names it); else
    AlreadyThere when ``target`` holds exactly what the union would (nothing is written),
    TooManyEntries or InvalidRequest for a union over ``limits``, ArchiveExists otherwise: a
    refused union costs a read of its sources, not a copy of their entries."""
    rows = query(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name = {mark}", (target,))
    if not rows:
        return
    new = [entry_from_row(row).renamed(prefix) for source_id, prefix in sources
           for row in query(f"SELECT {ENTRY_COLUMNS} FROM entries e WHERE e.archive_id = {mark}", (source_id,))]
    if len({e.name for e in new}) != len(new):
        return
    longest = max(new, key=lambda e: len(e.name.encode("utf-8")), default=None)
    check_union_limits(target, len(new), len(longest.name.encode("utf-8")) if longest else 0,
                       lambda: longest.name if longest else "", limits)
    there = query(f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
                  f"WHERE a.name = {mark}", (target,))
    raise AlreadyThere(require_same(archive_from_row(rows[0]), [entry_from_row(r) for r in there], new, metadata,
                                    "in the union"))


__all__ = ["ARCHIVE_COLUMNS", "BLOB_COLUMNS", "ENTRY_COLUMNS", "ENTRY_COPIED", "ENTRY_INSERT", "Query", "archive_from_row",
           "check_union_limits", "compare_union_first", "duplicate_error", "entries_under_query", "entry_from_row",
           "entry_values", "metadata_text"]
