"""Block checksums moved from zlib CRC-32 to CRC-32C: a data directory written before (the
first catalog schema, zlib CRC-32 blocks) is migrated when it is opened and serves its old
blobs with their old checks, beside new blobs with CRC-32C."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
import zlib
from pathlib import Path

import crc32c
import grpc
import pytest
import torch

from tannery_protocol.codec import read_info
from tannery.torch import deserialize, serialize
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server import cli
from tannery_server.storage import BlobInfo, CatalogTooNew, EntryRecord, Storage
from tannery_server.storage import sqlite_catalog
from tannery_server.storage.sqlite_catalog import SqliteCatalog

from .server_harness import collect_fetch, running_server

MiB = 1 << 20

#: The catalog schema as tannery wrote it before the checksum column (kept here verbatim, not
#: imported: it is what an old data directory holds).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS archives (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_ns INTEGER NOT NULL,
    entries INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    block_size INTEGER NOT NULL,
    block_crcs BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS entries (
    archive_id INTEGER NOT NULL REFERENCES archives(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    data_offset INTEGER NOT NULL,
    digest TEXT NOT NULL REFERENCES blobs(digest),
    PRIMARY KEY (archive_id, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_digest ON entries(digest);
"""

TABLE = torch.randn(3000, 257, generator=torch.Generator().manual_seed(21))  # 3 MB: 3 checksum blocks
SMALL = torch.arange(10, dtype=torch.int64)


def zlib_block_crcs(data: bytes, block_size: int = MiB) -> bytes:
    return b"".join(struct.pack("<I", zlib.crc32(data[i : i + block_size])) for i in range(0, len(data), block_size))


def write_old_data_dir(data_dir: Path, archives: dict[str, dict[str, bytes]]) -> None:
    """A data directory as tannery wrote it before CRC-32C: blob files, and a catalog of the first
    schema (no version, no checksum column) whose block checksums are zlib CRC-32s."""
    data_dir.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(data_dir / "catalog.sqlite3", isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(OLD_SCHEMA)
        for created_ns, (archive, payloads) in enumerate(archives.items(), 1):
            archive_id = conn.execute(
                "INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes) VALUES (?, ?, 0, 0, 0)",
                (archive, created_ns),
            ).lastrowid
            for name, payload in payloads.items():
                digest = hashlib.sha256(payload).hexdigest()
                path = data_dir / "blobs" / digest[:2] / digest
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(payload)
                conn.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)",
                             (digest, len(payload), MiB, zlib_block_crcs(payload)))
                info = read_info(payload)
                conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (archive_id, name, info.dtype.name, json.dumps(list(info.shape)), info.nbytes,
                              info.size, info.data_offset, digest))
            conn.execute(
                "UPDATE archives SET (entries, nbytes, payload_bytes) = (SELECT count(*), sum(nbytes), "
                "sum(payload_bytes) FROM entries WHERE archive_id = ?1) WHERE id = ?1", (archive_id,))
    finally:
        conn.close()


def sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def blob_path(data_dir: Path, digest: str) -> Path:
    return data_dir / "blobs" / digest[:2] / digest


def flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x08]))


def schema(path: Path) -> tuple[int, list[tuple], list]:
    """The catalog's version, its blobs table's columns, and every object's SQL."""
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        columns = conn.execute("PRAGMA table_info(blobs)").fetchall()
        objects = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        return version, columns, objects
    finally:
        conn.close()


