"""Diff: how one archive differs from another, entry by entry, from the catalog first.

Both archives are looked up once (an alias resolved once each) and their blobs held while the
call reads them. Entries are paired by name: the same payload digest is SAME with no byte read;
an entry on one side only is ADDED or REMOVED; another dtype or shape is TYPE; the rest are
VALUE, their figures read by :func:`~.value_diff.compare_values` (kept files are VALUE without
figures: their bytes are no tensor). Metadata keys whose values differ come with the answer.
"""

from __future__ import annotations

from typing import Callable

from tannery_protocol.kept_files import is_file_entry
from tannery_protocol.names import did_you_mean
from tannery_protocol.v1 import archives_pb2

from .failures import Malformed, Missing
from .fetching import gone_while_read
from .storage import ArchiveRecord, EntryRecord, Storage
from .value_diff import compare_values

Change = archives_pb2.EntryDiff


class _Side:
    """One archive of the diff as looked up: its record and the entries compared."""

    def __init__(self, record: ArchiveRecord, entries: list[EntryRecord]) -> None:
        self.record = record
        self.entries = {e.name: e for e in entries}


def diff_archives(storage: Storage, request: archives_pb2.DiffRequest, check: Callable[[], None]
                  ) -> archives_pb2.DiffResponse:
    """The answer of a Diff; ``check()`` runs between windows of values (it raises to stop).
    Blocking: run it on a worker thread."""
    if request.names and request.prefix:
        raise Malformed(f"Diff of {request.a!r} and {request.b!r}: names ({len(request.names)}) and prefix "
                        f"{request.prefix!r} both narrow the entries: give one of them")
    a, b = storage.pinned(lambda: (_side(storage, request.a, request), _side(storage, request.b, request)),
                          lambda sides: [e.blob for side in sides for e in side.entries.values()])
    try:
        if request.names:
            _check_names(storage, request, a, b)
        return _answer(storage, request, a, b, check)
    finally:
        storage.release([e.blob for side in (a, b) for e in side.entries.values()])


def _side(storage: Storage, name: str, request: archives_pb2.DiffRequest) -> _Side:
    catalog = storage.catalog
    record = catalog.lookup(name)
    if record is None:
        raise Missing(f"Diff: archive {name!r} not found (neither an archive nor an alias)")
    if request.names:
        return _Side(record, list(catalog.entries(record.name, list(request.names)).values()))
    entries = catalog.entries_under(record.name, request.prefix)
    if not entries and record.entries and not request.prefix:
        raise gone_while_read(name, record.name)
    return _Side(record, entries)


def _check_names(storage: Storage, request: archives_pb2.DiffRequest, a: _Side, b: _Side) -> None:
    """Missing for a name asked that neither archive has, with the close names either has."""
    for name in request.names:
        if name not in a.entries and name not in b.entries:
            names = {e.name for side in (a, b) for e in storage.catalog.entries_under(side.record.name, "")}
            raise Missing(f"Diff of {a.record.name!r} and {b.record.name!r}: entry {name!r} is in neither archive"
                          + did_you_mean(name, names))


def _answer(storage: Storage, request: archives_pb2.DiffRequest, a: _Side, b: _Side, check: Callable[[], None]
            ) -> archives_pb2.DiffResponse:
    answer = archives_pb2.DiffResponse(a=a.record.name, b=b.record.name)
    summary = answer.summary
    for name in sorted(a.entries.keys() | b.entries.keys()):
        old, new = a.entries.get(name), b.entries.get(name)
        entry = _entry(name, old, new)
        _count(summary, entry)
        if entry.change == Change.SAME and not request.list_same:
            continue
        if entry.change == Change.VALUE and not entry.file:
            assert old is not None and new is not None
            values, read = compare_values(storage, old, new, check)
            entry.values.CopyFrom(values)
            summary.bytes_read += read
        answer.entries.append(entry)
    answer.metadata.extend(metadata_changes(a.record.metadata, b.record.metadata))
    return answer


def _count(summary: archives_pb2.DiffSummary, entry: archives_pb2.EntryDiff) -> None:
    """Count ``entry`` in the summary: a kept file apart from the tensors."""
    if entry.file:
        if entry.change == Change.SAME:
            summary.files_same += 1
        else:
            summary.files_changed += 1
        return
    field = {Change.SAME: "same", Change.ADDED: "added", Change.REMOVED: "removed", Change.TYPE: "type_changed",
             Change.VALUE: "value_changed"}[entry.change]
    setattr(summary, field, getattr(summary, field) + 1)


def _entry(name: str, old: EntryRecord | None, new: EntryRecord | None) -> archives_pb2.EntryDiff:
    """The entry's diff from the catalog alone (VALUE entries get their figures later)."""
    entry = archives_pb2.EntryDiff(name=name, file=is_file_entry(name))
    if old is not None:
        entry.dtype_a, entry.nbytes_a = old.dtype, old.nbytes
        entry.shape_a.extend(old.shape)
    if new is not None:
        entry.dtype_b, entry.nbytes_b = new.dtype, new.nbytes
        entry.shape_b.extend(new.shape)
    if old is None:
        entry.change = Change.ADDED
    elif new is None:
        entry.change = Change.REMOVED
    elif old.digest == new.digest:
        entry.change = Change.SAME
    elif (old.dtype != new.dtype or old.shape != new.shape) and not entry.file:  # a file of another size changed
        entry.change = Change.TYPE
    else:
        entry.change = Change.VALUE
    return entry


def metadata_changes(a: dict[str, str], b: dict[str, str]) -> list[archives_pb2.MetadataChange]:
    """The keys whose values differ (absent on one side: that side unset), by key."""
    changes = []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            change = archives_pb2.MetadataChange(key=key)
            if key in a:
                change.a = a[key]
            if key in b:
                change.b = b[key]
            changes.append(change)
    return changes


__all__ = ["diff_archives", "metadata_changes"]
