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
  gets NameTaken) or, with ``replace``, the archive of the last one is the whole archive;
* an archive being built has no name (NULL) until its transaction renames it, so it may be
  made from the archive it replaces; the UNIQUE constraint on names backs the lock up;
* a union's sources are locked ``FOR SHARE`` so none is deleted or replaced under it;
* blob rows are the unit of collection: a lease, a commit of leased blobs and
  :meth:`PostgresCatalog.collect_blob` each hold the rows they decide on (lease and collection
  ``FOR UPDATE``, a commit ``FOR SHARE``), always blob rows before lease rows, so a lease and a
  collection of one blob are ordered: the lease comes first (no collection), or the row is gone
  and the lease creates it again (its caller uploads the bytes again).

A deadlock or serialization failure rolls its whole transaction back, so such writes are run
again (up to three times); other writes are never retried (a lost COMMIT has an unknown
outcome). Reads are retried once on a connection that broke. Every driver error is raised as
:class:`~.errors.StorageUnavailable` naming the catalog (``postgresql://user@host:port/db``,
never a password) and what failed.

Times (``touched_ns``, lease expiry) are ``time.time_ns()`` of the replicas: their clocks must
agree to well within the collection's grace period.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
except ImportError as _error:  # pragma: no cover: the embedded server never imports this module
    raise ImportError(
        f"the PostgreSQL catalog needs psycopg and psycopg-pool: pip install 'tannery[scale]' ({_error})"
    ) from _error

from ..failures import Malformed, Missing, NameTaken
from .base import ArchiveLimits, ArchiveRecord, BlobInfo, CatalogTotals, EntryRecord
from .errors import StorageUnavailable
from .same_content import AlreadyThere, require_same
from .sqlite_catalog import (CatalogTooNew, archive_from_row, check_union_limits, duplicate_error, entry_from_row,
                             entry_values, metadata_text)

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA_V1 = (
    """CREATE TABLE archives (
    id bigserial PRIMARY KEY,
    name text COLLATE "C" CONSTRAINT archives_name UNIQUE,  -- NULL while its transaction builds it
    created_ns bigint NOT NULL,
    entries bigint NOT NULL,
    nbytes bigint NOT NULL,
    payload_bytes bigint NOT NULL
)""",
    """CREATE TABLE blobs (
    digest text COLLATE "C" PRIMARY KEY,
    size bigint NOT NULL,
    block_size bigint NOT NULL,
    block_crcs bytea NOT NULL,
    checksum text NOT NULL,
    touched_ns bigint NOT NULL
)""",
    "CREATE INDEX blobs_by_touched ON blobs (touched_ns)",
    """CREATE TABLE entries (
    archive_id bigint NOT NULL REFERENCES archives (id) ON DELETE CASCADE,
    name text COLLATE "C" NOT NULL,
    dtype text NOT NULL,
    shape text NOT NULL,
    nbytes bigint NOT NULL,
    payload_bytes bigint NOT NULL,
    data_offset bigint NOT NULL,
    digest text COLLATE "C" NOT NULL REFERENCES blobs (digest),
    PRIMARY KEY (archive_id, name)
)""",
    "CREATE INDEX entries_by_digest ON entries (digest)",
    """CREATE TABLE leases (
    digest text COLLATE "C" NOT NULL REFERENCES blobs (digest) ON DELETE CASCADE,
    replica text NOT NULL,
    holder text NOT NULL,
    expires_ns bigint NOT NULL,
    PRIMARY KEY (digest, replica, holder)
)""",
    "CREATE INDEX leases_by_holder ON leases (replica, holder)",
)


def _to_version_1(cur: psycopg.Cursor) -> None:
    """The first schema: archives, entries, blobs (with ``touched_ns``) and leases. Names sort
    by their bytes (``COLLATE "C"``), as SQLite sorts them."""
    for statement in _SCHEMA_V1:
        cur.execute(statement)


def _to_version_2(cur: psycopg.Cursor) -> None:
    """``archives.metadata``: an archive's string-to-string metadata as a JSON object in text
    (the rows already there get ``'{}'``, none)."""
    cur.execute("ALTER TABLE archives ADD COLUMN IF NOT EXISTS metadata text NOT NULL DEFAULT '{}'")


