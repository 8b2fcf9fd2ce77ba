"""``tannery scrub`` both ways: the catalog's blobs against their bytes (missing, damaged), and
the blob store's bytes against the catalog (leaks: bytes no catalog row references, older than
the grace period, which ``--repair`` deletes). Either backend: a data directory (SQLite and
files, or a bucket) or a shared PostgreSQL catalog and bucket, beside running replicas."""

from __future__ import annotations

import dataclasses
import time

from . import lost_marks
from .core import StorageBase

NS = 1_000_000_000


@dataclasses.dataclass
class ScrubReport:
    """What a scrub found: each list a sorted list of digests."""

    checked: int
    damaged: list[str]
    missing: list[str]
    leaked: list[str]
    removed: list[str] = dataclasses.field(default_factory=list)
    #: With ``--repair``: the missing blobs marked lost in the catalog (:mod:`.lost_marks`),
    #: and the marks cleared (the bytes are back, or no entry uses the blob any more).
    marked: list[str] = dataclasses.field(default_factory=list)
    cleared: list[str] = dataclasses.field(default_factory=list)

    @property
    def sound(self) -> bool:
        """Nothing damaged, missing or leaked (a leak removed by ``--repair`` still counts: it was found)."""
        return not (self.damaged or self.missing or self.leaked)


def scrub_store(storage: StorageBase, grace_seconds: float, repair: bool = False) -> ScrubReport:
    """Check every referenced blob, then look for leaks older than ``grace_seconds``; with
    ``repair``, delete those leaks (each through :meth:`~.core.StorageBase.remove_leak`, which
    on a shared catalog keeps a concurrent Store of the same bytes safe), mark the missing
    blobs lost in the catalog and clear the marks of blobs no longer missing."""
    referenced = sorted(storage.catalog.referenced_digests())
    faults = {digest: storage.fault(digest) for digest in referenced}
    report = ScrubReport(len(referenced), [d for d, f in faults.items() if f == "damaged"],
                         [d for d, f in faults.items() if f == "missing"],
                         leaks(storage, set(referenced), time.time_ns() - int(grace_seconds * NS)))
    if repair:
        report.removed = [digest for digest in report.leaked if storage.remove_leak(digest)]
        report.marked = lost_marks.mark(storage.catalog, report.missing, time.time_ns())
        report.cleared = lost_marks.clear(storage.catalog, set(lost_marks.marked(storage.catalog)) - set(report.missing))
    return report


def leaks(storage: StorageBase, referenced: set[str], before_ns: int) -> list[str]:
    """The blobs in the blob store that neither an entry nor a blob row of the catalog names,
    last written before ``before_ns`` (a younger one may be a Store under way)."""
    found = []
    for digest in sorted(storage.blobs.digests()):
        if digest in referenced or storage.catalog.blob(digest) is not None:
            continue
        try:
            if storage.blobs.modified_ns(digest) < before_ns:
                found.append(digest)
        except FileNotFoundError:
            continue  # gone meanwhile (collected)
    return found
