"""The embedded catalog: archives, entries and blob records in one SQLite file, WAL mode.

WAL lets readers go on while a writer commits; every write is one ``BEGIN IMMEDIATE``
transaction on a single writer connection, and each reading thread has its own
connection. ``synchronous=FULL`` makes a commit durable when it returns. The schema is
versioned (:mod:`.sqlite_schema`): a catalog of an older version is migrated
(:data:`MIGRATIONS`) when it is opened, in one transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from . import alias_sql
from .base import AliasMove, AliasPage, AliasRecord, ArchiveLimits, ArchiveRead, MoveNote, ArchiveRecord, BlobInfo, Catalog, CatalogTotals, EntryRecord
from .catalog_sql import (ARCHIVE_COLUMNS, BLOB_COLUMNS, ENTRY_COLUMNS, ENTRY_COPIED, ENTRY_INSERT, archive_from_row,
                          check_union_limits, compare_union_first, duplicate_error, entries_under_query, entry_from_row,
                          entry_values, metadata_text)
from .errors import ArchiveExists, CatalogTooNew, InvalidRequest, NoSuchArchive
from .same_content import AlreadyThere
from .sqlite_schema import MIGRATIONS, SCHEMA_VERSION, migrate

#: Archives being built carry this prefix until their transaction renames them (a user's
#: name never starts with a control character).
_BUILDING = "\x00building:"
_IN_BATCH = 500


class SqliteCatalog(Catalog):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._writer = self._connect()
        try:
            # Statement journals (a Delete's cascade keeps one) in memory, not in a temporary
            # file that a full disk (or a full /tmp) would refuse.
            self._writer.execute("PRAGMA temp_store=MEMORY")
            migrate(self._writer, self.path, MIGRATIONS)  # looked up here: a test may add a step
        except BaseException:
            self._writer.close()  # a catalog that does not open (a full disk) leaves no connection
            raise
        self._write_lock = threading.Lock()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return conn

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    # Reads ------------------------------------------------------------------------------

    def archive(self, name: str) -> ArchiveRecord | None:
        row = self._reader().execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name = ?", (name,)
        ).fetchone()
        return archive_from_row(row) if row else None

    def lookup(self, name: str) -> ArchiveRecord | None:
        row = self._reader().execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE {alias_sql.lookup_sql('?')}", (name, name)
        ).fetchone()
        return archive_from_row(row) if row else None

    def alias(self, name: str) -> AliasRecord | None:
        return alias_sql.alias_of(_query(self._reader()), "?", name)

    def aliases(self, prefix: str = "", archive: str = "", page: AliasPage = AliasPage()) -> list[AliasRecord]:
        return alias_sql.aliases(_query(self._reader()), "?", prefix, archive, page)

    def history(self, alias: str, limit: int) -> list[AliasMove]:
        return alias_sql.history(_query(self._reader()), "?", alias, limit)

    def import_moves(self, moves: Sequence[AliasMove]) -> int:
        with self._transaction() as conn:
            return alias_sql.import_moves(_query(conn), "?", moves)

    def read_archive(self, name: str, names: Sequence[str] | None = None, prefix: str = "", *,
                     entries: bool = True) -> ArchiveRead | None:
        conn = self._reader()
        with _snapshot(conn):
            row = conn.execute(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE {alias_sql.lookup_sql('?')}",
                               (name, name)).fetchone()
            if row is None:
                return None
            record = archive_from_row(row)
            if not entries:
                return ArchiveRead(record, [])
            if names is not None:
                found = _entries_named(conn, record.name, names)
                return ArchiveRead(record, [found[n] for n in sorted(found)])
            return ArchiveRead(record, _entries_under(conn, record.name, prefix))

    def entries(self, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
        conn = self._reader()
        with _snapshot(conn):  # one snapshot for every batch
            return _entries_named(conn, archive, names)

    def entries_under(self, archive: str, prefix: str) -> list[EntryRecord]:
        return _entries_under(self._reader(), archive, prefix)

    def list_archives(self, prefix: str, after: str, limit: int) -> list[ArchiveRecord]:
        rows = self._reader().execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name >= ? AND name > ? "
            f"AND substr(name, 1, 1) != ? ORDER BY name LIMIT ?",
            (prefix, after, _BUILDING[0], limit),
        )
        out = []
        for row in rows:
            if not row[0].startswith(prefix):
                break  # names are sorted: those with the prefix are contiguous
            out.append(archive_from_row(row))
        return out

    def blob(self, digest: str) -> BlobInfo | None:
        row = self._reader().execute(
            f"SELECT {BLOB_COLUMNS} FROM blobs WHERE digest = ?", (digest,)
        ).fetchone()
        return BlobInfo(*row) if row else None

    def blobs(self, digests: Iterable[str]) -> dict[str, BlobInfo]:
        conn = self._reader()
        unique = list(dict.fromkeys(digests))
        found = {}
        for start in range(0, len(unique), _IN_BATCH):
            batch = unique[start : start + _IN_BATCH]
            for row in conn.execute(f"SELECT {BLOB_COLUMNS} FROM blobs WHERE digest IN ({','.join('?' * len(batch))})",
                                    batch):
                found[row[0]] = BlobInfo(*row)
        return found

    def totals(self) -> CatalogTotals:
        conn = self._reader()
        archives, archive_bytes = conn.execute(
            "SELECT count(*), coalesce(sum(payload_bytes), 0) FROM archives WHERE substr(name, 1, 1) != ?",
            (_BUILDING[0],),
        ).fetchone()
        blobs, blob_bytes = conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM blobs").fetchone()
        return CatalogTotals(archives, archive_bytes, blobs, blob_bytes)

    def check(self) -> None:
        """Nothing to ask: the catalog is a file of this host, open while the server runs (the
        blob directory's check finds a disk that went away)."""

    def referenced_digests(self) -> set[str]:
        return {row[0] for row in self._reader().execute("SELECT DISTINCT blob FROM entries")}

    def referrers(self, digest: str) -> list[tuple[str, str]]:
        rows = self._reader().execute(
            "SELECT a.name, e.name FROM entries e JOIN archives a ON a.id = e.archive_id "
            "WHERE e.blob = ? AND substr(a.name, 1, 1) != ? ORDER BY a.name, e.name",
            (digest, _BUILDING[0]),
        )
        return [(archive, entry) for archive, entry in rows]

    def unreferenced(self, digests: Iterable[str]) -> list[BlobInfo]:
        conn = self._reader()
        out = []
        for digest in dict.fromkeys(digests):
            row = conn.execute(
                f"SELECT {BLOB_COLUMNS} FROM blobs b WHERE digest = ? "
                "AND NOT EXISTS (SELECT 1 FROM entries e WHERE e.blob = b.digest)",
                (digest,),
            ).fetchone()
            if row:
                out.append(BlobInfo(*row))
            elif conn.execute("SELECT 1 FROM entries WHERE blob = ? LIMIT 1", (digest,)).fetchone() is None:
                # A blob file no transaction recorded (a store that failed before committing).
                out.append(BlobInfo(digest, 0, 0, b""))
        return out

    # Writes -----------------------------------------------------------------------------

    def _transaction(self):
        return _Transaction(self._writer, self._write_lock)

    def _begin_archive(self, conn: sqlite3.Connection, name: str, replace: bool, created_ns: int,
                       metadata: Mapping[str, str] | None = None) -> int:
        """Check the name is free (or may be replaced) and create the archive under a
        temporary name, so that its sources may include the archive it replaces."""
        alias_sql.refuse_alias_name(_query(conn), "?", name, "archive")
        if not replace and conn.execute("SELECT 1 FROM archives WHERE name = ?", (name,)).fetchone():
            raise ArchiveExists(f"archive {name!r} already exists")
        cursor = conn.execute(
            "INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes, metadata) "
            "VALUES (?, ?, 0, 0, 0, ?)",
            (_BUILDING + name, created_ns, metadata_text(metadata)),
        )
        return int(cursor.lastrowid)

    def _finish_archive(self, conn: sqlite3.Connection, archive_id: int, name: str) -> tuple[ArchiveRecord, list[str]]:
        """Fill in the totals, drop the archive being replaced, and give the new one its name."""
        released = self._drop(conn, name)
        conn.execute(
            "UPDATE archives SET name = ?, (entries, nbytes, payload_bytes) = "
            "(SELECT count(*), coalesce(sum(nbytes), 0), coalesce(sum(payload_bytes), 0) "
            " FROM entries WHERE archive_id = ?) WHERE id = ?",
            (name, archive_id, archive_id),
        )
        row = conn.execute(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE id = ?", (archive_id,)).fetchone()
        return archive_from_row(row), released

    @staticmethod
    def _drop(conn: sqlite3.Connection, name: str) -> list[str]:
        row = conn.execute("SELECT id FROM archives WHERE name = ?", (name,)).fetchone()
        if row is None:
            return []
        released = [r[0] for r in conn.execute("SELECT DISTINCT blob FROM entries WHERE archive_id = ?", row)]
        conn.execute("DELETE FROM archives WHERE id = ?", row)
        return released

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool, created_ns: int,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        with self._transaction() as conn:
            archive_id = self._begin_archive(conn, name, replace, created_ns, metadata)
            conn.executemany(
                f"INSERT OR IGNORE INTO blobs ({BLOB_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                ((b.digest, b.size, b.block_size, b.block_crcs, b.checksum) for b in blobs),
            )
            conn.executemany(
                f"INSERT INTO entries ({ENTRY_INSERT}) VALUES ({', '.join('?' * 10)})",
                (entry_values(archive_id, e) for e in entries),
            )
            return self._finish_archive(conn, archive_id, name)

    def union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        try:
            return self._union(target, sources, replace, created_ns, limits, metadata)
        except AlreadyThere as there:  # rolled back: nothing written
            return there.record, []

    def _union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """The union compared with an archive of that name (unless ``replace``), then built under
        a temporary name, checked, and named."""
        with self._transaction() as conn:
            ids = []
            for archive, _prefix in sources:
                row = conn.execute(f"SELECT id FROM archives WHERE {alias_sql.lookup_sql('?')}",
                                   (archive, archive)).fetchone()
                if row is None:
                    raise NoSuchArchive(f"archive {archive!r} not found (a source of the union)")
                ids.append(row[0])
            if not replace:  # an existing target is compared with what the union would be, before it is built
                compare_union_first(lambda sql, args: conn.execute(sql, args).fetchall(), "?", target,
                                    [(source_id, prefix) for source_id, (_a, prefix) in zip(ids, sources)], metadata,
                                    limits)
            # Past the comparison, an archive there is replaced, or the sources give a name twice (raised below).
            archive_id = self._begin_archive(conn, target, True, created_ns, metadata)
            for index, ((archive, prefix), source_id) in enumerate(zip(sources, ids)):
                try:
                    conn.execute(
                        f"INSERT INTO entries ({ENTRY_INSERT}) SELECT ?2, "
                        f"CASE WHEN ?1 = '' THEN name ELSE ?1 || '.' || name END, {ENTRY_COPIED} "
                        "FROM entries WHERE archive_id = ?3",
                        (prefix, archive_id, source_id),
                    )
                except sqlite3.IntegrityError:
                    raise self._duplicate(conn, archive_id, sources[: index + 1], ids) from None
            count, longest = conn.execute(
                "SELECT count(*), coalesce(max(length(CAST(name AS BLOB))), 0) FROM entries WHERE archive_id = ?",
                (archive_id,),
            ).fetchone()
            check_union_limits(target, count, longest, lambda: conn.execute(
                "SELECT name FROM entries WHERE archive_id = ? ORDER BY length(CAST(name AS BLOB)) DESC LIMIT 1",
                (archive_id,),
            ).fetchone()[0], limits)
            return self._finish_archive(conn, archive_id, target)

    @staticmethod
    def _duplicate(conn, archive_id: int, sources: Sequence[tuple[str, str]], ids: Sequence[int]) -> InvalidRequest:
        """The error for the last source, which holds a name an earlier one already gave."""
        prefix = sources[-1][1]
        row = conn.execute(
            "SELECT t.name FROM entries s JOIN entries t ON t.archive_id = ?1 AND "
            "t.name = (CASE WHEN ?2 = '' THEN s.name ELSE ?2 || '.' || s.name END) "
            "WHERE s.archive_id = ?3 ORDER BY t.name LIMIT 1",
            (archive_id, prefix, ids[len(sources) - 1]),
        ).fetchone()
        return duplicate_error(row[0] if row else "?", sources, ids, lambda other_id, inner: conn.execute(
            "SELECT 1 FROM entries WHERE archive_id = ? AND name = ?", (other_id, inner)).fetchone() is not None)

    def delete_archive(self, name: str, force: bool = False, note: MoveNote = MoveNote()
                       ) -> tuple[ArchiveRecord | None, list[str]]:
        with self._transaction() as conn:
            row = conn.execute(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name = ?", (name,)).fetchone()
            if row is None:
                return None, []
            untagged = alias_sql.release_target(_query(conn), "?", name, force, time.time_ns(), note)
            return dataclasses.replace(archive_from_row(row), untagged=untagged), self._drop(conn, name)

    def tag(self, alias: str, archive: str, expect: str | None, now_ns: int, note: MoveNote = MoveNote()
            ) -> AliasRecord:
        with self._transaction() as conn:
            return alias_sql.tag(_query(conn), "?", alias, archive, expect, now_ns, note)

    def untag(self, alias: str, now_ns: int = 0, note: MoveNote = MoveNote()) -> AliasRecord | None:
        with self._transaction() as conn:
            return alias_sql.untag(_query(conn), "?", alias, now_ns or time.time_ns(), note)

    def forget_blobs(self, digests: Iterable[str]) -> None:
        with self._transaction() as conn:
            conn.executemany(
                "DELETE FROM blobs WHERE digest = ? AND NOT EXISTS (SELECT 1 FROM entries WHERE blob = ?)",
                ((d, d) for d in digests),
            )

    def forget_unreferenced_blobs(self) -> int:
        with self._transaction() as conn:
            cursor = conn.execute(
                "DELETE FROM blobs WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.blob = blobs.digest)"
            )
            conn.execute("DELETE FROM archives WHERE substr(name, 1, 1) = ?", (_BUILDING[0],))
            return cursor.rowcount

    def close(self) -> None:
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
        with self._write_lock:
            self._writer.close()


@contextlib.contextmanager
def _snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction on a reader connection: every read inside sees one snapshot (WAL
    takes it at the first read), whatever a writer commits meanwhile."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


def _entries_named(conn: sqlite3.Connection, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
    """The entries of these names that ``archive`` holds, asked in batches (in the caller's transaction)."""
    found: dict[str, EntryRecord] = {}
    unique = list(dict.fromkeys(names))
    for start in range(0, len(unique), _IN_BATCH):
        batch = unique[start : start + _IN_BATCH]
        rows = conn.execute(
            f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
            f"WHERE a.name = ? AND e.name IN ({','.join('?' * len(batch))})",
            (archive, *batch),
        )
        for row in rows:
            found[row[0]] = entry_from_row(row)
    return found


def _entries_under(conn: sqlite3.Connection, archive: str, prefix: str) -> list[EntryRecord]:
    query, args = entries_under_query("?", prefix)
    return [entry_from_row(row) for row in conn.execute(query, (archive, *args))]


def _query(conn: sqlite3.Connection) -> alias_sql.Query:
    """Statements on ``conn`` as :mod:`.alias_sql` runs them: each returns its rows."""
    return lambda sql, args: conn.execute(sql, args).fetchall()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` on the writer connection, rolled back on any error."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self._conn = conn
        self._lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._conn

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._conn.execute("COMMIT")
            else:
                self._rollback()
        except BaseException:
            self._rollback()
            raise
        finally:
            self._lock.release()

    def _rollback(self) -> None:
        """Roll back what is left of the transaction; SQLite already rolled it back after some
        errors (SQLITE_FULL among them), and an error here must not hide the one that failed."""
        if self._conn.in_transaction:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass


__all__ = ["CatalogTooNew", "MIGRATIONS", "SCHEMA_VERSION", "SqliteCatalog"]
