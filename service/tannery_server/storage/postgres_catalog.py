"""The shared catalog: archives, entries, blobs and blob leases in PostgreSQL, for several
server replicas at once (issue 15, "scale out").

It behaves as :class:`~.sqlite_catalog.SqliteCatalog` does (same errors, same order, same
union rules) and adds what replicas need to collect blobs safely (:class:`~.base.SharedCatalog`).

How writers stay apart:

* every write is one transaction (``READ COMMITTED``) on a connection of a
  ``psycopg_pool.ConnectionPool``;
* a write that creates, replaces or deletes an archive first takes the transaction-scoped
  advisory lock of its name (``pg_advisory_xact_lock(hashtextextended(name, 0))``): two
  replicas committing one name run one after the other, so exactly one creates it (the other
  gets ArchiveExists) or, with ``replace``, the archive of the last one is the whole archive;
* an archive being built has no name (NULL) until its transaction renames it, so it may be
  made from the archive it replaces; the UNIQUE constraint on names backs the lock up;
* a union's sources are locked ``FOR SHARE`` so none is deleted or replaced under it;
* blob rows are the unit of collection: a lease, a commit of leased blobs and the claim of
  :meth:`PostgresCatalog.collect_blob` each hold the rows they decide on (lease and claim
  ``FOR UPDATE``, a commit ``FOR SHARE``), always blob rows before lease rows, so a lease and a
  collection of one blob are ordered: the lease comes first (no claim), or it waits for the
  claim to end: the row gone (the lease creates it again and its caller uploads the bytes
  again) or back (the delete failed). The bucket's delete runs outside any transaction.

Statements run on :class:`~.postgres_pool.PostgresPool` (which retries what is safe to run
again and raises every driver error as :class:`~.errors.StorageUnavailable` naming the
catalog); the schema and its migrations are :mod:`.postgres_schema`'s.

Times (``touched_ns``, lease expiry) are ``time.time_ns()`` of the replicas: their clocks must
agree to well within the collection's grace period.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Mapping, Sequence

from . import alias_sql
from .base import AliasMove, AliasPage, AliasRecord, ArchiveLimits, ArchiveRead, MoveNote, ArchiveRecord, BlobInfo, CatalogTotals, EntryRecord, SharedCatalog
from .catalog_sql import (ARCHIVE_COLUMNS, BLOB_COLUMNS, ENTRY_COLUMNS, ENTRY_COPIED, ENTRY_INSERT, archive_from_row,
                          check_union_limits, compare_union_first, duplicate_error, entries_under_query, entry_from_row,
                          entry_values, metadata_text)
from .errors import ArchiveExists, InvalidRequest, NoSuchArchive, StorageUnavailable
from .postgres_pool import Cursor, PostgresPool, UniqueViolation, safe_name
from .postgres_schema import MIGRATIONS, SCHEMA_VERSION, migrate
from .same_content import AlreadyThere

#: ``%(p)s`` (a prefix) before an entry name, with the dot, as :func:`tannery_protocol.names.join` does.
_PREFIXED = "CASE WHEN %(p)s = '' THEN {0} ELSE %(p)s || '.' || {0} END"
#: How long a collection's claim on a blob row lasts: longer than the bucket client can take
#: over one delete (connect and read timeouts, three attempts), so a delete is never in flight
#: after its claim ended.
CLAIM_SECONDS = 300.0
#: How often a lease looks again at a blob row a collection has claimed.
CLAIM_POLL_SECONDS = 0.05
_UNREFERENCED = "NOT EXISTS (SELECT 1 FROM entries e WHERE e.blob = b.digest)"


class PostgresCatalog(SharedCatalog):
    """:class:`~.base.Catalog` and :class:`~.base.SharedCatalog` on PostgreSQL.

    ``url``: a libpq URL or DSN. ``min_size``/``max_size``: the pool's connections.
    ``timeout``: seconds a call waits for a connection before it fails (PostgreSQL down:
    StorageUnavailable after that long); a broken connection is replaced in the background,
    so the catalog recovers by itself once PostgreSQL is back. Opening creates or migrates
    the schema (CatalogTooNew for a newer one).
    """

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 8, timeout: float = 5.0) -> None:
        self.url = url
        self.name = safe_name(url)
        self.timeout = timeout
        # The name lock makes a second archive of one name unlikely; the constraint backs it up.
        self._db = PostgresPool(url, min_size=min_size, max_size=max_size, timeout=timeout, constraints={
            "archives_name": lambda what: ArchiveExists(f"archive already exists ({what})")})
        try:
            self._db.write("creating or migrating the schema", lambda cur: migrate(cur, self.name))
        except BaseException:
            self._db.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresCatalog({self.name!r})"

    # Reads ------------------------------------------------------------------------------

    def archive(self, name: str) -> ArchiveRecord | None:
        row = self._db.read(f"reading archive {name!r}", lambda cur: cur.execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name = %s", (name,)).fetchone())
        return archive_from_row(row) if row else None

    def lookup(self, name: str) -> ArchiveRecord | None:
        row = self._db.read(f"looking up {name!r}", lambda cur: cur.execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE {alias_sql.lookup_sql('%s')}", (name, name)).fetchone())
        return archive_from_row(row) if row else None

    def alias(self, name: str) -> AliasRecord | None:
        return self._db.read(f"reading alias {name!r}", lambda cur: alias_sql.alias_of(_query(cur), "%s", name))

    def aliases(self, prefix: str = "", archive: str = "", page: AliasPage = AliasPage()) -> list[AliasRecord]:
        return self._db.read("listing aliases", lambda cur: alias_sql.aliases(_query(cur), "%s", prefix, archive, page))

    def history(self, alias: str, limit: int) -> list[AliasMove]:
        return self._db.read(f"reading the history of alias {alias!r}",
                             lambda cur: alias_sql.history(_query(cur), "%s", alias, limit))

    def import_moves(self, moves: Sequence[AliasMove]) -> int:
        def work(cur: Cursor) -> int:
            for name in sorted({move.alias for move in moves}):
                self._lock_name(cur, name)
            return alias_sql.import_moves(_query(cur), "%s", moves)

        return self._db.write(f"copying the history of {len({m.alias for m in moves})} aliases", work)

    def tag(self, alias: str, archive: str, expect: str | None, now_ns: int, note: MoveNote = MoveNote()
            ) -> AliasRecord:
        def work(cur: Cursor) -> AliasRecord:
            for name in sorted({alias, archive}):  # the alias's writes, and the target's (no Delete meanwhile)
                self._lock_name(cur, name)
            return alias_sql.tag(_query(cur), "%s", alias, archive, expect, now_ns, note)

        return self._db.write(f"tagging {archive!r} as {alias!r}", work)

    def untag(self, alias: str, now_ns: int = 0, note: MoveNote = MoveNote()) -> AliasRecord | None:
        def work(cur: Cursor) -> AliasRecord | None:
            self._lock_name(cur, alias)
            return alias_sql.untag(_query(cur), "%s", alias, now_ns or time.time_ns(), note)

        return self._db.write(f"removing alias {alias!r}", work)

    def read_archive(self, name: str, names: Sequence[str] | None = None, prefix: str = "", *,
                     entries: bool = True) -> ArchiveRead | None:
        """In one ``REPEATABLE READ`` transaction: every statement sees one snapshot (under the
        pool's default, ``READ COMMITTED``, each statement would take its own)."""
        def work(cur: Cursor) -> ArchiveRead | None:
            with cur.connection.transaction():
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                row = cur.execute(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE {alias_sql.lookup_sql('%s')}",
                                  (name, name)).fetchone()
                if row is None:
                    return None
                record = archive_from_row(row)
                if not entries:
                    return ArchiveRead(record, [])
                if names is not None:
                    rows = cur.execute(
                        f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
                        "WHERE a.name = %s AND e.name = ANY(%s)", (record.name, list(dict.fromkeys(names)))).fetchall()
                    rows.sort(key=lambda r: r[0])  # by name as Python sorts it (the column's collation aside)
                else:
                    query, args = entries_under_query("%s", prefix)
                    rows = cur.execute(query, (record.name, *args)).fetchall()
                return ArchiveRead(record, [entry_from_row(r) for r in rows])

        return self._db.read(f"reading archive {name!r} and its entries", work)

    def entries(self, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
        rows = self._db.read(f"reading entries of {archive!r}", lambda cur: cur.execute(
            f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
            "WHERE a.name = %s AND e.name = ANY(%s)", (archive, list(dict.fromkeys(names)))).fetchall())
        return {row[0]: entry_from_row(row) for row in rows}

    def entries_under(self, archive: str, prefix: str) -> list[EntryRecord]:
        query, args = entries_under_query("%s", prefix)
        rows = self._db.read(f"reading entries of {archive!r}",
                             lambda cur: cur.execute(query, (archive, *args)).fetchall())
        return [entry_from_row(row) for row in rows]

    def list_archives(self, prefix: str, after: str, limit: int) -> list[ArchiveRecord]:
        rows = self._db.read("listing archives", lambda cur: cur.execute(
            f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name >= %s AND name > %s AND starts_with(name, %s) "
            "ORDER BY name LIMIT %s", (prefix, after, prefix, limit)).fetchall())
        return [archive_from_row(row) for row in rows]

    def blob(self, digest: str) -> BlobInfo | None:
        row = self._db.read(f"reading blob {digest}", lambda cur: cur.execute(
            f"SELECT {BLOB_COLUMNS} FROM blobs WHERE digest = %s", (digest,)).fetchone())
        return BlobInfo(*row) if row else None

    def blobs(self, digests: Iterable[str]) -> dict[str, BlobInfo]:
        rows = self._db.read("reading blobs", lambda cur: cur.execute(
            f"SELECT {BLOB_COLUMNS} FROM blobs WHERE digest = ANY(%s)", (list(dict.fromkeys(digests)),)).fetchall())
        return {row[0]: BlobInfo(*row) for row in rows}

    def totals(self) -> CatalogTotals:
        def work(cur: Cursor) -> CatalogTotals:
            with cur.connection.transaction():  # one snapshot for both counts
                archives, archive_bytes = cur.execute(
                    "SELECT count(*), coalesce(sum(payload_bytes), 0) FROM archives WHERE name IS NOT NULL"
                ).fetchone()
                blobs, blob_bytes = cur.execute("SELECT count(*), coalesce(sum(size), 0) FROM blobs").fetchone()
            return CatalogTotals(archives, int(archive_bytes), blobs, int(blob_bytes))

        return self._db.read("counting archives and blobs", work)

    def referenced_digests(self) -> set[str]:
        rows = self._db.read("reading referenced digests",
                          lambda cur: cur.execute("SELECT DISTINCT blob FROM entries").fetchall())
        return {row[0] for row in rows}

    def referrers(self, digest: str) -> list[tuple[str, str]]:
        rows = self._db.read(f"reading the referrers of blob {digest}", lambda cur: cur.execute(
            "SELECT a.name, e.name FROM entries e JOIN archives a ON a.id = e.archive_id "
            "WHERE e.blob = %s AND a.name IS NOT NULL ORDER BY a.name, e.name", (digest,)).fetchall())
        return [(archive, entry) for archive, entry in rows]

    def unreferenced(self, digests: Iterable[str]) -> list[BlobInfo]:
        """As SQLite's: a digest neither recorded nor referenced (bytes that no transaction
        recorded) comes back as an empty BlobInfo."""
        rows = self._db.read("finding unreferenced blobs", lambda cur: cur.execute(
            "SELECT u.d, b.size, b.block_size, b.block_crcs, b.checksum, b.digest IS NOT NULL "
            "FROM unnest(%s::text[]) WITH ORDINALITY AS u(d, i) LEFT JOIN blobs b ON b.digest = u.d "
            "WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.blob = u.d) ORDER BY u.i",
            (list(dict.fromkeys(digests)),)).fetchall())
        return [BlobInfo(*row[:5]) if row[5] else BlobInfo(row[0], 0, 0, b"") for row in rows]

    def collectable(self, touched_before_ns: int, now_ns: int, limit: int, skip: Iterable[str] = ()) -> list[str]:
        rows = self._db.read("finding collectable blobs", lambda cur: cur.execute(
            f"SELECT digest FROM blobs b WHERE touched_ns < %s AND {_UNREFERENCED} AND NOT EXISTS "
            "(SELECT 1 FROM leases l WHERE l.digest = b.digest AND l.expires_ns > %s) "
            "AND collecting_until_ns <= %s AND digest <> ALL(%s::text[]) ORDER BY touched_ns LIMIT %s",
            (touched_before_ns, now_ns, time.time_ns(), list(skip), limit)).fetchall())
        return [row[0] for row in rows]

    def check(self) -> None:
        """``SELECT 1`` within about two seconds (health checks)."""
        limit = min(self.timeout, 2.0)

        def work(cur: Cursor) -> None:
            with cur.connection.transaction():
                cur.execute("SELECT set_config('statement_timeout', %s, true)", (f"{round(limit * 1000)}ms",))
                cur.execute("SELECT 1").fetchone()

        self._db.run("checking the catalog", work, write=False, timeout=limit)

    # Archive writes ---------------------------------------------------------------------

    @staticmethod
    def _lock_name(cur: Cursor, name: str) -> None:
        """Serialize the writes of one archive name (until this transaction ends)."""
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (name,))

    @staticmethod
    def _begin_archive(cur: Cursor, name: str, replace: bool, created_ns: int,
                       metadata: Mapping[str, str] | None = None) -> int:
        """ArchiveExists unless the name is free or may be replaced; the new archive, nameless."""
        alias_sql.refuse_alias_name(_query(cur), "%s", name, "archive")
        if not replace and cur.execute("SELECT 1 FROM archives WHERE name = %s", (name,)).fetchone():
            raise ArchiveExists(f"archive {name!r} already exists")
        return cur.execute(
            "INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes, metadata) "
            "VALUES (NULL, %s, 0, 0, 0, %s) RETURNING id", (created_ns, metadata_text(metadata))).fetchone()[0]

    def _finish_archive(self, cur: Cursor, archive_id: int, name: str,
                        now_ns: int) -> tuple[ArchiveRecord, list[str]]:
        """Drop the archive being replaced, give the new one its name and totals, and touch the
        blobs that lost their last reference (their grace period starts)."""
        released = self._drop(cur, name)
        row = cur.execute(
            "UPDATE archives SET name = %(name)s, (entries, nbytes, payload_bytes) = "
            "(SELECT count(*), coalesce(sum(nbytes), 0), coalesce(sum(payload_bytes), 0) "
            " FROM entries WHERE archive_id = %(id)s) "
            f"WHERE id = %(id)s RETURNING {ARCHIVE_COLUMNS}", {"name": name, "id": archive_id}).fetchone()
        self._touch_unreferenced(cur, released, now_ns)
        return archive_from_row(row), released

    @staticmethod
    def _drop(cur: Cursor, name: str) -> list[str]:
        """Delete archive ``name`` if it exists; the digests it referenced."""
        row = cur.execute("SELECT id FROM archives WHERE name = %s", (name,)).fetchone()
        if row is None:
            return []
        released = [r[0] for r in cur.execute(
            "SELECT DISTINCT blob FROM entries WHERE archive_id = %s ORDER BY blob", row).fetchall()]
        cur.execute("DELETE FROM archives WHERE id = %s", row)
        return released

    @staticmethod
    def _touch_unreferenced(cur: Cursor, digests: Sequence[str], now_ns: int) -> None:
        if digests:
            cur.execute(f"UPDATE blobs b SET touched_ns = %s WHERE digest = ANY(%s) AND {_UNREFERENCED}",
                        (now_ns, list(digests)))

    @staticmethod
    def _insert_entries(cur: Cursor, archive_id: int, entries: Sequence[EntryRecord]) -> None:
        with cur.copy(f"COPY entries ({ENTRY_INSERT}) FROM STDIN") as copy:
            for entry in entries:
                copy.write_row(entry_values(archive_id, entry))

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool, created_ns: int,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """For one process that owns the blob store (and ``tannery migrate``): the blob rows are
        upserted (touched) here; replicas use :meth:`lease` and :meth:`commit_leased`."""
        def work(cur: Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, name)
            archive_id = self._begin_archive(cur, name, replace, created_ns, metadata)
            now = time.time_ns()
            unique = sorted({b.digest: b for b in blobs}.values(), key=lambda b: b.digest)  # one lock order
            cur.executemany(
                f"INSERT INTO blobs ({BLOB_COLUMNS}, touched_ns) VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (digest) DO UPDATE SET touched_ns = EXCLUDED.touched_ns",
                [(b.digest, b.size, b.block_size, b.block_crcs, b.checksum, now) for b in unique])
            self._insert_entries(cur, archive_id, entries)
            return self._finish_archive(cur, archive_id, name, now)

        return self._db.write(f"committing archive {name!r}", work)

    def union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        def work(cur: Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, target)
            ids = [self._source_id(cur, archive) for archive, _prefix in sources]
            if not replace:  # an existing target is compared with what the union would be, before it is built
                compare_union_first(lambda sql, args: cur.execute(sql, args).fetchall(), "%s", target,
                                    [(source_id, prefix) for source_id, (_a, prefix) in zip(ids, sources)], metadata,
                                    limits)
            # Past the comparison, an archive there is replaced, or the sources give a name twice (raised below).
            archive_id = self._begin_archive(cur, target, True, created_ns, metadata)
            for index, (prefix, source_id) in enumerate((prefix, i) for (_a, prefix), i in zip(sources, ids)):
                try:
                    with cur.connection.transaction():  # a savepoint: the duplicate is looked up after
                        cur.execute(
                            f"INSERT INTO entries ({ENTRY_INSERT}) SELECT %(id)s, {_PREFIXED.format('name')}, "
                            f"{ENTRY_COPIED} FROM entries WHERE archive_id = %(source)s", {"p": prefix, "id": archive_id, "source": source_id})
                except UniqueViolation:
                    raise self._duplicate(cur, archive_id, sources[: index + 1], ids) from None
            count, longest = cur.execute(
                "SELECT count(*), coalesce(max(octet_length(name)), 0) FROM entries WHERE archive_id = %s",
                (archive_id,)).fetchone()
            check_union_limits(target, count, longest, lambda: cur.execute(
                "SELECT name FROM entries WHERE archive_id = %s ORDER BY octet_length(name) DESC LIMIT 1",
                (archive_id,)).fetchone()[0], limits)
            return self._finish_archive(cur, archive_id, target, time.time_ns())

        try:
            return self._db.write(f"making union {target!r}", work)
        except AlreadyThere as there:  # rolled back: nothing written
            return there.record, []

    @staticmethod
    def _source_id(cur: Cursor, archive: str) -> int:
        """A union's source, locked against deletion and replacement until the union commits."""
        row = cur.execute(f"SELECT id FROM archives WHERE {alias_sql.lookup_sql('%s')} FOR SHARE",
                          (archive, archive)).fetchone()
        if row is None:
            raise NoSuchArchive(f"archive {archive!r} not found (a source of the union)")
        return row[0]

    @staticmethod
    def _duplicate(cur: Cursor, archive_id: int, sources: Sequence[tuple[str, str]],
                   ids: Sequence[int]) -> InvalidRequest:
        """The error for the last source, which holds a name an earlier one already gave."""
        row = cur.execute(
            "SELECT t.name FROM entries s JOIN entries t ON t.archive_id = %(id)s AND "
            f"t.name = {_PREFIXED.format('s.name')} WHERE s.archive_id = %(source)s ORDER BY t.name LIMIT 1",
            {"id": archive_id, "p": sources[-1][1], "source": ids[len(sources) - 1]}).fetchone()
        return duplicate_error(row[0] if row else "?", sources, ids, lambda other_id, inner: cur.execute(
            "SELECT 1 FROM entries WHERE archive_id = %s AND name = %s", (other_id, inner)).fetchone() is not None)

    def delete_archive(self, name: str, force: bool = False, note: MoveNote = MoveNote()
                       ) -> tuple[ArchiveRecord | None, list[str]]:
        def work(cur: Cursor) -> tuple[ArchiveRecord | None, list[str]]:
            self._lock_name(cur, name)
            row = cur.execute(f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE name = %s", (name,)).fetchone()
            if row is None:
                return None, []
            untagged = alias_sql.release_target(_query(cur), "%s", name, force, time.time_ns(), note)
            released = self._drop(cur, name)
            self._touch_unreferenced(cur, released, time.time_ns())
            return dataclasses.replace(archive_from_row(row), untagged=untagged), released

        return self._db.write(f"deleting archive {name!r}", work)

    def forget_blobs(self, digests: Iterable[str]) -> None:
        """Drop these blob rows unless referenced (their leases go with them, so a Store that
        leased one fails to commit instead of referencing removed bytes)."""
        wanted = sorted(set(digests))
        self._db.write("forgetting blobs", lambda cur: cur.execute(
            f"DELETE FROM blobs b WHERE digest = ANY(%s) AND {_UNREFERENCED}", (wanted,)))

    def forget_unreferenced_blobs(self) -> int:
        return self._db.write("forgetting unreferenced blobs", lambda cur: cur.execute(
            f"DELETE FROM blobs b WHERE {_UNREFERENCED}").rowcount)

    # Leases and collection --------------------------------------------------------------

    def lease(self, blob: BlobInfo, replica: str, holder: str, expires_ns: int) -> bool:
        """Lease ``blob`` (True: its row was there, bytes and all). A row a collection has claimed
        (:meth:`collect_blob`) is waited for: its bytes are being deleted, so the lease comes
        after, when the row is gone (False: the caller uploads again) or back (the delete failed)."""
        while True:
            claimed_until = self._db.write(f"leasing blob {blob.digest} to {replica}/{holder}",
                                           lambda cur: self._lease_once(cur, blob, replica, holder, expires_ns))
            if isinstance(claimed_until, bool):
                return claimed_until
            time.sleep(min(CLAIM_POLL_SECONDS, max(0.0, (claimed_until - time.time_ns()) / 1e9)))

    @staticmethod
    def _lease_once(cur: Cursor, blob: BlobInfo, replica: str, holder: str, expires_ns: int) -> bool | int:
        """One try of :meth:`lease`: whether the row (and its bytes) was there, or the end of a
        collection's live claim on it (nothing written then)."""
        now = time.time_ns()
        row = cur.execute("SELECT collecting_until_ns FROM blobs WHERE digest = %s FOR UPDATE",
                          (blob.digest,)).fetchone()
        if row is not None and row[0] > now:
            return int(row[0])
        if row is not None and row[0] != 0:  # a claim whose collector died mid-delete: the bytes may be gone
            cur.execute("DELETE FROM blobs WHERE digest = %s", (blob.digest,))
        # The upsert locks the row (created, or touched); xmax = 0 only on a row it inserted.
        inserted = cur.execute(
            f"INSERT INTO blobs ({BLOB_COLUMNS}, touched_ns) VALUES (%s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (digest) DO UPDATE SET touched_ns = EXCLUDED.touched_ns RETURNING (xmax = 0)",
            (blob.digest, blob.size, blob.block_size, blob.block_crcs, blob.checksum, now),
        ).fetchone()[0]
        cur.execute(
            "INSERT INTO leases (digest, replica, holder, expires_ns) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (digest, replica, holder) DO UPDATE SET expires_ns = EXCLUDED.expires_ns",
            (blob.digest, replica, holder, expires_ns))
        return not inserted

    def renew_leases(self, replica: str, expires_ns: int) -> int:
        return self._db.write(f"renewing the leases of {replica}", lambda cur: cur.execute(
            "UPDATE leases SET expires_ns = greatest(expires_ns, %s) WHERE replica = %s",
            (expires_ns, replica)).rowcount)

    def drop_leases(self, replica: str, holder: str) -> None:
        self._db.write(f"dropping the leases of {replica}/{holder}", lambda cur: self._drop_leases(
            cur, replica, holder, time.time_ns(), only_unreferenced=False))

    @staticmethod
    def _drop_leases(cur: Cursor, replica: str, holder: str, now_ns: int, *, only_unreferenced: bool) -> None:
        """Touch the blobs of ``(replica, holder)``'s leases, then delete those leases (blob rows
        before lease rows: the order of a collection)."""
        condition = f" AND {_UNREFERENCED}" if only_unreferenced else ""
        cur.execute(
            "UPDATE blobs b SET touched_ns = %s WHERE digest IN "
            f"(SELECT digest FROM leases WHERE replica = %s AND holder = %s){condition}",
            (now_ns, replica, holder))
        cur.execute("DELETE FROM leases WHERE replica = %s AND holder = %s", (replica, holder))

    def commit_leased(
        self, name: str, entries: Sequence[EntryRecord], replace: bool, created_ns: int, replica: str, holder: str,
        now_ns: int, metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        def work(cur: Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, name)
            archive_id = self._begin_archive(cur, name, replace, created_ns, metadata)  # ArchiveExists first
            self._hold_leased(cur, sorted({e.blob for e in entries}), name, replica, holder, now_ns)
            self._insert_entries(cur, archive_id, entries)
            result = self._finish_archive(cur, archive_id, name, now_ns)
            self._drop_leases(cur, replica, holder, now_ns, only_unreferenced=True)
            return result

        return self._db.write(f"committing archive {name!r}", work)

    def _hold_leased(self, cur: Cursor, digests: list[str], name: str, replica: str, holder: str,
                     now_ns: int) -> None:
        """Lock these blob rows ``FOR SHARE`` (no collection until this transaction ends) and
        check each has a lease of ``(replica, holder)`` live at ``now_ns`` and no collection's
        claim (a lease that expired, was claimed, then renewed must not commit: the bytes are
        being deleted)."""
        present = {digest for digest, claim in cur.execute(
            "SELECT digest, collecting_until_ns FROM blobs WHERE digest = ANY(%s) ORDER BY digest FOR SHARE",
            (digests,)).fetchall() if claim == 0}
        live = {row[0] for row in cur.execute(
            "SELECT digest FROM leases WHERE replica = %s AND holder = %s AND expires_ns > %s AND digest = ANY(%s)",
            (replica, holder, now_ns, digests)).fetchall()}
        for digest in digests:
            if digest not in present or digest not in live:
                gone = "was collected (or is being)" if digest not in present else "has no live lease"
                raise StorageUnavailable(
                    f"catalog {self.name}: archive {name!r} not committed: blob {digest} {gone} "
                    f"(lease of {replica}/{holder} expired or never taken); store it again"
                )

    def collect_blob(self, digest: str, touched_before_ns: int, now_ns: int, remove: Callable[[str], object]) -> bool:
        """Collect blob ``digest`` in three steps, so no bucket call runs under a row lock:

        1. claim: one short transaction locks the row, checks it is still collectable (no
           reference, no live lease, untouched since ``touched_before_ns``) and sets
           ``collecting_until_ns`` (now + :data:`CLAIM_SECONDS`);
        2. ``remove(digest)`` deletes the bytes, outside any transaction;
        3. forget: another short transaction deletes the row if the claim is still ours; if
           ``remove`` failed, the claim is dropped instead and the row stays (collectable again).

        Why a Store cannot lose bytes to this: a lease locks the row too, so it comes before the
        claim (which then sees the touch or the lease and does not claim) or after it. After, the
        lease sees a live claim and waits (:meth:`lease`) until the row is gone (it inserts a
        new row and its caller uploads the bytes again, after the delete) or back (the delete
        failed; the bytes are there). A commit holds its blob rows ``FOR SHARE``, needs a live
        lease and refuses a claimed row (a lease that expired, let the claim in, and was renewed
        after cannot commit). A collector that dies mid-delete leaves a claim
        that expires; a lease then takes the row over as if it were new (the bytes may be gone),
        and the bucket client's timeouts (well under :data:`CLAIM_SECONDS`) bound a delete in
        flight. Another replica skips a claimed row."""
        claim = self._db.write(f"claiming blob {digest} for collection",
                               lambda cur: self._claim(cur, digest, touched_before_ns, now_ns), retry=False)
        if claim is None:
            return False
        try:
            remove(digest)
        except BaseException:
            self._db.write(f"releasing the claim on blob {digest}", lambda cur: cur.execute(
                "UPDATE blobs SET collecting_until_ns = 0 WHERE digest = %s AND collecting_until_ns = %s",
                (digest, claim)))
            raise
        self._db.write(f"forgetting collected blob {digest}", lambda cur: cur.execute(
            "DELETE FROM blobs WHERE digest = %s AND collecting_until_ns = %s", (digest, claim)))  # and its leases
        return True

    def collect_orphan(self, digest: str, remove: Callable[[str], object]) -> bool:
        """Delete bytes that no catalog row names (``tannery scrub --repair``) as
        :meth:`collect_blob` does, a claim first: a placeholder row, claimed, is inserted only if
        there is no row (False otherwise: a Store leased it meanwhile), so a Store leasing the
        blob meanwhile waits, then uploads again; the placeholder goes after ``remove``."""
        claim = time.time_ns() + int(CLAIM_SECONDS * 1e9)
        inserted = self._db.write(f"claiming unreferenced blob {digest}", lambda cur: cur.execute(
            f"INSERT INTO blobs ({BLOB_COLUMNS}, touched_ns, collecting_until_ns) VALUES (%s, 0, 0, '', '', 0, %s) "
            "ON CONFLICT (digest) DO NOTHING", (digest, claim)).rowcount, retry=False)
        if not inserted:
            return False
        try:
            remove(digest)
        finally:
            self._db.write(f"forgetting unreferenced blob {digest}", lambda cur: cur.execute(
                "DELETE FROM blobs WHERE digest = %s AND collecting_until_ns = %s", (digest, claim)))
        return True

    @staticmethod
    def _claim(cur: Cursor, digest: str, touched_before_ns: int, now_ns: int) -> int | None:
        """Claim the row of ``digest`` for collection if it is collectable; the claim's end, or None."""
        row = cur.execute("SELECT touched_ns, collecting_until_ns FROM blobs WHERE digest = %s FOR UPDATE",
                          (digest,)).fetchone()
        if row is None or row[0] >= touched_before_ns or row[1] > time.time_ns():
            return None
        busy = cur.execute(
            "SELECT EXISTS (SELECT 1 FROM entries WHERE blob = %(d)s) OR EXISTS "
            "(SELECT 1 FROM leases WHERE digest = %(d)s AND expires_ns > %(now)s)",
            {"d": digest, "now": now_ns}).fetchone()[0]
        if busy:
            return None
        claim = time.time_ns() + int(CLAIM_SECONDS * 1e9)
        cur.execute("UPDATE blobs SET collecting_until_ns = %s WHERE digest = %s", (claim, digest))
        return claim

    def close(self) -> None:
        self._db.close()


def _query(cur: Cursor) -> alias_sql.Query:
    """Statements on ``cur`` as :mod:`.alias_sql` runs them: each returns its rows (none for a write)."""
    def run(sql: str, args: tuple) -> list[tuple]:
        cur.execute(sql, args)
        return cur.fetchall() if cur.description is not None else []

    return run


__all__ = ["MIGRATIONS", "PostgresCatalog", "SCHEMA_VERSION", "safe_name"]