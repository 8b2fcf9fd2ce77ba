"""Marks of lost blobs, for SQLite and PostgreSQL catalogs alike: ``tannery scrub --repair``
records each referenced blob whose bytes are gone from the blob store (table ``lost_blobs``:
digest, when found) and clears the mark of one whose bytes are back (restored from a backup)
or that no entry uses any more. Describe reads them to name an archive's lost entries, so
people see the loss before they fetch.

The marks are a finding of scrub, not data: ``tannery migrate`` does not copy them; a scrub
with ``--repair`` of the copy records them again.

A catalog of another kind (none today) keeps no marks: every read answers none."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

#: Runs ``work(query, mark)`` in one transaction of the catalog (``query(sql, args)`` answers
#: the rows; ``mark`` is the placeholder, ``?`` or ``%s``).
Work = Callable[[Callable[[str, tuple], Sequence[tuple]], str], Any]


def _run(catalog: Any, what: str, work: Work, write: bool) -> Any:
    writer = getattr(catalog, "_writer", None)
    if writer is not None and hasattr(catalog, "_write_lock"):  # SqliteCatalog
        from .sqlite_catalog import _Transaction

        if write:
            with _Transaction(writer, catalog._write_lock) as conn:
                return work(lambda sql, args: conn.execute(sql, args).fetchall(), "?")
        conn = catalog._reader()
        return work(lambda sql, args: conn.execute(sql, args).fetchall(), "?")
    db = getattr(catalog, "_db", None)
    if db is not None and hasattr(db, "write"):  # PostgresCatalog

        def run(cur):
            def query(sql: str, args: tuple) -> Sequence[tuple]:
                cur.execute(sql, args)
                return cur.fetchall() if cur.description is not None else []

            return work(query, "%s")

        return (db.write if write else db.read)(what, run)
    return None


def mark(catalog: Any, digests: Iterable[str], now_ns: int) -> list[str]:
    """Mark these blobs lost (found at ``now_ns``); the ones already marked keep their time.
    Answers the digests marked now or before (all of them on a catalog that keeps marks)."""
    digests = sorted(set(digests))
    if not digests:
        return []

    def work(query, m):
        for digest in digests:
            query(f"INSERT INTO lost_blobs (digest, found_ns) VALUES ({m}, {m}) ON CONFLICT (digest) DO NOTHING",
                  (digest, now_ns))
        return digests

    return _run(catalog, f"marking {len(digests)} blobs lost", work, True) or []


def clear(catalog: Any, digests: Iterable[str]) -> list[str]:
    """Remove the marks of these blobs; answers those that had one."""
    digests = sorted(set(digests))
    if not digests:
        return []

    def work(query, m):
        cleared = []
        for digest in digests:
            if query(f"SELECT digest FROM lost_blobs WHERE digest = {m}", (digest,)):
                query(f"DELETE FROM lost_blobs WHERE digest = {m}", (digest,))
                cleared.append(digest)
        return cleared

    return _run(catalog, f"clearing {len(digests)} lost-blob marks", work, True) or []


def marked(catalog: Any) -> dict[str, int]:
    """Every marked blob: digest to when scrub found it gone (ns)."""
    rows = _run(catalog, "reading lost-blob marks",
                lambda query, m: query("SELECT digest, found_ns FROM lost_blobs", ()), False)
    return {digest: found_ns for digest, found_ns in rows or ()}


def lost_entries(catalog: Any, archive: str) -> list[str]:
    """The entries of ``archive`` (its own name) whose blob is marked lost, sorted by name."""
    rows = _run(catalog, f"reading the lost entries of {archive!r}", lambda query, m: query(
        "SELECT e.name FROM entries e JOIN archives a ON a.id = e.archive_id "
        f"JOIN lost_blobs l ON l.digest = e.blob WHERE a.name = {m} ORDER BY e.name", (archive,)), False)
    return [row[0] for row in rows or ()]


__all__ = ["clear", "lost_entries", "mark", "marked"]