#: ``MIGRATIONS[n]`` brings schema version ``n`` to ``n + 1`` (0: an empty database).
MIGRATIONS: tuple[Callable[[psycopg.Cursor], None], ...] = (_to_version_1, _to_version_2)
SCHEMA_VERSION = len(MIGRATIONS)
#: The advisory lock (two-key form, apart from the names' one-key locks) of schema changes.
_SCHEMA_LOCK = (0x7A77, 1)

_ARCHIVE_COLUMNS = "name, entries, nbytes, payload_bytes, created_ns, metadata"
_BLOB_COLUMNS = "digest, size, block_size, block_crcs, checksum"
_ENTRY_COLUMNS = "e.name, e.dtype, e.shape, e.nbytes, e.payload_bytes, e.data_offset, e.digest"
_ENTRY_INSERT = "archive_id, name, dtype, shape, nbytes, payload_bytes, data_offset, digest"
#: ``%(p)s`` (a prefix) before an entry name, with the dot, as :func:`tannery_protocol.names.join` does.
_PREFIXED = "CASE WHEN %(p)s = '' THEN {0} ELSE %(p)s || '.' || {0} END"
_UNREFERENCED = "NOT EXISTS (SELECT 1 FROM entries e WHERE e.digest = b.digest)"
#: Writes run again after a deadlock or a serialization failure, at most this many times in all.
_WRITE_ATTEMPTS = 3


def safe_name(url: str) -> str:
    """``postgresql://user@host:port/db`` of a connection URL or DSN: how messages name the
    catalog (never with its password)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "postgresql://(unparsable URL)"
    user = params.get("user", "")
    host = params.get("host", "") or "localhost"
    port = params.get("port", "") or "5432"
    return f"postgresql://{user + '@' if user else ''}{host}:{port}/{params.get('dbname', '')}"


def _reason(exc: BaseException) -> str:
    """The first line of a driver's message, without libpq's "connection to server ... failed: "
    nor the server's severity ("FATAL:  database "x" does not exist" is "database "x" does not exist")."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = text.rsplit("failed: ", 1)[-1].strip() or text
    text = re.sub(r"^(FATAL|ERROR|PANIC):\s+", "", text)
    return text[:1].lower() + text[1:]


