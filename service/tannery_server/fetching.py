"""Fetch plans: every ask checked against the catalog before a byte is read.

Checking (:func:`check_request`, :func:`plan_entry`, :func:`resolve`) reads the catalog only
and raises the archive issue's messages. A :class:`Plan` says which bytes of an entry's blob
to serve, changed how; the data plane (:mod:`.dataplane`) serves it, on any transport,
from blocks each checked as it is read (:mod:`.dataplane.blocks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from tannery_protocol import mismatches
from tannery_protocol.codec import DTYPES, DType, encode_prefix
from tannery_protocol.v1 import archives_pb2

from .failures import Malformed, Mismatch, Missing, Replaced
from .storage import ArchiveRecord, BlobInfo, EntryRecord, Storage


@dataclass(frozen=True)
class Plan:
    """How to serve one entry: which bytes of its blob, changed how, checked how."""

    entry: EntryRecord
    #: Header, metadata and shape to send first; None to send the stored payload as it is.
    prefix: bytes | None
    #: The stored bytes [start, stop) to send after the prefix.
    start: int
    stop: int
    #: Convert elements from ``source`` to ``target`` (None: send bytes as stored).
    source: DType
    target: DType | None = None
    #: For bool rows: bits to drop at the start of the range and bits to send.
    skip_bits: int = 0
    send_bits: int = 0
    #: The record (block checksums) of the blob the bytes are in, when the plan looked it up (a
    #: row range's, a pack's); None: the reader looks it up.
    blob: BlobInfo | None = None
    #: The archive the entry was read from (errors name it); empty when not known.
    archive: str = ""
    #: That archive's version (:attr:`~.storage.ArchiveRecord.version`): what a Fetch's initial
    #: metadata names, so that a resumed Fetch asks for the rest of this version only.
    version: str = ""


def _dtype_asked(what: str, name: str, field: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise Malformed(f"{what}: unknown dtype {name!r} in {field}; known: {', '.join(DTYPES)}") from None


#: The longest ``FetchRequest.version`` taken: a version this server gives is a number of ns.
MAX_VERSION_CHARS = 32


def check_request(request: archives_pb2.FetchRequest) -> None:
    """Request-level errors, found before the catalog is read."""
    version = request.version
    if version and (len(version) > MAX_VERSION_CHARS or not version.isascii() or not version.isdigit()):
        shown = repr(version[:MAX_VERSION_CHARS]) + ("..." if len(version) > MAX_VERSION_CHARS else "")
        raise Malformed(f"Fetch of {request.archive!r}: version {shown} is not one this server gives (the digits "
                        "its initial metadata tannery-archive-version named): send that, or leave it empty")
    for ask in request.entries:
        what = "Archive.float" if ask.cast else "Archive.tensor"
        if not ask.name:
            raise Malformed(f"{what}: an ask with an empty entry name")
        if ask.dtype:
            _dtype_asked(what, ask.dtype, "dtype")
        if ask.cast:
            target = _dtype_asked(what, ask.cast, "cast")
            if not target.is_float:
                raise Malformed(f"Archive.float: {ask.cast} is not {mismatches.FLOATS_TEXT}")
        if ask.HasField("rows") and ask.rows.start > ask.rows.stop:
            raise Malformed(
                f"{what}: {ask.name}: rows [{ask.rows.start}, {ask.rows.stop}): start is after stop"
            )


def plan_entry(ask: archives_pb2.EntryAsk, entry: EntryRecord | None, blob: BlobInfo | None = None) -> Plan:
    """Check one ask against its catalog entry; Mismatch or Missing with the archive issue's message."""
    what = "Archive.float" if ask.cast else "Archive.tensor"
    if entry is None:
        raise Missing(mismatches.no_entry(what, ask.name))
    shape = entry.shape
    stored = DTYPES[entry.dtype]
    if ask.HasField("shape") and tuple(ask.shape.dims) != shape:
        raise Mismatch(mismatches.shape_differs(what, entry.name, shape, ask.shape.dims))
    if ask.dtype and ask.dtype != entry.dtype:
        raise Mismatch(mismatches.dtype_differs(what, entry.name, entry.dtype, ask.dtype))
    target = None
    if ask.cast:
        if not stored.is_float:
            raise Mismatch(mismatches.not_float("Archive.float", entry.name, entry.dtype))
        if ask.cast != entry.dtype:
            target = DTYPES[ask.cast]
    out_dtype = target or stored
    if not ask.HasField("rows"):
        if target is None:
            return Plan(entry, None, 0, entry.payload_bytes, stored, blob=blob)
        return Plan(entry, encode_prefix(target, shape), entry.data_offset, entry.payload_bytes, stored, target,
                    blob=blob)

    start, stop = ask.rows.start, ask.rows.stop
    if not shape:
        raise Mismatch(mismatches.rows_of_scalar(what, entry.name, start, stop))
    if stop > shape[0]:
        raise Mismatch(mismatches.rows_past_end(what, entry.name, start, stop, shape))
    assert blob is not None, "row ranges need the blob's block checksums"
    row_elements = math.prod(shape[1:])
    prefix = encode_prefix(out_dtype, (stop - start, *shape[1:]))
    if stored.is_bool:
        first_bit, last_bit = start * row_elements, stop * row_elements
        return Plan(
            entry, prefix, entry.data_offset + first_bit // 8, entry.data_offset + (last_bit + 7) // 8, stored,
            skip_bits=first_bit % 8, send_bits=last_bit - first_bit, blob=blob,
        )
    row_bytes = row_elements * stored.itemsize
    return Plan(
        entry, prefix, entry.data_offset + start * row_bytes, entry.data_offset + stop * row_bytes, stored, target,
        blob=blob,
    )


