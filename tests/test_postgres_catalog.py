"""What only the shared catalog has: a schema several replicas create at once, writers of one
name on separate catalog objects, blob leases and collection under the blob row's lock, and
PostgreSQL stopped and started again under an open catalog. (The behaviour it shares with the
SQLite catalog is tested on both in tests/test_storage.py.)"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tannery_server.storage import ArchiveExists, ArchiveLimits, BlobInfo, CatalogTooNew, EntryRecord, StorageUnavailable
from tannery_server.storage.postgres_catalog import SCHEMA_VERSION, PostgresCatalog

SECOND = 10**9
REPLICA, HOLDER = "replica-a", "store-1"
LIMITS = ArchiveLimits(max_entries=1000, max_name_bytes=64)


def _blob(n: int) -> BlobInfo:
    return BlobInfo(f"{n:064x}", 10 + n, 1 << 20, struct.pack("<I", n))


def _entry(name: str, blob: BlobInfo) -> EntryRecord:
    return EntryRecord(name, "uint8", (blob.size,), blob.size, blob.size, 0, blob.digest)


@pytest.fixture
def open_catalogs(postgres_url):
    """``open_catalogs(n)``: n separate catalogs on the test's database (as n replicas), closed after."""
    opened: list[PostgresCatalog] = []

    def open_catalogs(n: int = 1, **options) -> list[PostgresCatalog]:
        catalogs = [PostgresCatalog(postgres_url, **options) for _ in range(n)]
        opened.extend(catalogs)
        return catalogs

    yield open_catalogs
    for catalog in opened:
        catalog.close()


@pytest.fixture
def catalog(open_catalogs) -> PostgresCatalog:
    return open_catalogs(1)[0]