def checksum_column(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT digest, checksum FROM blobs"))
    finally:
        conn.close()


# The catalog on its own ------------------------------------------------------------------


def test_an_old_catalog_is_migrated_at_open_and_keeps_its_zlib_crcs(tmp_path):
    table = serialize(TABLE)
    write_old_data_dir(tmp_path, {"old": {"emb": table}})
    path = tmp_path / "catalog.sqlite3"
    assert schema(path)[0] == 0

    catalog = SqliteCatalog(path)
    try:
        blob = catalog.blob(sha(table))
        assert blob == BlobInfo(sha(table), len(table), MiB, zlib_block_crcs(table), "crc32")
        new = BlobInfo("1" * 64, 5, MiB, struct.pack("<I", crc32c.crc32c(b"hello")))
        catalog.commit_archive("new", [EntryRecord("w", "uint8", (5,), 5, 5, 0, new.digest)], [new], False, 2)
        assert catalog.blob(new.digest).checksum == "crc32c"
    finally:
        catalog.close()
    version, columns, objects = schema(path)
    assert version == sqlite_catalog.SCHEMA_VERSION == 6
    assert any(name == "aliases" for _type, name, _sql in objects)  # version 4: aliases
    assert any(name == "alias_moves" for _type, name, _sql in objects)  # version 5: their history
    assert any(name == "lost_blobs" for _type, name, _sql in objects)  # version 6: scrub's lost marks
    conn = sqlite3.connect(path)
    try:  # version 3: an old entry's payload is its own blob, from its start (docs/packs.md)
        assert conn.execute("SELECT name, digest, blob, blob_offset FROM entries").fetchall() == [
            ("emb", sha(table), sha(table), 0), ("w", "1" * 64, "1" * 64, 0)]
    finally:
        conn.close()
    column = {c[1]: c for c in columns}["checksum"]
    assert (column[2], column[3], column[4]) == ("TEXT", 1, "'crc32'")  # type, NOT NULL, default
    assert checksum_column(path) == {sha(table): "crc32", "1" * 64: "crc32c"}

    # Opening again changes nothing; nor does the step run again on a catalog it already changed.
    SqliteCatalog(path).close()
    assert schema(path) == (version, columns, objects)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 0")
    conn.close()
    SqliteCatalog(path).close()
    assert schema(path) == (version, columns, objects)
    assert checksum_column(path) == {sha(table): "crc32", "1" * 64: "crc32c"}


def test_a_new_catalog_has_the_same_schema_as_a_migrated_one(tmp_path):
    write_old_data_dir(tmp_path / "old", {})
    SqliteCatalog(tmp_path / "old" / "catalog.sqlite3").close()
    SqliteCatalog(tmp_path / "new.sqlite3").close()
    assert schema(tmp_path / "new.sqlite3") == schema(tmp_path / "old" / "catalog.sqlite3")


def test_a_failed_migration_leaves_the_catalog_as_it_was(tmp_path, monkeypatch):
    table = serialize(TABLE)
    write_old_data_dir(tmp_path, {"old": {"emb": table}})
    path = tmp_path / "catalog.sqlite3"
    before = schema(path)

    def failing_step(conn):
        conn.execute("CREATE TABLE half_done (x)")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sqlite_catalog, "MIGRATIONS", (*sqlite_catalog.MIGRATIONS, failing_step))
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        SqliteCatalog(path)
    assert schema(path) == before, "the first step's column and the version were rolled back with it"
    monkeypatch.undo()
    catalog = SqliteCatalog(path)
    try:
        assert catalog.blob(sha(table)).checksum == "crc32"
    finally:
        catalog.close()


def test_a_catalog_of_a_newer_schema_is_refused(tmp_path, capsys):
    data_dir = tmp_path / "data"
    write_old_data_dir(data_dir, {})
    conn = sqlite3.connect(data_dir / "catalog.sqlite3")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(CatalogTooNew, match="catalog schema version 99 is newer than this tannery's \\(6\\)"):
        SqliteCatalog(data_dir / "catalog.sqlite3")
    assert cli.main(["scrub", "--data-dir", str(data_dir)]) == 1
    assert "tannery scrub: " in capsys.readouterr().err
    assert schema(data_dir / "catalog.sqlite3")[0] == 99
    with pytest.raises(CatalogTooNew):
        Storage.open_local(data_dir, reserve_bytes=0)


# A server on an old data directory -------------------------------------------------------


def fetch(stub, archive: str, *asks: pb.EntryAsk) -> dict[str, bytes]:
    return collect_fetch(stub.Fetch(pb.FetchRequest(archive=archive, entries=list(asks))))


def data_loss(stub, archive: str, ask: pb.EntryAsk) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fetch(stub, archive, ask)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value.details()
    return info.value.details()