def resolve(storage: Storage, request: archives_pb2.FetchRequest) -> list[Plan]:
    """The plans of a request, their blobs pinned (release ``digests(plans)`` afterwards).

    Missing for a missing archive or entry, Mismatch for an entry that is not what is asked.
    An alias is resolved once, here: every entry is read from the archive it named then.
    """
    catalog = storage.catalog

    def lookup() -> list[Plan]:
        # One snapshot: the record and the entries are of one version, whatever replaces it meanwhile.
        read = catalog.read_archive(request.archive, [ask.name for ask in request.entries] if request.entries
                                    else None, request.prefix)
        if read is None:
            raise Missing(f"archive {request.archive!r} not found" + (
                " (deleted since this Fetch began: the rest of its entries is gone)" if request.version else ""))
        record = read.record
        archive, version = record.name, record.version
        check_version(request, record)
        if not request.entries:
            entries = read.entries
            if request.prefix and not entries:
                raise Missing(f"archive {request.archive!r}: no entry under prefix {request.prefix!r}")
            blobs = _packs(catalog, entries)
            return [Plan(e, None, 0, e.payload_bytes, DTYPES[e.dtype], blob=blobs.get(e.blob), archive=archive,
                         version=version) for e in entries]
        found = {e.name: e for e in read.entries}
        blobs = _packs(catalog, found.values())
        plans = []
        for ask in request.entries:
            entry = found.get(ask.name)
            blob = None
            if entry is not None:
                blob = blobs.get(entry.blob) or (catalog.blob(entry.blob) if ask.HasField("rows") else None)
            plans.append(replace(plan_entry(ask, entry, blob), archive=archive, version=version))
        return plans

    return storage.pinned(lookup, digests)


def check_version(request: archives_pb2.FetchRequest, record: ArchiveRecord) -> None:
    """Replaced unless the request names no version or the one ``record`` is: a resumed Fetch
    takes the rest of its entries from the version it began on, or fails (never a mix)."""
    if request.version and request.version != record.version:
        named = f"archive {request.archive!r}" + ("" if record.name == request.archive else f" ({record.name!r} now)")
        raise Replaced(f"{named} was replaced since this Fetch began (version {request.version}, now "
                       f"{record.version}): the rest of its entries is not sent, which would mix two versions; "
                       "fetch again")


def fetch_version(plans: Sequence[Plan]) -> str:
    """The version of the archive a Fetch's plans read (empty for no plans)."""
    return plans[0].version if plans else ""


def gone_while_read(asked: str, archive: str) -> Missing:
    """An archive found, then without its entries a moment later: deleted (or replaced) between
    the two reads of the catalog; never an empty answer for an archive that had entries."""
    named = f"archive {asked!r}" if asked == archive else f"archive {archive!r} (what {asked!r} named)"
    return Missing(f"{named} was deleted while this call read it: ask again")


def _packs(catalog, entries: Iterable[EntryRecord]) -> dict[str, BlobInfo]:
    """The records of the packs these entries live in, asked once for all (a Fetch of many
    small entries would otherwise ask once per entry)."""
    return catalog.blobs({e.blob for e in entries if e.packed})


def digests(plans: Iterable[Plan]) -> list[str]:
    """The blobs the plans read (what their Fetch pins)."""
    return [p.entry.blob for p in plans]