class PostgresCatalog:
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
        self._pool = ConnectionPool(
            url, min_size=min_size, max_size=max_size, open=False, name=self.name, timeout=timeout,
            # Gives up a failing reconnection soon: the next call then starts a fresh one, instead
            # of waiting for an exponential back-off grown long while PostgreSQL was down.
            reconnect_timeout=max(2.0, timeout),
            check=ConnectionPool.check_connection,
            # TCP keepalives: a PostgreSQL host that vanished (no reset) is noticed in about 20 s.
            kwargs={"autocommit": True, "connect_timeout": max(1, round(timeout)), "keepalives_idle": 10,
                    "keepalives_interval": 5, "keepalives_count": 2},
        )
        self._pool.open(wait=False)
        try:
            self._run("creating or migrating the schema", self._migrate, write=True)
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresCatalog({self.name!r})"

    # Running statements ------------------------------------------------------------------

    def _run(self, what: str, work: Callable[[psycopg.Cursor], T], *, write: bool, retry: bool = True,
             timeout: float | None = None) -> T:
        """``work(cursor)`` on a pooled connection, in one transaction when ``write``; driver
        errors raised as StorageUnavailable saying ``what`` failed."""
        attempt = 0
        while True:
            attempt += 1
            broken = False
            try:
                with self._pool.connection(timeout) as conn:
                    try:
                        with conn.cursor() as cur:
                            if not write:
                                return work(cur)
                            with conn.transaction():
                                return work(cur)
                    finally:
                        broken = conn.broken
            except PoolTimeout:
                raise self._unreachable(what) from None
            except PoolClosed:
                raise StorageUnavailable(f"catalog {self.name} is closed ({what})") from None
            except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as exc:
                if write and retry and attempt < _WRITE_ATTEMPTS:
                    log.info("catalog %s: %s: %s; running it again", self.name, what, _reason(exc))
                    continue
                raise self._failed(what, exc) from exc
            except pg_errors.UniqueViolation as exc:
                if exc.diag.constraint_name == "archives_name":  # the name lock makes this unlikely
                    raise NameTaken(f"archive already exists ({what})") from None
                raise self._failed(what, exc) from exc
            except psycopg.OperationalError as exc:
                if not write and broken and attempt < 2:
                    continue  # a read is idempotent: once more, on a new connection
                raise self._failed(what, exc) from exc
            except psycopg.Error as exc:
                raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> StorageUnavailable:
        return StorageUnavailable(f"catalog {self.name}: {what} failed: {_reason(exc)}")

    def _unreachable(self, what: str) -> StorageUnavailable:
        """No connection within the timeout: say why, from a connection attempt of our own."""
        try:
            with psycopg.connect(self.url, connect_timeout=max(1, round(min(self.timeout, 3)))):
                pass
        except psycopg.Error as exc:
            return StorageUnavailable(f"catalog {self.name} unreachable: {_reason(exc)} ({what})")
        return StorageUnavailable(
            f"catalog {self.name}: no connection free within {self.timeout:g} s ({what}); "
            f"{self._pool.max_size} in use, or being re-established"
        )

    def _read(self, what: str, work: Callable[[psycopg.Cursor], T]) -> T:
        return self._run(what, work, write=False)

    def _write(self, what: str, work: Callable[[psycopg.Cursor], T], *, retry: bool = True) -> T:
        return self._run(what, work, write=True, retry=retry)

    def _migrate(self, cur: psycopg.Cursor) -> None:
        """Bring the schema to :data:`SCHEMA_VERSION` in this transaction, under the schema lock
        (replicas starting at once migrate one after the other; the later ones find it done)."""
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _SCHEMA_LOCK)
        cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
        version = cur.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise CatalogTooNew(
                f"{self.name}: catalog schema version {version} is newer than this tannery's ({SCHEMA_VERSION}): "
                "run a newer tannery"
            )
        if version == SCHEMA_VERSION:
            return
        for step in MIGRATIONS[version:]:
            step(cur)
        cur.execute("DELETE FROM schema_version")
        cur.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
        log.info("catalog %s: schema migrated from version %d to %d", self.name, version, SCHEMA_VERSION)

    # Reads ------------------------------------------------------------------------------

    def archive(self, name: str) -> ArchiveRecord | None:
        row = self._read(f"reading archive {name!r}", lambda cur: cur.execute(
            f"SELECT {_ARCHIVE_COLUMNS} FROM archives WHERE name = %s", (name,)).fetchone())
        return archive_from_row(row) if row else None

    def entries(self, archive: str, names: Sequence[str]) -> dict[str, EntryRecord]:
        rows = self._read(f"reading entries of {archive!r}", lambda cur: cur.execute(
            f"SELECT {_ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
            "WHERE a.name = %s AND e.name = ANY(%s)", (archive, list(dict.fromkeys(names)))).fetchall())
        return {row[0]: entry_from_row(row) for row in rows}

    def entries_under(self, archive: str, prefix: str) -> list[EntryRecord]:
        query = f"SELECT {_ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id WHERE a.name = %s"
        args: tuple = (archive,)
        if prefix:
            # The prefix itself and the names in [prefix + ".", prefix + "/"): '/' follows '.'.
            query += " AND (e.name = %s OR (e.name >= %s AND e.name < %s))"
            args += (prefix, prefix + ".", prefix + "/")
        rows = self._read(f"reading entries of {archive!r}",
                          lambda cur: cur.execute(query + " ORDER BY e.name", args).fetchall())
        return [entry_from_row(row) for row in rows]

    def list_archives(self, prefix: str, after: str, limit: int) -> list[ArchiveRecord]:
        rows = self._read("listing archives", lambda cur: cur.execute(
            f"SELECT {_ARCHIVE_COLUMNS} FROM archives WHERE name >= %s AND name > %s AND starts_with(name, %s) "
            "ORDER BY name LIMIT %s", (prefix, after, prefix, limit)).fetchall())
        return [archive_from_row(row) for row in rows]

    def blob(self, digest: str) -> BlobInfo | None:
        row = self._read(f"reading blob {digest}", lambda cur: cur.execute(
            f"SELECT {_BLOB_COLUMNS} FROM blobs WHERE digest = %s", (digest,)).fetchone())
        return BlobInfo(*row) if row else None

    def totals(self) -> CatalogTotals:
        def work(cur: psycopg.Cursor) -> CatalogTotals:
            with cur.connection.transaction():  # one snapshot for both counts
                archives, archive_bytes = cur.execute(
                    "SELECT count(*), coalesce(sum(payload_bytes), 0) FROM archives WHERE name IS NOT NULL"
                ).fetchone()
                blobs, blob_bytes = cur.execute("SELECT count(*), coalesce(sum(size), 0) FROM blobs").fetchone()
            return CatalogTotals(archives, int(archive_bytes), blobs, int(blob_bytes))

        return self._read("counting archives and blobs", work)

    def referenced_digests(self) -> set[str]:
        rows = self._read("reading referenced digests",
                          lambda cur: cur.execute("SELECT DISTINCT digest FROM entries").fetchall())
        return {row[0] for row in rows}

    def referrers(self, digest: str) -> list[tuple[str, str]]:
        rows = self._read(f"reading the referrers of blob {digest}", lambda cur: cur.execute(
            "SELECT a.name, e.name FROM entries e JOIN archives a ON a.id = e.archive_id "
            "WHERE e.digest = %s AND a.name IS NOT NULL ORDER BY a.name, e.name", (digest,)).fetchall())
        return [(archive, entry) for archive, entry in rows]

    def unreferenced(self, digests: Iterable[str]) -> list[BlobInfo]:
        """As SQLite's: a digest neither recorded nor referenced (bytes that no transaction
        recorded) comes back as an empty BlobInfo."""
        rows = self._read("finding unreferenced blobs", lambda cur: cur.execute(
            "SELECT u.d, b.size, b.block_size, b.block_crcs, b.checksum, b.digest IS NOT NULL "
            "FROM unnest(%s::text[]) WITH ORDINALITY AS u(d, i) LEFT JOIN blobs b ON b.digest = u.d "
            "WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.digest = u.d) ORDER BY u.i",
            (list(dict.fromkeys(digests)),)).fetchall())
        return [BlobInfo(*row[:5]) if row[5] else BlobInfo(row[0], 0, 0, b"") for row in rows]

    def collectable(self, touched_before_ns: int, now_ns: int, limit: int) -> list[str]:
        rows = self._read("finding collectable blobs", lambda cur: cur.execute(
            f"SELECT digest FROM blobs b WHERE touched_ns < %s AND {_UNREFERENCED} AND NOT EXISTS "
            "(SELECT 1 FROM leases l WHERE l.digest = b.digest AND l.expires_ns > %s) ORDER BY touched_ns LIMIT %s",
            (touched_before_ns, now_ns, limit)).fetchall())
        return [row[0] for row in rows]

    def check(self) -> None:
        """``SELECT 1`` within about two seconds (health checks)."""
        limit = min(self.timeout, 2.0)

        def work(cur: psycopg.Cursor) -> None:
            with cur.connection.transaction():
                cur.execute("SELECT set_config('statement_timeout', %s, true)", (f"{round(limit * 1000)}ms",))
                cur.execute("SELECT 1").fetchone()

        self._run("checking the catalog", work, write=False, timeout=limit)

    # Archive writes ---------------------------------------------------------------------

    @staticmethod
    def _lock_name(cur: psycopg.Cursor, name: str) -> None:
        """Serialize the writes of one archive name (until this transaction ends)."""
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (name,))

    @staticmethod
    def _begin_archive(cur: psycopg.Cursor, name: str, replace: bool, created_ns: int,
                       metadata: Mapping[str, str] | None = None) -> int:
        """NameTaken unless the name is free or may be replaced; the new archive, nameless."""
        if not replace and cur.execute("SELECT 1 FROM archives WHERE name = %s", (name,)).fetchone():
            raise NameTaken(f"archive {name!r} already exists")
        return cur.execute(
            "INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes, metadata) "
            "VALUES (NULL, %s, 0, 0, 0, %s) RETURNING id", (created_ns, metadata_text(metadata))).fetchone()[0]

    def _finish_archive(self, cur: psycopg.Cursor, archive_id: int, name: str,
                        now_ns: int) -> tuple[ArchiveRecord, list[str]]:
        """Drop the archive being replaced, give the new one its name and totals, and touch the
        blobs that lost their last reference (their grace period starts)."""
        released = self._drop(cur, name)
        row = cur.execute(
            "UPDATE archives SET name = %(name)s, (entries, nbytes, payload_bytes) = "
            "(SELECT count(*), coalesce(sum(nbytes), 0), coalesce(sum(payload_bytes), 0) "
            " FROM entries WHERE archive_id = %(id)s) "
            f"WHERE id = %(id)s RETURNING {_ARCHIVE_COLUMNS}", {"name": name, "id": archive_id}).fetchone()
        self._touch_unreferenced(cur, released, now_ns)
        return archive_from_row(row), released

    @staticmethod
    def _drop(cur: psycopg.Cursor, name: str) -> list[str]:
        """Delete archive ``name`` if it exists; the digests it referenced."""
        row = cur.execute("SELECT id FROM archives WHERE name = %s", (name,)).fetchone()
        if row is None:
            return []
        released = [r[0] for r in cur.execute(
            "SELECT DISTINCT digest FROM entries WHERE archive_id = %s ORDER BY digest", row).fetchall()]
        cur.execute("DELETE FROM archives WHERE id = %s", row)
        return released

    @staticmethod
    def _touch_unreferenced(cur: psycopg.Cursor, digests: Sequence[str], now_ns: int) -> None:
        if digests:
            cur.execute(f"UPDATE blobs b SET touched_ns = %s WHERE digest = ANY(%s) AND {_UNREFERENCED}",
                        (now_ns, list(digests)))

    @staticmethod
    def _insert_entries(cur: psycopg.Cursor, archive_id: int, entries: Sequence[EntryRecord]) -> None:
        with cur.copy(f"COPY entries ({_ENTRY_INSERT}) FROM STDIN") as copy:
            for entry in entries:
                copy.write_row(entry_values(archive_id, entry))

    def commit_archive(
        self, name: str, entries: Sequence[EntryRecord], blobs: Sequence[BlobInfo], replace: bool, created_ns: int,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        """For one process that owns the blob store (and ``tannery migrate``): the blob rows are
        upserted (touched) here; replicas use :meth:`lease` and :meth:`commit_leased`."""
        def work(cur: psycopg.Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, name)
            archive_id = self._begin_archive(cur, name, replace, created_ns, metadata)
            now = time.time_ns()
            unique = sorted({b.digest: b for b in blobs}.values(), key=lambda b: b.digest)  # one lock order
            cur.executemany(
                f"INSERT INTO blobs ({_BLOB_COLUMNS}, touched_ns) VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (digest) DO UPDATE SET touched_ns = EXCLUDED.touched_ns",
                [(b.digest, b.size, b.block_size, b.block_crcs, b.checksum, now) for b in unique])
            self._insert_entries(cur, archive_id, entries)
            return self._finish_archive(cur, archive_id, name, now)

        return self._write(f"committing archive {name!r}", work)

    def union(
        self, target: str, sources: Sequence[tuple[str, str]], replace: bool, created_ns: int, limits: ArchiveLimits,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[ArchiveRecord, list[str]]:
        def work(cur: psycopg.Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, target)
            ids = [self._source_id(cur, archive) for archive, _prefix in sources]
            # An existing target is compared with the union once it is built (below).
            archive_id = self._begin_archive(cur, target, True, created_ns, metadata)
            for index, (prefix, source_id) in enumerate((prefix, i) for (_a, prefix), i in zip(sources, ids)):
                try:
                    with cur.connection.transaction():  # a savepoint: the duplicate is looked up after
                        cur.execute(
                            f"INSERT INTO entries ({_ENTRY_INSERT}) SELECT %(id)s, {_PREFIXED.format('name')}, "
                            "dtype, shape, nbytes, payload_bytes, data_offset, digest FROM entries "
                            "WHERE archive_id = %(source)s", {"p": prefix, "id": archive_id, "source": source_id})
                except pg_errors.UniqueViolation:
                    raise self._duplicate(cur, archive_id, sources[: index + 1], ids) from None
            count, longest = cur.execute(
                "SELECT count(*), coalesce(max(octet_length(name)), 0) FROM entries WHERE archive_id = %s",
                (archive_id,)).fetchone()
            check_union_limits(target, count, longest, lambda: cur.execute(
                "SELECT name FROM entries WHERE archive_id = %s ORDER BY octet_length(name) DESC LIMIT 1",
                (archive_id,)).fetchone()[0], limits)
            if not replace:
                self._compare_existing(cur, target, archive_id, metadata)
            return self._finish_archive(cur, archive_id, target, time.time_ns())

        try:
            return self._write(f"making union {target!r}", work)
        except AlreadyThere as there:  # rolled back: nothing written
            return there.record, []

    @staticmethod
    def _compare_existing(cur: psycopg.Cursor, name: str, archive_id: int,
                          metadata: Mapping[str, str] | None) -> None:
        """Return when no archive ``name`` exists; raise AlreadyThere when it holds exactly the
        entries of archive ``archive_id`` (being built) and ``metadata``, NameTaken otherwise."""
        row = cur.execute(f"SELECT {_ARCHIVE_COLUMNS} FROM archives WHERE name = %s", (name,)).fetchone()
        if row is None:
            return
        there = cur.execute(f"SELECT {_ENTRY_COLUMNS} FROM entries e JOIN archives a ON a.id = e.archive_id "
                            "WHERE a.name = %s", (name,)).fetchall()
        new = cur.execute(f"SELECT {_ENTRY_COLUMNS} FROM entries e WHERE e.archive_id = %s", (archive_id,)).fetchall()
        raise AlreadyThere(require_same(archive_from_row(row), [entry_from_row(r) for r in there],
                                        [entry_from_row(r) for r in new], metadata, "in the union"))

    @staticmethod
    def _source_id(cur: psycopg.Cursor, archive: str) -> int:
        """A union's source, locked against deletion and replacement until the union commits."""
        row = cur.execute("SELECT id FROM archives WHERE name = %s FOR SHARE", (archive,)).fetchone()
        if row is None:
            raise Missing(f"archive {archive!r} not found (a source of the union)")
        return row[0]

    @staticmethod
    def _duplicate(cur: psycopg.Cursor, archive_id: int, sources: Sequence[tuple[str, str]],
                   ids: Sequence[int]) -> Malformed:
        """The error for the last source, which holds a name an earlier one already gave."""
        row = cur.execute(
            "SELECT t.name FROM entries s JOIN entries t ON t.archive_id = %(id)s AND "
            f"t.name = {_PREFIXED.format('s.name')} WHERE s.archive_id = %(source)s ORDER BY t.name LIMIT 1",
            {"id": archive_id, "p": sources[-1][1], "source": ids[len(sources) - 1]}).fetchone()
        return duplicate_error(row[0] if row else "?", sources, ids, lambda other_id, inner: cur.execute(
            "SELECT 1 FROM entries WHERE archive_id = %s AND name = %s", (other_id, inner)).fetchone() is not None)

    def delete_archive(self, name: str) -> tuple[ArchiveRecord | None, list[str]]:
        def work(cur: psycopg.Cursor) -> tuple[ArchiveRecord | None, list[str]]:
            self._lock_name(cur, name)
            row = cur.execute(f"SELECT {_ARCHIVE_COLUMNS} FROM archives WHERE name = %s", (name,)).fetchone()
            if row is None:
                return None, []
            released = self._drop(cur, name)
            self._touch_unreferenced(cur, released, time.time_ns())
            return archive_from_row(row), released

        return self._write(f"deleting archive {name!r}", work)

    def forget_blobs(self, digests: Iterable[str]) -> None:
        """Drop these blob rows unless referenced (their leases go with them, so a Store that
        leased one fails to commit instead of referencing removed bytes)."""
        wanted = sorted(set(digests))
        self._write("forgetting blobs", lambda cur: cur.execute(
            f"DELETE FROM blobs b WHERE digest = ANY(%s) AND {_UNREFERENCED}", (wanted,)))

    def forget_unreferenced_blobs(self) -> int:
        return self._write("forgetting unreferenced blobs", lambda cur: cur.execute(
            f"DELETE FROM blobs b WHERE {_UNREFERENCED}").rowcount)

    # Leases and collection --------------------------------------------------------------

    def lease(self, blob: BlobInfo, replica: str, holder: str, expires_ns: int) -> bool:
        def work(cur: psycopg.Cursor) -> bool:
            # The upsert locks the row (created, or touched); xmax = 0 only on a row it inserted.
            inserted = cur.execute(
                f"INSERT INTO blobs ({_BLOB_COLUMNS}, touched_ns) VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (digest) DO UPDATE SET touched_ns = EXCLUDED.touched_ns RETURNING (xmax = 0)",
                (blob.digest, blob.size, blob.block_size, blob.block_crcs, blob.checksum, time.time_ns()),
            ).fetchone()[0]
            cur.execute(
                "INSERT INTO leases (digest, replica, holder, expires_ns) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (digest, replica, holder) DO UPDATE SET expires_ns = EXCLUDED.expires_ns",
                (blob.digest, replica, holder, expires_ns))
            return not inserted

        return self._write(f"leasing blob {blob.digest} to {replica}/{holder}", work)

    def renew_leases(self, replica: str, expires_ns: int) -> int:
        return self._write(f"renewing the leases of {replica}", lambda cur: cur.execute(
            "UPDATE leases SET expires_ns = greatest(expires_ns, %s) WHERE replica = %s",
            (expires_ns, replica)).rowcount)

    def drop_leases(self, replica: str, holder: str) -> None:
        self._write(f"dropping the leases of {replica}/{holder}", lambda cur: self._drop_leases(
            cur, replica, holder, time.time_ns(), only_unreferenced=False))

    @staticmethod
    def _drop_leases(cur: psycopg.Cursor, replica: str, holder: str, now_ns: int, *, only_unreferenced: bool) -> None:
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
        def work(cur: psycopg.Cursor) -> tuple[ArchiveRecord, list[str]]:
            self._lock_name(cur, name)
            archive_id = self._begin_archive(cur, name, replace, created_ns, metadata)  # NameTaken first
            self._hold_leased(cur, sorted({e.digest for e in entries}), name, replica, holder, now_ns)
            self._insert_entries(cur, archive_id, entries)
            result = self._finish_archive(cur, archive_id, name, now_ns)
            self._drop_leases(cur, replica, holder, now_ns, only_unreferenced=True)
            return result

        return self._write(f"committing archive {name!r}", work)

    def _hold_leased(self, cur: psycopg.Cursor, digests: list[str], name: str, replica: str, holder: str,
                     now_ns: int) -> None:
        """Lock these blob rows ``FOR SHARE`` (no collection until this transaction ends) and
        check each has a lease of ``(replica, holder)`` live at ``now_ns``."""
        present = {row[0] for row in cur.execute(
            "SELECT digest FROM blobs WHERE digest = ANY(%s) ORDER BY digest FOR SHARE", (digests,)).fetchall()}
        live = {row[0] for row in cur.execute(
            "SELECT digest FROM leases WHERE replica = %s AND holder = %s AND expires_ns > %s AND digest = ANY(%s)",
            (replica, holder, now_ns, digests)).fetchall()}
        for digest in digests:
            if digest not in present or digest not in live:
                gone = "was collected" if digest not in present else "has no live lease"
                raise StorageUnavailable(
                    f"catalog {self.name}: archive {name!r} not committed: blob {digest} {gone} "
                    f"(lease of {replica}/{holder} expired or never taken); store it again"
                )

    def collect_blob(self, digest: str, touched_before_ns: int, now_ns: int, remove: Callable[[str], object]) -> bool:
        def work(cur: psycopg.Cursor) -> bool:
            row = cur.execute("SELECT touched_ns FROM blobs WHERE digest = %s FOR UPDATE", (digest,)).fetchone()
            if row is None or row[0] >= touched_before_ns:
                return False
            busy = cur.execute(
                "SELECT EXISTS (SELECT 1 FROM entries WHERE digest = %(d)s) OR EXISTS "
                "(SELECT 1 FROM leases WHERE digest = %(d)s AND expires_ns > %(now)s)",
                {"d": digest, "now": now_ns}).fetchone()[0]
            if busy:
                return False
            cur.execute("DELETE FROM blobs WHERE digest = %s", (digest,))  # and its expired leases
            remove(digest)  # under the row's lock; an exception rolls the deletion back
            return True

        # Not run again on a deadlock: ``remove`` may have run.
        return self._write(f"collecting blob {digest}", work, retry=False)

    def close(self) -> None:
        self._pool.close()


__all__ = ["MIGRATIONS", "PostgresCatalog", "SCHEMA_VERSION", "safe_name"]