def _at_once(*calls):
    """Run the calls in threads released together; their results, or the exceptions they raised."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001: the caller looks at what each one raised
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


# The schema ------------------------------------------------------------------------------


def test_replicas_starting_at_once_create_the_schema_once(postgres_url):
    results = _at_once(*[lambda: PostgresCatalog(postgres_url) for _ in range(4)])
    try:
        assert all(isinstance(c, PostgresCatalog) for c in results), results
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        results[0].commit_archive("a", [_entry("w", _blob(1))], [_blob(1)], False, 1)
        assert results[3].archive("a").entries == 1
    finally:
        for catalog in results:
            if isinstance(catalog, PostgresCatalog):
                catalog.close()


def test_a_catalog_of_a_newer_schema_is_refused(postgres_url):
    PostgresCatalog(postgres_url).close()
    with psycopg.connect(postgres_url) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    name = postgres_url.rsplit("/", 1)[1]
    with pytest.raises(CatalogTooNew, match=f"/{name}: catalog schema version {SCHEMA_VERSION + 1} is newer than "
                                            f"this tannery's \\({SCHEMA_VERSION}\\)"):
        PostgresCatalog(postgres_url)


# Writers of one name on two replicas -------------------------------------------------------


def test_two_replicas_committing_one_name_at_once_one_wins(open_catalogs):
    a, b = open_catalogs(2)
    for round_ in range(8):
        name = f"model-{round_}"
        results = _at_once(
            lambda: a.commit_archive(name, [_entry("w", _blob(1))], [_blob(1)], False, 1),
            lambda: b.commit_archive(name, [_entry("v", _blob(2))], [_blob(2)], False, 2),
        )
        taken = [r for r in results if isinstance(r, ArchiveExists)]
        won = [r for r in results if isinstance(r, tuple)]
        assert len(taken) == 1 and len(won) == 1, results
        assert str(taken[0]) == f"archive {name!r} already exists"
        assert a.archive(name) == won[0][0]


def test_two_replicas_replacing_one_name_at_once_leave_one_whole_archive(open_catalogs):
    a, b = open_catalogs(2)
    names = {writer: [f"{writer}.{i}" for i in range(40)] for writer in ("a", "b")}

    def replace(catalog, writer: str, blob: BlobInfo):
        return catalog.commit_archive("model", [_entry(n, blob) for n in names[writer]], [blob], True, 1)

    for _ in range(8):
        results = _at_once(lambda: replace(a, "a", _blob(1)), lambda: replace(b, "b", _blob(2)))
        assert all(isinstance(r, tuple) for r in results), results
        entries = [e.name for e in b.entries_under("model", "")]
        assert entries in (sorted(names["a"]), sorted(names["b"])), entries
        assert a.archive("model").entries == 40


def test_a_read_of_an_archive_takes_its_record_and_entries_from_one_snapshot(open_catalogs, monkeypatch):
    """Another replica replaces the archive between the read's two statements: the read answers
    the old record with the old entries (REPEATABLE READ), never old info with new entries."""
    from tannery_server.storage import postgres_catalog

    a, b = open_catalogs(2)
    a.commit_archive("model", [_entry(f"old.{i}", _blob(1)) for i in range(3)], [_blob(1)], False, 1)
    real = postgres_catalog.entries_under_query

    def replaced_first(mark, prefix):
        b.commit_archive("model", [_entry(f"new.{i}", _blob(2)) for i in range(5)], [_blob(2)], True, 2)
        return real(mark, prefix)

    monkeypatch.setattr(postgres_catalog, "entries_under_query", replaced_first)
    read = a.read_archive("model")
    assert read.record.created_ns == 1 and read.record.entries == 3
    assert [e.name for e in read.entries] == ["old.0", "old.1", "old.2"]
    monkeypatch.undo()
    read = a.read_archive("model", ["new.4", "new.0", "old.0"])
    assert read.record.version == "2" and [e.name for e in read.entries] == ["new.0", "new.4"]
    assert a.read_archive("model", entries=False).entries == [] and a.read_archive("nothing") is None


# Leases and collection -----------------------------------------------------------------


def _never_remove(digest):
    raise AssertionError(f"removed {digest}, which is not collectable")


def test_a_lease_renewed_after_a_collection_claimed_its_blob_cannot_commit(catalog):
    """Claim, delete, forget (issue 43): the delete runs outside any transaction, so a holder
    whose lease expired, let the claim in, and was renewed meanwhile must not commit."""
    blob, now = _blob(1), time.time_ns()
    catalog.lease(blob, REPLICA, HOLDER, now + 1 * SECOND)
    expired, later = now + 2 * SECOND, now + 3600 * SECOND
    refused = []

    def remove_while_the_holder_renews_and_commits(digest: str) -> None:
        catalog.renew_leases(REPLICA, time.time_ns() + 60 * SECOND)
        with pytest.raises(StorageUnavailable, match=f"blob {digest} was collected \\(or is being\\)"):
            catalog.commit_leased("m", [_entry("w", blob)], False, now, REPLICA, HOLDER, time.time_ns())
        refused.append(digest)

    assert catalog.collect_blob(blob.digest, later, expired, remove_while_the_holder_renews_and_commits) is True
    assert refused == [blob.digest] and catalog.archive("m") is None and catalog.blob(blob.digest) is None


def test_a_failed_removal_leaves_the_row_unclaimed_and_collectable_again(catalog):
    blob, now = _blob(2), time.time_ns()
    catalog.lease(blob, REPLICA, HOLDER, now)  # expired at once
    later = now + 3600 * SECOND

    def refuse(digest: str) -> None:
        raise OSError(f"the bucket refused {digest}")

    with pytest.raises(OSError, match="refused"):
        catalog.collect_blob(blob.digest, later, later, refuse)
    assert catalog.blob(blob.digest) == blob
    assert catalog.collectable(later, later, 10) == [blob.digest]
    assert catalog.collectable(later, later, 10, skip=[blob.digest]) == []
    assert catalog.lease(blob, REPLICA, "store-2", later) is True, "the bytes are still there"


def test_a_leased_blob_is_kept_until_its_lease_expires(catalog):
    blob, now = _blob(1), time.time_ns()
    assert catalog.lease(blob, REPLICA, HOLDER, now + 60 * SECOND) is False  # a new row
    assert catalog.lease(blob, REPLICA, "store-2", now + 60 * SECOND) is True  # it was there
    later = now + 3600 * SECOND  # far past the grace period, not past the leases
    assert catalog.blob(blob.digest) == blob
    assert catalog.collectable(later, now, 10) == []
    assert catalog.collect_blob(blob.digest, later, now, _never_remove) is False
    # Past both leases' expiry: collectable, and collected with its bytes.
    expired = now + 61 * SECOND
    assert catalog.collectable(later, expired, 10) == [blob.digest]
    removed = []
    assert catalog.collect_blob(blob.digest, later, expired, removed.append) is True
    assert removed == [blob.digest] and catalog.blob(blob.digest) is None
    # Its leases went with the row: the holder cannot commit it.
    with pytest.raises(StorageUnavailable, match=f"blob {blob.digest} was collected"):
        catalog.commit_leased("x", [_entry("w", blob)], False, 1, REPLICA, HOLDER, expired)
    assert catalog.lease(blob, REPLICA, HOLDER, expired + SECOND) is False  # gone: store it again


def test_renewal_extends_a_replicas_leases(catalog):
    now = time.time_ns()
    for n in (1, 2):
        catalog.lease(_blob(n), REPLICA, f"store-{n}", now + SECOND)
    catalog.lease(_blob(3), "replica-b", HOLDER, now + SECOND)
    assert catalog.renew_leases(REPLICA, now + 60 * SECOND) == 2
    later, past_first_expiry = now + 3600 * SECOND, now + 2 * SECOND
    assert catalog.collectable(later, past_first_expiry, 10) == [_blob(3).digest]  # replica-b's was not renewed
    assert catalog.collect_blob(_blob(1).digest, later, past_first_expiry, _never_remove) is False
    # A renewal never shortens a lease.
    catalog.renew_leases(REPLICA, now)
    assert catalog.collectable(later, past_first_expiry, 10) == [_blob(3).digest]


def test_dropping_leases_touches_their_blobs(catalog):
    blob = _blob(1)
    catalog.lease(blob, REPLICA, HOLDER, time.time_ns() + 60 * SECOND)
    catalog.lease(_blob(2), REPLICA, "other", time.time_ns() + 60 * SECOND)
    before_drop = time.time_ns()
    time.sleep(0.01)
    catalog.drop_leases(REPLICA, HOLDER)
    after_drop = time.time_ns()
    # The lease is gone (collectable at once when the grace period allows), and the grace
    # period starts at the drop: the blob is not collectable for a cut-off before it.
    assert catalog.collectable(after_drop + 1, after_drop, 10) == [blob.digest]
    assert catalog.collectable(before_drop, after_drop, 10) == []
    assert catalog.collect_blob(blob.digest, before_drop, after_drop, _never_remove) is False


def test_commit_leased_commits_only_with_live_leases_and_drops_them(catalog):
    one, two, three = _blob(1), _blob(2), _blob(3)
    now = time.time_ns()
    catalog.lease(one, REPLICA, HOLDER, now + 10 * SECOND)
    catalog.lease(two, REPLICA, HOLDER, now + 60 * SECOND)
    # Past the first lease's expiry: refused, naming the blob, and nothing committed.
    with pytest.raises(StorageUnavailable, match=f"archive 'x' not committed: blob {one.digest} has no live lease"):
        catalog.commit_leased("x", [_entry("w", two), _entry("v", one)], False, 1, REPLICA, HOLDER, now + 11 * SECOND)
    assert catalog.archive("x") is None and catalog.referenced_digests() == set()
    # A lease of another holder does not count.
    catalog.lease(three, REPLICA, "other", now + 60 * SECOND)
    with pytest.raises(StorageUnavailable, match=f"blob {three.digest} has no live lease"):
        catalog.commit_leased("x", [_entry("w", three)], False, 1, REPLICA, HOLDER, now)
    record, released = catalog.commit_leased("x", [_entry("w", two), _entry("v", one)], False, 1, REPLICA, HOLDER,
                                             now + SECOND)
    assert (record.name, record.entries, released) == ("x", 2, [])
    # The holder's leases are gone; the committed blobs are referenced, so not collectable.
    later = now + 3600 * SECOND
    assert catalog.collectable(later, now, 10) == []  # three is still leased by "other"
    with pytest.raises(ArchiveExists, match="archive 'x' already exists"):
        catalog.commit_leased("x", [_entry("w", two)], False, 2, REPLICA, HOLDER, now)
    # Replaced by a commit of another holder: one and two lose their last reference, and their
    # grace period starts then.
    before_replace = time.time_ns()
    record, released = catalog.commit_leased("x", [_entry("w", three)], True, 3, REPLICA, "other", time.time_ns())
    assert record.entries == 1 and released == sorted([one.digest, two.digest])
    assert sorted(catalog.collectable(later, now, 10)) == sorted([one.digest, two.digest])
    assert catalog.collectable(before_replace, now, 10) == []


def test_a_database_in_sql_ascii_commits_leased_blobs(postgres_server):
    """A database in SQL_ASCII, which ``initdb`` makes where no UTF-8 locale is set (a minimal
    container's PostgreSQL), hands text back as bytes unless the client asks for UTF8: the
    leased digests then never matched, and every Store of a replica failed with "was collected"."""
    name = f"test_ascii_{time.time_ns()}"
    url = postgres_server.create_database(name, encoding="SQL_ASCII")
    catalog = PostgresCatalog(url)
    try:
        with psycopg.connect(url) as conn:  # a plain connection: text comes back as bytes
            assert conn.execute("SHOW server_encoding").fetchone() == (b"SQL_ASCII",)
        blob, now = _blob(7), time.time_ns()
        assert catalog.lease(blob, REPLICA, HOLDER, now + 60 * SECOND) is False
        record, _ = catalog.commit_leased("ascii", [_entry("w", blob)], False, 1, REPLICA, HOLDER, now)
        assert record.entries == 1 and catalog.archive("ascii").name == "ascii"
        assert catalog.referenced_digests() == {blob.digest}
    finally:
        catalog.close()
        postgres_server.drop_database(name)


def test_an_archive_deleted_or_replaced_starts_the_grace_period_of_its_blobs(catalog):
    one, two = _blob(1), _blob(2)
    catalog.commit_archive("a", [_entry("w", one)], [one], False, 1)
    catalog.commit_archive("b", [_entry("w", two)], [two], False, 1)
    time.sleep(0.01)
    before, now = time.time_ns(), time.time_ns()
    catalog.delete_archive("a")
    catalog.union("b", [("b", "old")], True, 2, LIMITS)  # replaced, still referencing two
    assert catalog.collectable(before, now, 10) == []
    assert catalog.collectable(time.time_ns(), now, 10) == [one.digest]
    catalog.delete_archive("b")
    assert catalog.collectable(before, now, 10) == []
    assert sorted(catalog.collectable(time.time_ns(), now, 10)) == [one.digest, two.digest]


def test_collection_and_a_lease_of_one_blob_at_once_are_ordered(catalog):
    """The lease either comes first (nothing collected) or finds no row (the caller uploads
    again): never a lease on a blob whose bytes were removed."""
    blob = _blob(1)
    now = time.time_ns()
    catalog.lease(blob, REPLICA, "old", now)  # expired at once: collectable
    later = now + 3600 * SECOND
    removing = threading.Event()
    removed_at: list[int] = []

    def slow_remove(digest):
        removing.set()
        time.sleep(0.3)  # the lease below must wait for the row's lock meanwhile
        removed_at.append(time.monotonic_ns())

    with ThreadPoolExecutor(1) as pool:
        collected = pool.submit(catalog.collect_blob, blob.digest, later, time.time_ns(), slow_remove)
        assert removing.wait(10)
        existed = catalog.lease(blob, REPLICA, HOLDER, time.time_ns() + 60 * SECOND)
        leased_at = time.monotonic_ns()
        assert collected.result() is True
    assert existed is False, "the lease found the row that was being collected"
    assert leased_at > removed_at[0]
    assert catalog.blob(blob.digest) == blob  # the lease's own row, for the blob uploaded again

    # Racing freely: whichever comes first, the outcome is one of the two orders.
    for n in range(2, 8):
        blob = _blob(n)
        catalog.lease(blob, REPLICA, "old", now)
        removed = []
        collected, existed = _at_once(
            lambda: catalog.collect_blob(blob.digest, later, time.time_ns(), removed.append),
            lambda: catalog.lease(blob, REPLICA, HOLDER, time.time_ns() + 60 * SECOND),
        )
        assert (collected, existed) in ((True, False), (False, True)), (collected, existed)
        assert removed == ([blob.digest] if collected else [])
        assert catalog.collect_blob(blob.digest, later, time.time_ns(), _never_remove) is False  # leased now


def test_an_exception_from_remove_keeps_the_row(catalog):
    blob = _blob(1)
    catalog.lease(blob, REPLICA, HOLDER, 0)

    def failing_remove(digest):
        raise OSError(f"cannot remove {digest}")

    with pytest.raises(OSError, match="cannot remove"):
        catalog.collect_blob(blob.digest, time.time_ns() + SECOND, time.time_ns(), failing_remove)
    assert catalog.blob(blob.digest) == blob


# PostgreSQL down and back ----------------------------------------------------------------


def test_a_stopped_postgresql_is_unavailable_and_the_catalog_recovers_without_reopening(postgres_server,
                                                                                        postgres_url):
    parts = urlsplit(postgres_url)
    with_password = urlunsplit(parts._replace(netloc=f"postgres:sekrit@{parts.hostname}:{parts.port}"))
    shown = f"postgresql://postgres@{parts.hostname}:{parts.port}{parts.path}"
    catalog = PostgresCatalog(with_password, timeout=0.5)
    try:
        catalog.commit_archive("a", [_entry("w", _blob(1))], [_blob(1)], False, 1)
        postgres_server.stop()
        try:
            failures = []
            for call in (lambda: catalog.archive("a"), catalog.check,
                         lambda: catalog.commit_archive("b", [_entry("w", _blob(2))], [_blob(2)], False, 2),
                         lambda: catalog.lease(_blob(3), REPLICA, HOLDER, time.time_ns())):
                with pytest.raises(StorageUnavailable) as caught:
                    call()
                failures.append(str(caught.value))
            for message in failures:
                assert message.startswith(f"catalog {shown} unreachable: connection refused"), message
                assert "sekrit" not in message
            assert "(reading archive 'a')" in failures[0] and "(committing archive 'b')" in failures[2]
            # A replica starting meanwhile fails the same way (and leaves no pool behind).
            with pytest.raises(StorageUnavailable, match=f"catalog {shown} unreachable: connection refused"):
                PostgresCatalog(with_password, timeout=0.5)
        finally:
            postgres_server.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                catalog.check()
                break
            except StorageUnavailable:
                assert time.monotonic() < deadline, "the catalog did not recover within 20 s"
                time.sleep(0.1)
        assert catalog.archive("a").entries == 1
        record, _ = catalog.commit_archive("b", [_entry("w", _blob(2))], [_blob(2)], False, 2)
        assert record.name == "b" and catalog.archive("b") == record
    finally:
        catalog.close()


def test_a_connection_lost_between_calls_is_replaced(catalog, postgres_url):
    """A restart of PostgreSQL between two calls: the pool's check finds the connection
    broken and the next call runs on a new one (no error at all)."""
    catalog.commit_archive("a", [_entry("w", _blob(1))], [_blob(1)], False, 1)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    assert catalog.archive("a").entries == 1
    catalog.commit_archive("b", [_entry("w", _blob(1))], [_blob(1)], False, 2)


def test_a_closed_catalog_says_so(catalog):
    catalog.close()
    with pytest.raises(StorageUnavailable, match="catalog postgresql://.* is closed"):
        catalog.archive("a")


# Schema version 2: archives.metadata ---------------------------------------------------------


def test_a_version_1_catalog_gets_the_metadata_column(postgres_url):
    from tannery_server.storage import postgres_schema

    with psycopg.connect(postgres_url) as conn:  # the schema as version 1 left it, with an archive
        with conn.cursor() as cur:
            postgres_schema._to_version_1(cur)
            cur.execute("CREATE TABLE schema_version (version integer NOT NULL)")
            cur.execute("INSERT INTO schema_version (version) VALUES (1)")
            cur.execute("INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes) "
                        "VALUES ('old', 1, 0, 0, 0)")
    assert SCHEMA_VERSION == 7
    catalog = PostgresCatalog(postgres_url)
    try:
        assert catalog.archive("old").metadata == {}
        record, _ = catalog.commit_archive("new", [_entry("w", _blob(1))], [_blob(1)], False, 2, {"format": "pt"})
        assert record.metadata == {"format": "pt"}
        union, _ = catalog.union("both", [("old", ""), ("new", "")], False, 3, LIMITS, {"k": "ü"})
        assert catalog.archive("both").metadata == union.metadata == {"k": "ü"}
        assert catalog.lease(_blob(2), REPLICA, HOLDER, time.time_ns() + 60 * SECOND) is False
        catalog.commit_leased("leased", [_entry("w", _blob(2))], False, 4, REPLICA, HOLDER, time.time_ns(),
                              {"a": "b"})
        assert [a.metadata for a in catalog.list_archives("", "", 10)] == [{"k": "ü"}, {"a": "b"}, {"format": "pt"}, {}]
    finally:
        catalog.close()
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


# Schema version 3: packs (entries.blob, entries.blob_offset, entries.digest) ---------------------


def test_a_version_2_catalog_keeps_its_entries_each_in_its_own_blob(postgres_url):
    from tannery_server.storage import postgres_schema

    blob = _blob(7)
    with psycopg.connect(postgres_url) as conn:  # the schema as version 2 left it, with an entry
        with conn.cursor() as cur:
            postgres_schema._to_version_1(cur)
            postgres_schema._to_version_2(cur)
            cur.execute("CREATE TABLE schema_version (version integer NOT NULL)")
            cur.execute("INSERT INTO schema_version (version) VALUES (2)")
            cur.execute("INSERT INTO archives (id, name, created_ns, entries, nbytes, payload_bytes) "
                        "VALUES (1, 'old', 1, 1, 5, 5)")
            cur.execute("INSERT INTO blobs (digest, size, block_size, block_crcs, checksum, touched_ns) "
                        "VALUES (%s, %s, %s, %s, %s, 0)", (blob.digest, blob.size, blob.block_size, blob.block_crcs,
                                                          blob.checksum))
            cur.execute("INSERT INTO entries (archive_id, name, dtype, shape, nbytes, payload_bytes, data_offset, "
                        "digest) VALUES (1, 'w', 'uint8', '[5]', 5, 5, 0, %s)", (blob.digest,))
    catalog = PostgresCatalog(postgres_url)
    try:
        (entry,) = catalog.entries_under("old", "")
        assert (entry.digest, entry.blob, entry.blob_offset, entry.packed) == (blob.digest, blob.digest, 0, False)
        assert catalog.referrers(blob.digest) == [("old", "w")]
        assert catalog.unreferenced([blob.digest]) == []
        _, released = catalog.delete_archive("old")
        assert released == [blob.digest] and catalog.unreferenced([blob.digest]) == [blob]
    finally:
        catalog.close()