def test_a_server_on_an_old_data_directory_serves_old_and_new_blobs_with_their_own_checks(tmp_path):
    from .server_harness import store_requests

    data_dir = tmp_path / "data"
    table, small = serialize(TABLE), serialize(SMALL)
    write_old_data_dir(data_dir, {"old": {"emb": table, "small": small}})
    new_table = serialize(TABLE * 2)
    with running_server(tmp_path, data_dir=data_dir, chunk_size=64 * 1024) as srv:
        stub = srv.archives()
        # Old blobs, zlib CRC-32: whole entries and row ranges.
        assert fetch(stub, "old") == {"emb": table, "small": small}
        got = fetch(stub, "old", pb.EntryAsk(name="emb", rows=pb.RowRange(start=2500, stop=2600)))
        assert torch.equal(deserialize(got["emb"]), TABLE[2500:2600])
        # New blobs get CRC-32C; a payload equal to an old blob reuses it, with its CRC-32s.
        stub.Store(store_requests("new", {"emb": new_table, "small": small}))
        assert fetch(stub, "new") == {"emb": new_table, "small": small}
        # A union of old and new blobs.
        stub.Union(pb.UnionRequest(target="u", sources=[pb.UnionSource(archive="old", prefix="a"),
                                                        pb.UnionSource(archive="new", prefix="b")]))
        assert fetch(stub, "u") == {"a.emb": table, "a.small": small, "b.emb": new_table, "b.small": small}
    assert checksum_column(data_dir / "catalog.sqlite3") == {sha(table): "crc32", sha(small): "crc32",
                                                             sha(new_table): "crc32c"}
    storage = Storage.open_local(data_dir, reserve_bytes=0)
    try:
        assert storage.scrub() == []
        assert storage.catalog.blob(sha(new_table)).block_crcs == b"".join(
            struct.pack("<I", crc32c.crc32c(new_table[i : i + MiB])) for i in range(0, len(new_table), MiB))
    finally:
        storage.close()

    # One flipped bit in the third block of each: DATA_LOSS under either algorithm, through
    # the archive that stored it and through the union; other blocks still serve.
    flip_bit(blob_path(data_dir, sha(table)), 2 * MiB + 100)
    flip_bit(blob_path(data_dir, sha(new_table)), 2 * MiB + 200)
    with running_server(tmp_path, data_dir=data_dir, chunk_size=64 * 1024) as srv:
        stub = srv.archives()
        for archive, name, payload in (("old", "emb", table), ("u", "a.emb", table), ("new", "emb", new_table),
                                       ("u", "b.emb", new_table)):
            details = data_loss(stub, archive, pb.EntryAsk(name=name))
            assert details.endswith(f"stored blob {sha(payload)} no longer matches its digest: its checksum in "
                                    f"block 2 differs"), details
            details = data_loss(stub, archive, pb.EntryAsk(name=name, rows=pb.RowRange(start=2500, stop=2600)))
            assert "its checksum in block 2 differs" in details
            got = fetch(stub, archive, pb.EntryAsk(name=name, rows=pb.RowRange(start=10, stop=900)))
            scale = 1 if payload is table else 2
            assert torch.equal(deserialize(got[name]), (TABLE * scale)[10:900])
        assert fetch(stub, "u", pb.EntryAsk(name="a.small")) == {"a.small": small}
    storage = Storage.open_local(data_dir, reserve_bytes=0)
    try:
        assert storage.scrub() == sorted([sha(table), sha(new_table)])
    finally:
        storage.close()


