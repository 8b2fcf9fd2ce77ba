"""``tannery migrate``: copy an embedded data directory into a shared catalog and bucket.

Every blob the source's archives reference is read once, hashed as it streams to the
target (its SHA-256 must equal its name: a corrupted file stops the migration, naming
the blob and the entries that use it), and held by a lease until its archive commits, the
same path a Store takes; so replicas already serving the target never collect it midway.
An archive the target already has is skipped when it has the same entries (a migration
run again resumes where it stopped) and reported as a conflict when it differs. A blob the
target already has is not uploaded again. A damaged archive (a blob that does not match its
name) is left out and reported, and the migration goes on with the next one; each archive
keeps its creation time and metadata. Aliases follow the archives, each pointing where it
did (one whose name or target the target store refuses is reported as a conflict), with its
history of moves (``tannery log``; copied once: an alias with a history in the target keeps it).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .storage import BlobInfo, DigestMismatch, EntryRecord, MoveNote, Refusal, Storage
from .storage.shared_storage import SharedStorage

log = logging.getLogger("tannery_server.migrate")
#: Bytes read from a source blob at a time.
READ_BYTES = 8 << 20


class MigrationError(RuntimeError):
    """A blob that does not match its name, or an archive that exists with other entries."""


@dataclass
class Migrated:
    archives: int = 0
    skipped: int = 0
    blobs: int = 0
    reused: int = 0
    bytes: int = 0
    conflicts: list[str] = field(default_factory=list)
    #: The archives left out because of damage, each with what is wrong with it.
    damaged: list[tuple[str, str]] = field(default_factory=list)


def plural(count: int, word: str) -> str:
    """``1 entry``, ``2 entries``, ``1 blob``, ``3 blobs``: a count and its noun, as English says it."""
    if count == 1:
        return f"{count} {word}"
    return f"{count} {word[:-1]}ies" if word.endswith("y") else f"{count} {word}s"


def migrate(source: Storage, target: SharedStorage, progress: Callable[[str], None] = lambda line: None) -> Migrated:
    """Copy every archive of ``source`` into ``target``; see the module's docstring."""
    done = Migrated()
    after = ""
    while True:
        page = source.catalog.list_archives("", after, 500)
        if not page:
            _migrate_aliases(source, target, done, progress)
            return done
        for record in page:
            try:
                _migrate_archive(source, target, record.name, done, progress)
            except MigrationError as exc:  # this archive only: the others are worth copying
                done.damaged.append((record.name, str(exc)))
                progress(f"{record.name}: NOT migrated: {exc}")
        after = page[-1].name


def _migrate_archive(source: Storage, target: SharedStorage, name: str, done: Migrated,
                     progress: Callable[[str], None]) -> None:
    entries = source.catalog.entries_under(name, "")
    if target.catalog.archive(name) is not None:
        if _same(entries, target.catalog.entries_under(name, "")):
            done.skipped += 1
            progress(f"{name}: already there")
        else:
            done.conflicts.append(name)
            progress(f"{name}: CONFLICT, the target has an archive of this name with other entries; left as it is")
        return
    holder = f"migrate-{uuid.uuid4().hex}"
    blobs: dict[str, BlobInfo] = {}
    try:
        for entry in entries:
            if entry.blob not in blobs:  # a pack once, for all its entries
                blobs[entry.blob] = _copy_blob(source, target, name, entry, holder, done)
        record = source.catalog.archive(name)
        target.commit_archive(name, entries, list(blobs.values()), False, holder,
                              record.metadata if record is not None else None,
                              created_ns=record.created_ns if record is not None else None)
    finally:
        target.release(blobs, holder=holder)
    done.archives += 1
    progress(f"{name}: {plural(len(entries), 'entry')} migrated")


def _migrate_aliases(source: Storage, target: SharedStorage, done: Migrated, progress: Callable[[str], None]) -> None:
    """Every alias of ``source`` in ``target``, pointing where it did, with when it last moved and
    its history (the tag that creates it there is no move of its own: the history says how it got there)."""
    for alias in source.catalog.aliases():
        try:
            target.catalog.tag(alias.alias, alias.archive, "", alias.moved_ns, MoveNote(record=False))
            moves = source.catalog.history(alias.alias, 2**31 - 1)
            copied = target.catalog.import_moves(moves[::-1])
            progress(f"alias {alias.alias} -> {alias.archive} migrated ({copied} of its {len(moves)} moves copied)")
        except Refusal as exc:  # a missing target, a name the target uses for an archive
            done.conflicts.append(alias.alias)
            progress(f"alias {alias.alias}: CONFLICT, {exc}; left out")


def _same(ours: list[EntryRecord], theirs: list[EntryRecord]) -> bool:
    """The same entries (names, dtypes, shapes, sizes and payload digests), wherever their bytes
    are stored (a pack in one, a blob of its own in the other)."""
    def content(entries: list[EntryRecord]) -> list[tuple]:
        return sorted((e.name, e.dtype, e.shape, e.nbytes, e.payload_bytes, e.data_offset, e.digest) for e in entries)

    return content(ours) == content(theirs)


def _copy_blob(source: Storage, target: SharedStorage, archive: str, entry: EntryRecord, holder: str,
               done: Migrated) -> BlobInfo:
    """The blob of the entry's payload (its own, or its pack) in the target, leased by ``holder``:
    adopted when the target has it, else streamed from the source and checked against its name."""
    info = source.catalog.blob(entry.blob)
    if info is None:
        raise MigrationError(f"archive {archive!r}, entry {entry.name!r}: blob {entry.blob} has no record "
                             "in the source catalog (run tannery scrub on the source)")
    if target.adopt(info, holder):
        done.reused += 1
        return info
    try:
        blob = source.open_blob(entry.blob, info.size)
    except FileNotFoundError:
        raise MigrationError(f"archive {archive!r}, entry {entry.name!r}: blob {entry.blob} is missing from the "
                             "source (tannery scrub lists what it damaged)") from None
    writer = target.new_payload(entry.blob, info.block_size)  # known ahead: a bucket takes it without a copy
    try:
        offset = 0
        view = memoryview(bytearray(min(READ_BYTES, max(info.size, 1))))  # written whole before the next read
        while offset < info.size:
            got = blob.read_into(view[: min(view.nbytes, info.size - offset)], offset)
            if not got:
                break
            writer.write(view[:got])
            offset += got
    except BaseException:
        writer.temp.discard()
        raise
    finally:
        blob.close()
    try:
        copied = writer.finish()  # DigestMismatch (and discarded) unless it hashes to its name
        if copied.size != info.size:
            writer.temp.discard()
            raise DigestMismatch(f"it reads as {copied.size} bytes")
    except DigestMismatch as exc:
        raise MigrationError(
            f"archive {archive!r}, entry {entry.name!r}: blob {entry.blob} is not what it was stored as "
            f"({info.size} bytes): {exc}: nothing of it was migrated (run tannery scrub on the source, and restore or delete the "
            "archives it names)") from None
    blob_info = target.seal(writer, holder)
    done.blobs += 1
    done.bytes += info.size
    return blob_info

