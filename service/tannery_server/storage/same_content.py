"""Whether an archive already holds exactly what a Store or Union would make of it.

A Store or Union without ``replace`` to a name that exists is answered OK (nothing stored)
when the archive there has the same entry names, each with the same payload SHA-256 (hence
the same dtype and shape), and the same metadata; otherwise ALREADY_EXISTS names the first
difference, with its numbers. These functions say what that difference is, in the words
the refusal uses; :func:`other_content` makes the refusal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tannery_protocol.codec import format_shape

from .base import ArchiveRecord, EntryRecord
from .errors import ArchiveExists

#: Hex digits of a digest a refusal shows (enough to tell two payloads apart at a glance).
DIGEST_SHOWN = 16


def short(digest: str) -> str:
    """A digest as a refusal shows it: its first :data:`DIGEST_SHOWN` hex digits."""
    return f"{digest[:DIGEST_SHOWN]}..."


def count(n: int, word: str) -> str:
    """``n`` and ``word`` in the plural it needs: "1 entry", "3 entries", "2 keys"."""
    if n == 1:
        return f"1 {word}"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}s"


def other_content(archive: str, difference: str) -> ArchiveExists:
    """The refusal of a Store or Union whose content differs from the archive of that name."""
    return ArchiveExists(f"archive {archive!r} already exists with other content: {difference}")


def metadata_difference(there: Mapping[str, str], sent: Mapping[str, str], side: str = "sent") -> str | None:
    """The first metadata key (by name) whose value differs, or that only one side has; None
    when both are equal. ``side`` names the new content ("sent", "in the union")."""
    if dict(there) == dict(sent):
        return None
    counts = f"{count(len(there), 'key')} there, {len(sent)} {side}"
    for key in sorted(set(there) | set(sent)):
        difference = (one_side_only(f"metadata key {key!r}", key in there, key in sent, counts)
                      or (f"metadata key {key!r} differs ({there[key]!r} there, {sent[key]!r} {side})"
                          if there[key] != sent[key] else None))
        if difference is not None:
            return difference
    raise AssertionError("unequal metadata with no differing key")


def one_side_only(what: str, is_there: bool, is_new: bool, counts: str) -> str | None:
    """``what`` (an entry or a metadata key) when only one side has it, with both sides'
    counts; None when both have it."""
    if not is_there:
        return f"{what} is not there ({counts})"
    if not is_new:
        return f"{what} is missing ({counts})"
    return None


def unknown_entry(name: str, there_count: int, side: str = "sent") -> str:
    """The difference of an entry the archive there does not have."""
    return f"entry {name!r} {side} is not there (it has {count(there_count, 'entry')})"


def header_difference(there: EntryRecord, dtype: str, shape: Sequence[int], side: str = "sent") -> str | None:
    """How an entry's dtype and shape differ from the stored entry's; None when they agree."""
    if there.dtype == dtype and tuple(there.shape) == tuple(shape):
        return None
    return (f"entry {there.name!r} differs ({there.dtype} {format_shape(there.shape)} there, "
            f"{dtype} {format_shape(shape)} {side})")


def digest_difference(there: EntryRecord, digest: str, side: str = "sent") -> str | None:
    """How an entry's payload digest differs from the stored entry's; None when equal."""
    if there.digest == digest:
        return None
    return f"entry {there.name!r} differs (sha256 {short(there.digest)} there, {short(digest)} {side})"


def entries_difference(there: Sequence[EntryRecord], new: Sequence[EntryRecord], side: str = "sent") -> str | None:
    """The first entry (by name) that differs between two archives' entries: one only one side
    has, or another dtype, shape or payload digest; None when they are the same."""
    old = {e.name: e for e in there}
    made = {e.name: e for e in new}
    counts = f"{count(len(old), 'entry')} there, {len(made)} {side}"
    for name in sorted(set(old) | set(made)):
        what = f"entry {name!r}" if name in old else f"entry {name!r} {side}"
        difference = one_side_only(what, name in old, name in made, counts)
        if difference is None:
            entry = made[name]
            difference = (header_difference(old[name], entry.dtype, entry.shape, side)
                          or digest_difference(old[name], entry.digest, side))
        if difference is not None:
            return difference
    return None


def content_difference(there: Sequence[EntryRecord], there_metadata: Mapping[str, str], new: Sequence[EntryRecord],
                       new_metadata: Mapping[str, str], side: str = "sent") -> str | None:
    """The first difference between an archive there and new content (metadata first, then
    the entries by name); None when the archive already holds exactly that content."""
    return metadata_difference(there_metadata, new_metadata, side) or entries_difference(there, new, side)


class AlreadyThere(Exception):
    """Raised in a catalog transaction (rolling it back) when the archive there already holds
    exactly the new content: nothing is to be written. ``record`` is that archive's, with
    ``already_stored`` set."""

    def __init__(self, record: ArchiveRecord) -> None:
        super().__init__(f"archive {record.name!r} already holds this content")
        self.record = record


def require_same(there: ArchiveRecord, there_entries: Sequence[EntryRecord], new: Sequence[EntryRecord],
                 new_metadata: Mapping[str, str] | None, side: str = "sent") -> ArchiveRecord:
    """The archive there, flagged ``already_stored``, when it holds exactly the new content;
    ArchiveExists naming the first difference otherwise."""
    difference = content_difference(there_entries, there.metadata, new, new_metadata or {}, side)
    if difference is not None:
        raise other_content(there.name, difference)
    return dataclasses.replace(there, already_stored=True)


__all__ = ["AlreadyThere", "require_same", "content_difference", "digest_difference", "entries_difference", "header_difference",
           "metadata_difference", "other_content", "short", "unknown_entry"]
