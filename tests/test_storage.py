"""The storage layer on its own: checksums, the SQLite catalog, blob files, collection, recovery."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from pathlib import Path

import crc32c
import pytest

from tannery_server.failures import LimitExceeded, Malformed, Missing, NameTaken
from tannery_server.storage import ArchiveLimits, DataDirectoryInUse, EntryRecord, Storage
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
    with pytest.raises(NameTaken, match="archive 'a' already exists"):
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


@pytest.fixture
def catalog(tmp_path):
    catalog = SqliteCatalog(tmp_path / "catalog.sqlite3")
    yield catalog
    catalog.close()


def _commit(catalog, name, names):
    from tannery_server.storage import BlobInfo

    blob = BlobInfo("0" * 64, 41, 1 << 20, struct.pack("<I", 0))
    return catalog.commit_archive(name, [_entry(n) for n in names], [blob], False, 1)


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
    with pytest.raises(Malformed, match="union: 'w' is in two sources, 'a' and 'c'"):
        catalog.union("v", [("a", ""), ("c", "")], False, 3, LIMITS)
    assert catalog.archive("v") is None
    assert [a.name for a in catalog.list_archives("", "", 10)] == ["a", "c", "u"]
    with pytest.raises(Missing, match="archive 'absent' not found"):
        catalog.union("v", [("absent", "")], False, 3, LIMITS)
    with pytest.raises(LimitExceeded, match="3 entries, over the limit of 2"):
        catalog.union("v", [("a", ""), ("c", "x")], False, 3, ArchiveLimits(2, 64))
    with pytest.raises(Malformed, match="over the limit of 8"):
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
