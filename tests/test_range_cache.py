"""A cached read of one small entry caches the ranges it read, not its whole pack (issue #43).
Real PostgreSQL and SeaweedFS; every transport."""

from __future__ import annotations

import pytest

import tannery
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import collect_fetch, running_server, wait_for
from .test_pack_memory import ENTRY, MiB, entries, packed_store
from .test_shared_data_paths import bucket_object

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_client_environment")]
PACKED = 32 * MiB  # one pack of 8192 small entries, over range_cache.WHOLE_BELOW
#: A grace period of 0 would let the sweeper abort the pack's upload between its start and its first part.
SHORT = {"lease_seconds": 2.0, "gc_grace_seconds": 5.0, "health_check_seconds": 0.2}


def disk_bytes(directory) -> int:
    """Bytes the files of ``directory`` take on disk (a sparse file: only what was written)."""
    return sum(path.stat().st_blocks * 512 for path in directory.iterdir())


def asks(names: list[str]) -> list[pb.EntryAsk]:
    return [pb.EntryAsk(name=name) for name in names]


@pytest.fixture
def cached_replica(tmp_path, postgres_url, s3_url):
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, cache_dir=tmp_path / "cache",
                        cache_size=256 << 20, **SHORT) as server:
        server.archives().Store(packed_store("packed", 7, PACKED), timeout=300)
        yield server


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_reading_one_small_entry_of_a_large_pack_caches_about_that_entry(cached_replica, transport):
    cache = cached_replica.storage.blobs
    expected = dict(entries(7, PACKED))
    name = "t004097"
    with tannery.Client(cached_replica.target, transport=transport) as client:
        got = client.fetch("packed", [name])
        assert bytes(got.find(name).numpy().tobytes()) == expected[name][-ENTRY:]
    (pack,) = cached_replica.storage.catalog.referenced_digests()
    assert cache.cached() == {} and set(cache.cached_ranges()) == {pack}
    # The entry's own 4 KiB and the 64 KiB block(s) around it: not the 32 MiB pack.
    assert 0 < cache.cached_ranges()[pack] <= 128 << 10
    assert disk_bytes(cache.cache_dir) <= 256 << 10, disk_bytes(cache.cache_dir)


def test_ranges_serve_again_byte_exact_and_a_pack_read_whole_becomes_a_whole_copy(cached_replica):
    cache = cached_replica.storage.blobs
    expected = dict(entries(7, PACKED))
    stub = cached_replica.archives()
    some = ["t000000", "t004097", "t008191"]
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks(some)))) == \
        {n: expected[n] for n in some}
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks(some)))) == \
        {n: expected[n] for n in some}  # from the cached ranges
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed"))) == expected
    (pack,) = cached_replica.storage.catalog.referenced_digests()
    assert wait_for(lambda: pack in cache.cached(), timeout=30)  # every chunk read: hashed, made whole
    assert cache.cached_ranges() == {} and (cache.cache_dir / pack).stat().st_size == cache.cached()[pack]
    client, bucket, key = bucket_object(cached_replica, pack)
    client.delete_object(Bucket=bucket, Key=key)  # only the cache can answer now
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks(some)))) == \
        {n: expected[n] for n in some}


def test_a_damaged_cached_range_is_dropped_and_the_bucket_answers_next(cached_replica):
    cache = cached_replica.storage.blobs
    expected = dict(entries(7, PACKED))
    stub = cached_replica.archives()
    name = "t000005"
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks([name])))) == {name: expected[name]}
    (pack,) = cache.cached_ranges()
    path = cache.cache_dir / f"{pack}.ranges"
    with open(path, "r+b") as f:  # a bit flipped in the cached range
        f.seek(5 * len(expected[name]) + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(Exception) as failed:
        collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks([name]))))
    assert "DATA_LOSS" in str(failed.value)
    assert cache.cached_ranges() == {} and not path.exists()
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="packed", entries=asks([name])))) == {name: expected[name]}


def test_reads_of_any_alignment_are_byte_exact_and_cached_by_whole_chunks(s3_url, tmp_path):
    import hashlib
    import os

    from tannery_server.storage.blob_cache import CachedBlobStore
    from tannery_server.storage.range_cache import CHUNK
    from tannery_server.storage.s3_blobs import S3BlobStore

    store = CachedBlobStore(S3BlobStore(s3_url), tmp_path / "cache", max_bytes=64 * MiB)
    try:
        data = os.urandom(20 * MiB + 777)
        temp = store.create()
        temp.write(data)
        digest = hashlib.sha256(data).hexdigest()
        temp.seal(digest)
        blob = store.open(digest, len(data))
        for offset, size in ((5, 10), (CHUNK - 3, 6), (3 * CHUNK + 1, 5 * CHUNK), (len(data) - 100, 500),
                             (2 * CHUNK, CHUNK), (7, 3 * CHUNK)):
            buffer = bytearray(size)
            got = blob.read_into(memoryview(buffer), offset)
            assert bytes(buffer[:got]) == data[offset:offset + size]
            assert bytes(buffer[:got]) == blob.read(offset, size)  # again, from the cached chunks
        # Chunks 0 to 8 and the last, short one: those the reads touched, whole, and no other.
        assert store.cached_ranges()[digest] == 9 * CHUNK + len(data) % CHUNK
        blob.close()
    finally:
        store.close()


def test_a_cache_disk_that_fails_a_write_serves_from_the_bucket_and_drops_the_ranges(s3_url, tmp_path, monkeypatch):
    import errno
    import hashlib
    import os

    from tannery_server.storage import range_cache
    from tannery_server.storage.blob_cache import CachedBlobStore
    from tannery_server.storage.s3_blobs import S3BlobStore

    store = CachedBlobStore(S3BlobStore(s3_url), tmp_path / "cache", max_bytes=64 * MiB)
    try:
        data = os.urandom(17 * MiB)
        temp = store.create()
        temp.write(data)
        digest = hashlib.sha256(data).hexdigest()
        temp.seal(digest)
        blob = store.open(digest, len(data))
        assert blob.read(100, 10) == data[100:110] and store.cached_ranges() == {digest: range_cache.CHUNK}

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(range_cache.os, "pwrite", full)
        assert blob.read(5 * MiB, 1000) == data[5 * MiB:5 * MiB + 1000]  # from the bucket, whole
        assert store.cached_ranges() == {} and list((tmp_path / "cache").iterdir()) == []
        assert blob.read(100, 10) == data[100:110]
        blob.close()
    finally:
        store.close()