def store_old_and_new(tmp_path: Path, transport: str) -> tuple[Path, str, str]:
    """An old data directory ("old": zlib CRC-32) where ``transport`` then stored "new" (CRC-32C),
    both read back whole and by rows over it; the data directory and the two digests."""
    import tannery

    data_dir = tmp_path / "data"
    write_old_data_dir(data_dir, {"old": {"emb": serialize(TABLE)}})
    with running_server(tmp_path, data_dir=data_dir) as srv:
        with tannery.Client(srv.target, transport=transport) as client:
            assert client.transport == transport
            client.store("new", {"emb": TABLE * 2})
            for archive, scale in (("old", 1), ("new", 2)):
                assert torch.equal(client.fetch(archive).find("emb"), TABLE * scale)
                assert torch.equal(client.archive(archive).rows("emb", 2500, 2600), (TABLE * scale)[2500:2600])
    old, new = sha(serialize(TABLE)), sha(serialize(TABLE * 2))
    assert checksum_column(data_dir / "catalog.sqlite3") == {old: "crc32", new: "crc32c"}
    return data_dir, old, new


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_the_data_paths_serve_old_and_new_blobs(tmp_path, transport):
    store_old_and_new(tmp_path, transport)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_the_data_paths_check_old_and_new_blobs_with_their_own_algorithm(tmp_path, transport):
    """Over ``local`` the client maps the blob and checks its blocks itself (tannery_protocol.checksums,
    with the algorithm the server sends); over ``tcp`` the server checks them before sendfile."""
    import tannery

    data_dir, old, new = store_old_and_new(tmp_path, transport)
    flip_bit(blob_path(data_dir, old), 2 * MiB + 100)
    flip_bit(blob_path(data_dir, new), 2 * MiB + 200)
    with running_server(tmp_path, data_dir=data_dir) as srv:
        with tannery.Client(srv.target, transport=transport) as client:
            for archive, digest, scale in (("old", old, 1), ("new", new, 2)):
                try:
                    client.fetch(archive)
                except tannery.DataLoss as exc:
                    assert str(exc).endswith(f"stored blob {digest} no longer matches its digest: its checksum in "
                                             "block 2 differs"), exc
                except tannery.ServiceError as exc:
                    raise AssertionError(f"not DataLoss: {exc}") from None
                else:
                    raise AssertionError("a corrupted blob was served")
                with pytest.raises(tannery.DataLoss, match="its checksum in block 2 differs"):
                    client.archive(archive).rows("emb", 2500, 2600)
                assert torch.equal(client.archive(archive).rows("emb", 10, 900), (TABLE * scale)[10:900])


# Version 2: archives.metadata --------------------------------------------------------------


def test_an_old_catalog_gets_the_metadata_column_and_its_archives_have_none(tmp_path):
    table = serialize(TABLE)
    write_old_data_dir(tmp_path, {"old": {"emb": table}})
    path = tmp_path / "catalog.sqlite3"
    catalog = SqliteCatalog(path)
    try:
        assert catalog.archive("old").metadata == {}
        blob = BlobInfo("2" * 64, 5, MiB, struct.pack("<I", crc32c.crc32c(b"hello")))
        entry = EntryRecord("w", "uint8", (5,), 5, 5, 0, blob.digest)
        record, _ = catalog.commit_archive("new", [entry], [blob], False, 2, {"format": "pt", "ü": "ß"})
        assert record.metadata == {"format": "pt", "ü": "ß"}
        union, _ = catalog.union("both", [("old", "a"), ("new", "b")], False, 3,
                                 sqlite_catalog.ArchiveLimits(100, 100), {"k": "v"})
        assert union.metadata == {"k": "v"}
        assert [a.metadata for a in catalog.list_archives("", "", 10)] == [{"k": "v"}, {"format": "pt", "ü": "ß"}, {}]
    finally:
        catalog.close()
    conn = sqlite3.connect(path)
    try:
        columns = {c[1]: c for c in conn.execute("PRAGMA table_info(archives)")}
        assert (columns["metadata"][2], columns["metadata"][3], columns["metadata"][4]) == ("TEXT", 1, "'{}'")
    finally:
        conn.close()
    # A catalog at version 1 (the checksum column, no metadata) gets only the new column.
    conn = sqlite3.connect(tmp_path / "v1.sqlite3")
    conn.executescript(OLD_SCHEMA)
    conn.execute("ALTER TABLE blobs ADD COLUMN checksum TEXT NOT NULL DEFAULT 'crc32'")
    conn.execute("INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes) VALUES ('a', 1, 0, 0, 0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    catalog = SqliteCatalog(tmp_path / "v1.sqlite3")
    try:
        assert catalog.archive("a").metadata == {}
    finally:
        catalog.close()
    assert schema(tmp_path / "v1.sqlite3")[0] == 6
