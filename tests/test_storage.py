"""The storage layer on its own: checksums, the SQLite catalog, blob files, collection, recovery."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from pathlib import Path

import crc32c
import pytest

from tannery_server.storage import (ArchiveExists, ArchiveLimits, BlobInfo, CatalogTotals, DataDirectoryInUse, EntryRecord,
                                    InvalidRequest, NoSuchArchive, Storage, TooManyEntries)
from tannery_server.storage.integrity import PayloadDigest
from tannery_server.storage.sqlite_catalog import SqliteCatalog

LIMITS = ArchiveLimits(max_entries=1000, max_name_bytes=64)


@pytest.mark.parametrize("algorithm, reference", [("crc32c", crc32c.crc32c), ("crc32", zlib.crc32)])
def test_payload_digest_matches_sha256_and_block_crcs_for_any_piece_sizes(algorithm, reference):
    data = os.urandom(3 * 1000 + 17)
    digest = PayloadDigest(block_size=1000, **({} if algorithm == "crc32c" else {"algorithm": algorithm}))
    for start, stop in ((0, 1), (1, 999), (999, 2500), (2500, 2500), (2500, len(data))):
        digest.update(memoryview(data)[start:stop])
    blob = digest.finish()
    assert blob.digest == hashlib.sha256(data).hexdigest()
    assert blob.size == len(data)
    assert blob.blocks == 4
    assert blob.checksum == algorithm
    for index in range(4):
        assert blob.crc(index) == reference(data[index * 1000 : (index + 1) * 1000])


def test_a_payload_written_in_pieces_on_either_side_of_the_parallel_size_is_hashed_and_stored_whole(tmp_path):
    """Pieces from ``PARALLEL_FROM`` are hashed on another thread while they are written; the
    blob, its SHA-256 and its block CRCs are those of the bytes whatever the pieces were."""
    from tannery_server.storage.payload_writer import PARALLEL_FROM

    storage = Storage.open_local(tmp_path / "data")
    try:
        data = os.urandom(3 * PARALLEL_FROM + 4097)
        cuts = [0, 10, PARALLEL_FROM - 1 + 10, 2 * PARALLEL_FROM + 10, 2 * PARALLEL_FROM + 11, len(data)]
        writer = storage.new_payload()
        for start, stop in zip(cuts, cuts[1:]):
            writer.write(memoryview(data)[start:stop])
        blob = storage.seal(writer)
        assert blob.digest == hashlib.sha256(data).hexdigest() and blob.size == len(data)
        for index in range(blob.blocks):
            block = data[index * blob.block_size : (index + 1) * blob.block_size]
            assert blob.crc(index) == crc32c.crc32c(block), index
        assert (tmp_path / "data" / "blobs" / blob.digest[:2] / blob.digest).read_bytes() == data
        storage.release([blob.digest], collect=True)
    finally:
        storage.close()


def _store(storage: Storage, name: str, payloads: dict[str, bytes], replace: bool = False):
    entries, blobs = [], []
    for entry, data in payloads.items():
        writer = storage.new_payload()
        writer.write(data)
        blob = storage.seal(writer)
        blobs.append(blob)
        entries.append(EntryRecord(entry, "uint8", (len(data),), len(data), len(data), 0, blob.digest))
    try:
        record = storage.commit_archive(name, entries, blobs, replace)
    except BaseException:
        storage.release((b.digest for b in blobs), collect=True)  # as a failed Store does
        raise
    storage.release(b.digest for b in blobs)
    return record


def _blob_files(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "blobs").glob("*/*")}


@pytest.fixture
def storage(tmp_path):
    storage = Storage.open_local(tmp_path / "data")
    yield storage
    storage.close()


def test_equal_payloads_are_stored_once_and_collected_when_unreferenced(storage, tmp_path):
    data_dir = tmp_path / "data"
    _store(storage, "a", {"x": b"same", "y": b"only-a"})
    _store(storage, "b", {"z": b"same"})
    assert len(_blob_files(data_dir)) == 2
    record, collected = storage.delete("a")
    assert record.name == "a" and collected.blobs == 1 and collected.bytes == len(b"only-a")
    assert _blob_files(data_dir) == {hashlib.sha256(b"same").hexdigest()}
    storage.delete("b")
    assert _blob_files(data_dir) == set()


def test_a_pinned_blob_is_not_collected_until_released(storage, tmp_path):
    _store(storage, "a", {"x": b"payload"})
    digest = hashlib.sha256(b"payload").hexdigest()
    # A Store in flight that found the blob already there pins it...
    storage.pinned(lambda: [digest], lambda digests: digests)
    storage.delete("a")
    assert digest in _blob_files(tmp_path / "data"), "collected under a pin"
    # ...and commits its archive: the blob is referenced again, nothing to collect.
    storage.release([digest])
    assert digest not in _blob_files(tmp_path / "data"), "a deferred collection must run on release"


def test_replace_collects_the_old_blobs(storage, tmp_path):
    _store(storage, "a", {"x": b"old"})
    _store(storage, "a", {"x": b"new"}, replace=True)
    assert _blob_files(tmp_path / "data") == {hashlib.sha256(b"new").hexdigest()}
    with pytest.raises(ArchiveExists, match="archive 'a' already exists"):
        _store(storage, "a", {"x": b"newer"})
    assert _blob_files(tmp_path / "data") == {hashlib.sha256(b"new").hexdigest()}


def test_recovery_removes_temporary_files_and_unreferenced_blobs(tmp_path):
    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    _store(storage, "kept", {"x": b"kept"})
    # What a crash leaves: a half-written temporary file, and a blob published by a Store
    # that never committed.
    writer = storage.new_payload()
    writer.write(b"half")
    orphan = storage.new_payload()
    orphan.write(b"orphan")
    storage.seal(orphan)
    storage.close()
    assert len(list((data_dir / "tmp").iterdir())) == 1
    storage = Storage.open_local(data_dir)
    try:
        assert list((data_dir / "tmp").iterdir()) == []
        assert _blob_files(data_dir) == {hashlib.sha256(b"kept").hexdigest()}
        assert storage.catalog.archive("kept").entries == 1
    finally:
        storage.close()


def test_one_storage_per_data_directory(storage, tmp_path):
    with pytest.raises(DataDirectoryInUse, match=f"pid {os.getpid()}"):
        Storage.open_local(tmp_path / "data")


def _entry(name: str, digest: str = "0" * 64) -> EntryRecord:
    return EntryRecord(name, "float32", (1,), 4, 41, 37, digest)


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request, tmp_path):
    """Each catalog test runs on the embedded catalog and on the shared one (PostgreSQL)."""
    if request.param == "sqlite":
        catalog = SqliteCatalog(tmp_path / "catalog.sqlite3")
    else:
        from tannery_server.storage.postgres_catalog import PostgresCatalog

        catalog = PostgresCatalog(request.getfixturevalue("postgres_url"))
    yield catalog
    catalog.close()


def _blob(digest: str = "0" * 64, size: int = 41) -> BlobInfo:
    return BlobInfo(digest, size, 1 << 20, struct.pack("<I", 0))


def _commit(catalog, name, names):
    return catalog.commit_archive(name, [_entry(n) for n in names], [_blob()], False, 1)


def test_entries_under_follows_the_owned_names_rule(catalog):
    names = ["model", "model.w", "model.blocks.0.w", "model-x", "model/x", "models.w", "model0", "other"]
    _commit(catalog, "a", names)
    assert [e.name for e in catalog.entries_under("a", "model")] == ["model", "model.blocks.0.w", "model.w"]
    assert [e.name for e in catalog.entries_under("a", "")] == sorted(names)
    assert catalog.entries_under("a", "nothing") == []


def test_union_is_one_transaction_and_names_a_duplicate(catalog):
    _commit(catalog, "a", ["w", "b"])
    _commit(catalog, "c", ["w"])
    record, _ = catalog.union("u", [("a", "model"), ("c", "")], False, 2, LIMITS)
    assert (record.name, record.entries) == ("u", 3)
    assert [e.name for e in catalog.entries_under("u", "")] == ["model.b", "model.w", "w"]
    with pytest.raises(InvalidRequest, match="union: 'w' is in two sources, 'a' and 'c'"):
        catalog.union("v", [("a", ""), ("c", "")], False, 3, LIMITS)
    assert catalog.archive("v") is None
    assert [a.name for a in catalog.list_archives("", "", 10)] == ["a", "c", "u"]
    with pytest.raises(NoSuchArchive, match="archive 'absent' not found"):
        catalog.union("v", [("absent", "")], False, 3, LIMITS)
    with pytest.raises(TooManyEntries, match="3 entries, over the limit of 2"):
        catalog.union("v", [("a", ""), ("c", "x")], False, 3, ArchiveLimits(2, 64))
    with pytest.raises(InvalidRequest, match="over the limit of 8"):
        catalog.union("v", [("a", "long-prefix")], False, 3, ArchiveLimits(10, 8))
    assert catalog.archive("v") is None


def test_union_may_replace_one_of_its_sources(catalog):
    _commit(catalog, "a", ["w"])
    _commit(catalog, "b", ["v"])
    record, released = catalog.union("a", [("a", "old"), ("b", "")], True, 5, LIMITS)
    assert record.entries == 2 and released == ["0" * 64]
    assert [e.name for e in catalog.entries_under("a", "")] == ["old.w", "v"]


def test_list_archives_pages_by_name_within_a_prefix(catalog):
    for name in ["run/1", "run/2", "run/3", "runs", "other"]:
        _commit(catalog, name, ["w"])
    assert [a.name for a in catalog.list_archives("run/", "", 2)] == ["run/1", "run/2"]
    assert [a.name for a in catalog.list_archives("run/", "run/2", 2)] == ["run/3"]
    assert [a.name for a in catalog.list_archives("", "", 10)] == ["other", "run/1", "run/2", "run/3", "runs"]


def test_commit_refuses_a_taken_name_and_replace_returns_what_the_old_archive_referenced(catalog):
    one, two = "1" * 64, "2" * 64
    record, released = catalog.commit_archive("a", [_entry("w", one), _entry("v", one)], [_blob(one)], False, 7)
    assert (record.name, record.entries, record.nbytes, record.payload_bytes, record.created_ns) == ("a", 2, 8, 82, 7)
    assert released == []
    with pytest.raises(ArchiveExists, match="archive 'a' already exists"):
        catalog.commit_archive("a", [_entry("w", two)], [_blob(two)], False, 8)
    assert catalog.entries("a", ["w"])["w"].digest == one
    record, released = catalog.commit_archive("a", [_entry("x", two)], [_blob(two)], True, 9)
    assert (record.entries, record.created_ns, released) == (1, 9, [one])
    assert list(catalog.entries("a", ["w", "x", "x", "absent"])) == ["x"]
    assert catalog.blob(one) == _blob(one) and catalog.blob("f" * 64) is None


def test_delete_and_the_bookkeeping_of_unreferenced_blobs(catalog):
    one, two, three = "1" * 64, "2" * 64, "3" * 64
    catalog.commit_archive("a", [_entry("x", one), _entry("y", two)], [_blob(one, 10), _blob(two, 20)], False, 1)
    catalog.commit_archive("b", [_entry("z", two)], [_blob(two, 20)], False, 2)
    assert catalog.referenced_digests() == {one, two}
    assert catalog.referrers(two) == [("a", "y"), ("b", "z")]
    assert catalog.totals() == CatalogTotals(archives=2, archive_bytes=3 * 41, blobs=2, blob_bytes=30)
    record, released = catalog.delete_archive("a")
    assert record.name == "a" and sorted(released) == [one, two]
    assert catalog.delete_archive("a") == (None, [])
    # one is recorded and unreferenced; two is referenced by b; three was never recorded.
    assert catalog.unreferenced([three, one, two, one]) == [BlobInfo(three, 0, 0, b""), _blob(one, 10)]
    catalog.forget_blobs([one, two])
    assert catalog.blob(one) is None and catalog.blob(two) is not None
    catalog.delete_archive("b")
    assert catalog.referrers(two) == [] and catalog.referenced_digests() == set()
    assert catalog.forget_unreferenced_blobs() == 1
    assert catalog.totals() == CatalogTotals(0, 0, 0, 0)
