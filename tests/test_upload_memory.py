"""The upload memory of a bucket store (issue #43), against a real SeaweedFS: payloads held while
there is room, spilled to an unnamed file when there is none, uploaded from it byte-exact, or
streamed from it once as large as a payload that streams; the memory given back every time."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest

from tannery_server.storage.errors import StorageFull
from tannery_server.storage.s3_blobs import S3BlobStore
from tannery_server.storage.upload_memory import MemoryBudget, Spill

MiB = 1 << 20
PART = 5 * MiB


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(s3_url: str, tmp_path):
    """Parts of 5 MiB, two held before a payload streams; 6 MiB of upload memory."""
    blobs = S3BlobStore(s3_url, part_size=PART, parts_in_flight=2, range_size=MiB, memory=MemoryBudget(6 * MiB),
                        spill_dir=tmp_path / "spill")
    yield blobs
    blobs.close()


def write(store: S3BlobStore, data: bytes, expected: str | None = None, piece: int = MiB):
    temp = store.create(expected)
    for at in range(0, len(data), piece):
        temp.write(memoryview(data)[at:at + piece])
    return temp


def read_back(store: S3BlobStore, digest: str, size: int) -> bytes:
    return store.open(digest).read(0, size)


def test_payloads_are_held_while_there_is_room_and_spill_when_there_is_none(store, tmp_path):
    first, second = os.urandom(4 * MiB), os.urandom(4 * MiB + 3)
    held = write(store, first)
    assert store.memory.used == 4 * MiB and store.memory.spills == 0
    spilled = write(store, second)  # 2 MiB of room left: it spills, and gives back what it held
    assert store.memory.used == 4 * MiB and store.memory.spills == 1
    assert list((tmp_path / "spill").iterdir()) == []  # unnamed: nothing to leave behind
    assert spilled.seal(digest_of(second)) and held.seal(digest_of(first))
    assert store.memory.used == 0
    assert read_back(store, digest_of(first), len(first)) == first
    assert read_back(store, digest_of(second), len(second)) == second
    assert not any(key.startswith(f"{store.prefix}tmp/") for key in _keys(store))  # straight to their digests


@pytest.mark.parametrize("ahead", [False, True])
def test_a_spilled_payload_as_large_as_one_that_streams_streams_from_its_file(store, ahead):
    blocker = write(store, os.urandom(6 * MiB))  # takes all the memory
    data = os.urandom(4 * PART + 12345)  # past the 3 parts (2 held + 1 filling) a payload streams from
    temp = write(store, data, digest_of(data) if ahead else None, piece=3 * MiB + 1)
    assert store.memory.spills == 1 and store.memory.used == 6 * MiB
    assert temp.seal(digest_of(data))
    assert read_back(store, digest_of(data), len(data)) == data
    blocker.discard()
    assert store.memory.used == 0
    again = write(store, data, digest_of(data) if ahead else None)  # equal bytes: stored once
    assert not again.seal(digest_of(data))
    assert store.memory.used == 0


def test_a_discarded_spilled_payload_leaves_nothing(store):
    blocker = write(store, os.urandom(6 * MiB))
    temp = write(store, os.urandom(2 * MiB))
    assert store.memory.spills == 1
    temp.discard()
    blocker.discard()
    assert store.memory.used == 0 and store.temporaries() == []


def test_no_room_to_spill_is_storage_full_naming_the_directory_and_the_remedy(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    spill = Spill(tmp_path)
    with pytest.raises(StorageFull, match=f"no room in {tmp_path} for a payload spilled there on its way to the "
                                          "bucket .No space left on device.: free space there, or give the server "
                                          "more --upload-memory"):
        spill.write(b"x" * 10)
    spill.close()


def _keys(store: S3BlobStore) -> list[str]:
    return [item["Key"] for item in store.listing(store.prefix)]


def test_a_replica_counts_what_it_holds_and_spills_in_its_metrics(tmp_path, postgres_url, s3_url):
    from tannery_protocol.v1 import archives_pb2 as pb

    from .server_harness import collect_fetch, running_server
    from .test_metrics import scrape, value
    from .test_pack_memory import entries, packed_store

    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, upload_memory=MiB) as server:
        stub = server.archives()
        for i in range(2):
            stub.Store(packed_store(f"p{i}", i, 3 * MiB), timeout=120)
        samples = scrape(server.metrics_port)
        assert value(samples, "tannery_upload_spills_total") == 2  # 3 MiB packs, 1 MiB of room
        assert value(samples, "tannery_upload_memory_bytes") == 0  # all given back
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="p1"), timeout=120)) == dict(entries(1, 3 * MiB))
