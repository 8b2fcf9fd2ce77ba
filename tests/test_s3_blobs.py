"""S3BlobStore and CachedBlobStore against a real SeaweedFS (tests/s3_harness.py)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from tannery_server.storage.blob_cache import CachedBlobStore
from tannery_server.storage.errors import StorageUnavailable
from tannery_server.storage.file_blobs import FileBlob
from tannery_server.storage.s3_blobs import S3Blob, S3BlobStore

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: several parts from a few MiB of test data


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(store, data: bytes, piece: int = MiB) -> tuple[str, bool]:
    temp = store.create()
    for at in range(0, len(data), piece):
        temp.write(memoryview(data)[at:at + piece])
    digest = digest_of(data)
    return digest, temp.seal(digest)


def keys(store: S3BlobStore, under: str = "") -> list[str]:
    answer = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + under)
    return [item["Key"] for item in answer.get("Contents", [])]


def uploads(store: S3BlobStore) -> list[dict]:
    return store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])


@pytest.fixture
def store(s3_url: str):
    """A store that holds one part before it streams (so a few MiB of test data stream)."""
    blobs = S3BlobStore(s3_url, part_size=PART, parts_in_flight=1, range_size=MiB)
    yield blobs
    blobs.close()


def operations(store: S3BlobStore) -> list[str]:
    """The names of the S3 operations the store's client makes from now on (botocore's events)."""
    made: list[str] = []
    store.client.meta.events.register("before-call.s3.*", lambda model, **_: made.append(model.name))
    return made


def test_small_payload_is_one_put_at_its_digest_key(store: S3BlobStore):
    data = os.urandom(100_000)
    made = operations(store)
    digest, stored = put(store, data, piece=30_000)
    assert stored
    assert made == ["HeadObject", "PutObject"]  # no temporary object, no multipart upload
    assert keys(store) == [f"tannery/blobs/{digest[:2]}/{digest[2:4]}/{digest}"]  # no temporary, no other key
    assert uploads(store) == []
    blob = store.open(digest)
    assert isinstance(blob, S3Blob) and blob.size == len(data)
    assert blob.read(0, len(data)) == data
    assert store.open(digest, size=len(data)).read(0, len(data)) == data


def test_empty_payload(store: S3BlobStore):
    digest, stored = put(store, b"")
    assert stored and store.open(digest).size == 0 and store.open(digest).read(0, 10) == b""


def test_large_payload_streams_in_parts_and_reads_back(store: S3BlobStore):
    data = os.urandom(3 * PART + 12345)  # three full parts and a short last one
    temp = store.create()
    for at in range(0, len(data), MiB):
        temp.write(data[at:at + MiB])
        if at == 2 * PART:  # two parts are in the bucket's hands before seal
            assert temp._upload_id is not None
    digest = digest_of(data)
    made = operations(store)
    assert temp.seal(digest) is True
    assert made == ["UploadPart", "CompleteMultipartUpload", "HeadObject", "CopyObject", "DeleteObject"]
    assert keys(store) == [store.key(digest)]  # the temporary object is gone
    assert uploads(store) == []
    blob = store.open(digest)
    assert blob.size == len(data)
    assert blob.read(0, len(data)) == data


def test_payload_held_in_memory_goes_straight_to_its_digest_key(s3_url: str):
    store = S3BlobStore(s3_url, part_size=PART, parts_in_flight=3)
    data = os.urandom(3 * PART + 777)  # three parts held and the one filling: no temporary, no copy
    temp = store.create()
    made = operations(store)
    for at in range(0, len(data), MiB):
        temp.write(data[at:at + MiB])
    assert made == []  # nothing sent before seal
    digest = digest_of(data)
    assert temp.seal(digest) is True
    assert made == ["HeadObject", "CreateMultipartUpload"] + ["UploadPart"] * 4 + ["CompleteMultipartUpload"]
    assert keys(store) == [store.key(digest)] and uploads(store) == []
    assert store.open(digest).read(0, len(data)) == data


def test_payload_whose_digest_is_known_ahead_streams_to_its_digest_key(store: S3BlobStore):
    data = os.urandom(3 * PART + 4321)
    digest = digest_of(data)
    made = operations(store)
    temp = store.create(expected=digest)
    for at in range(0, len(data), MiB):
        temp.write(data[at:at + MiB])
    # The upload streams under the digest key, unseen until seal completes it: no temporary key.
    assert [u["Key"] for u in uploads(store)] == [store.key(digest)] and keys(store) == []
    assert temp.seal(digest) is True
    assert "CopyObject" not in made and "DeleteObject" not in made  # no copy, no temporary to delete
    assert made[:2] == ["HeadObject", "CreateMultipartUpload"] and made[-1] == "CompleteMultipartUpload"
    assert keys(store) == [store.key(digest)] and uploads(store) == []
    assert store.open(digest).read(0, len(data)) == data


def test_a_payload_streaming_to_its_digest_key_that_another_store_completes_first_is_dropped(store: S3BlobStore):
    data = os.urandom(3 * PART + 99)
    digest = digest_of(data)
    temp = store.create(expected=digest)
    for at in range(0, len(data), MiB):
        temp.write(data[at:at + MiB])
    assert temp._upload_id is not None  # streaming
    put(store, data)  # another Store of the same tensor ends first
    made = operations(store)
    assert temp.seal(digest) is False
    assert "CompleteMultipartUpload" not in made and "AbortMultipartUpload" in made
    assert keys(store) == [store.key(digest)] and uploads(store) == []
    assert store.open(digest).read(0, len(data)) == data


def test_a_large_payload_known_ahead_and_already_stored_is_not_uploaded_again(store: S3BlobStore):
    data = os.urandom(4 * PART + 5)
    digest, _ = put(store, data)
    made = operations(store)
    temp = store.create(expected=digest)
    for at in range(0, len(data), 3 * MiB):
        temp.write(data[at:at + 3 * MiB])
    assert temp.size == len(data)
    assert temp.seal(digest) is False
    assert made == ["HeadObject", "HeadObject"]  # found when it outgrew memory, and again at seal
    assert uploads(store) == [] and keys(store) == [store.key(digest)]
    # Collected between the two looks (its archive deleted meanwhile): the Store is told to run again.
    temp = store.create(expected=digest)
    for at in range(0, len(data), 3 * MiB):
        temp.write(data[at:at + 3 * MiB])
    store.remove(digest)
    with pytest.raises(StorageUnavailable, match=f"blob {digest} .* collected .* run the Store again"):
        temp.seal(digest)


def test_payload_that_hashes_to_another_digest_than_given_ahead_leaves_nothing(s3_url: str):
    from tannery_server.storage import DigestMismatch
    from tannery_server.storage.payload_writer import PayloadWriter

    store = S3BlobStore(s3_url, part_size=PART, parts_in_flight=1)
    data = os.urandom(3 * PART)
    claimed = digest_of(data[:-1] + b"x")
    writer = PayloadWriter(store.create(expected=claimed), 1 << 20, expected=claimed)
    for at in range(0, len(data), MiB):
        writer.write(memoryview(data)[at:at + MiB])
    assert uploads(store)  # parts went to the bucket as they came
    with pytest.raises(DigestMismatch) as caught:
        writer.finish()
    assert digest_of(data) in str(caught.value) and claimed in str(caught.value)
    assert keys(store) == [] and uploads(store) == []  # aborted: no object under the claimed digest


def test_equal_payloads_stored_once(store: S3BlobStore):
    small, held, streamed = os.urandom(1000), os.urandom(PART + 10), os.urandom(2 * PART + 10)
    for data in (small, held, streamed):
        digest, first = put(store, data)
        again, second = put(store, data)
        assert (first, second) == (True, False)
    assert sorted(keys(store)) == sorted(store.key(digest_of(d)) for d in (small, held, streamed))
    assert uploads(store) == []


def test_equal_payloads_sealed_at_once_are_one_object(store: S3BlobStore):
    data = os.urandom(2 * PART + 3)  # streamed: both copy to one digest key
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(put(store, data)[1])) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and True in results
    assert keys(store) == [store.key(digest_of(data))] and uploads(store) == []
    assert store.open(digest_of(data)).read(0, len(data)) == data


def test_known_size_spares_the_head_request(store: S3BlobStore):
    data = os.urandom(1000)
    digest, _ = put(store, data)
    made = operations(store)
    blob = store.open(digest, size=len(data))
    assert made == []
    assert blob.read(0, 1000) == data and made == ["GetObject"]
    store.open(digest)
    assert made == ["GetObject", "HeadObject"]


def test_endpoint_from_aws_endpoint_url(s3_url: str, monkeypatch):
    endpoint = os.environ["AWS_ENDPOINT_URL_S3"]
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = S3BlobStore(s3_url)
    assert store.endpoint == endpoint
    store.check()


def test_discard_leaves_nothing(store: S3BlobStore):
    for size in (1000, PART + 5, 3 * PART + 5):
        temp = store.create()
        temp.write(os.urandom(size))
        if size > 2 * PART:
            assert len(uploads(store)) == 1  # streaming had begun
        temp.discard()
    assert keys(store) == [] and uploads(store) == []


def test_ranged_reads_and_parallel_read_into_are_exact(store: S3BlobStore):
    data = os.urandom(PART + 3 * MiB + 77)
    digest, _ = put(store, data)
    blob = store.open(digest, size=len(data))
    assert blob.read(5, 10) == data[5:15]
    assert blob.read(len(data) - 3, 100) == data[-3:]  # clipped at the end
    assert blob.read(len(data), 5) == b""
    for offset, size in [(0, len(data)), (1, len(data) - 1), (MiB - 1, 4 * MiB + 3), (123, MiB + 1), (len(data) - 5, 5)]:
        buffer = bytearray(size)
        assert blob.read_into(memoryview(buffer), offset) == size
        assert buffer == data[offset:offset + size]
    buffer = bytearray(2 * MiB)  # past the end: fewer bytes
    assert blob.read_into(memoryview(buffer), len(data) - 100) == 100
    assert buffer[:100] == data[-100:]
    with pytest.raises(io.UnsupportedOperation):
        blob.fileno()


def test_read_into_runs_ranges_in_parallel(store: S3BlobStore):
    """A read of 6 ranges takes several requests in flight at once, not one after another."""
    data = os.urandom(6 * MiB)
    digest, _ = put(store, data)
    blob = store.open(digest)
    in_flight, peak, lock = 0, 0, threading.Lock()
    original = blob._read_range

    def counted(view, offset):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        try:
            time.sleep(0.05)
            return original(view, offset)
        finally:
            with lock:
                in_flight -= 1

    blob._read_range = counted
    buffer = bytearray(len(data))
    assert blob.read_into(memoryview(buffer), 0) == len(data) and buffer == data
    assert peak >= 3


def test_sequential_small_reads_are_read_ahead_exactly(store: S3BlobStore):
    """Reads of 300 KiB one after another (as a Fetch makes them) come from ranges fetched
    ahead, several at once; jumps and re-reads stay exact."""
    data = os.urandom(5 * MiB + 4321)
    digest, _ = put(store, data)
    blob = store.open(digest, size=len(data))
    requests, in_flight, peak, lock = [], 0, 0, threading.Lock()
    original = blob._read_range

    def counted(view, offset):
        nonlocal in_flight, peak
        with lock:
            requests.append((offset, view.nbytes))
            in_flight += 1
            peak = max(peak, in_flight)
        try:
            time.sleep(0.02)
            return original(view, offset)
        finally:
            with lock:
                in_flight -= 1

    blob._read_range = counted
    piece = 300 << 10
    out = bytearray()
    for offset in range(0, len(data), piece):
        buffer = bytearray(piece)
        got = blob.read_into(memoryview(buffer), offset)
        out += buffer[:got]
    assert out == data
    assert peak >= 3  # ranges ahead were in flight together
    spans = sorted(requests)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no byte asked for twice
    assert sum(n for _, n in spans) == len(data)
    assert blob.read(10, 20) == data[10:30]  # a jump back: read directly
    assert blob.read(30, MiB) == data[30:30 + MiB]  # sequential again
    assert blob.read(4 * MiB, 100) == data[4 * MiB:4 * MiB + 100]  # a jump forward
    blob.close()


def test_read_ahead_grows_with_the_run_and_stops_where_told(store: S3BlobStore):
    """A short run of sequential reads (a row range of three blocks) fetches little more than
    it reads; read_ahead_until keeps the read-ahead inside a known end."""
    data = os.urandom(5 * MiB)
    digest, _ = put(store, data)
    for bounded in (False, True):
        blob = store.open(digest, size=len(data))
        asked = []
        original = blob._read_range
        blob._read_range = lambda view, offset: asked.append((offset, view.nbytes)) or original(view, offset)
        piece = 256 << 10
        if bounded:
            blob.read_ahead_until(MiB + 3 * piece)
        for offset in range(MiB, MiB + 3 * piece, piece):
            assert blob.read(offset, piece) == data[offset:offset + piece]
        blob.close()
        fetched = sum(n for _, n in asked)
        if bounded:
            assert max(a + n for a, n in asked) <= MiB + 3 * piece and fetched == 3 * piece
        else:
            assert fetched <= 3 * (3 * piece), asked  # ahead: about 1.5x the run's bytes, not 32 MiB


def test_ranged_reads_reuse_their_connections(store: S3BlobStore, monkeypatch):
    import urllib3.connection

    data = os.urandom(3 * MiB)
    digest, _ = put(store, data)
    blob = store.open(digest, len(data))
    blob.read(0, 10)  # the pool's first connection
    connects = []
    connect = urllib3.connection.HTTPConnection.connect
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", lambda self: (connects.append(1), connect(self))[1])
    for i in range(40):  # scattered reads: no read-ahead, each a GET read to its end
        at = (i * 7919 * 13) % (len(data) - 5000)
        assert blob.read(at, 5000) == data[at:at + 5000]
    assert len(connects) <= 1  # each GET's connection went back to the pool
    from tannery_server.storage.s3_reads import _plain_http_response

    body = store.client.get_object(Bucket=store.bucket, Key=store.key(digest), Range="bytes=0-9")["Body"]
    assert _plain_http_response(body) is not None  # read straight into the caller's buffer, not through urllib3
    body.close()


def test_uploads_carry_a_checksum_the_bucket_checks_and_no_payload_hash(store: S3BlobStore):
    sent: list[dict] = []
    store.client.meta.events.register("before-send.s3.*", lambda request, **_: sent.append(dict(request.headers)))
    data = os.urandom(2 * PART + 10)
    digest, stored = put(store, data)
    assert stored and store.open(digest).read(0, len(data)) == data
    uploads_sent = [h for h in sent if any(k.lower() == "x-amz-checksum-crc32" for k in h)]
    assert uploads_sent  # every part and PUT carries a CRC32 the bucket checks
    for headers in uploads_sent:
        signed = {k.lower(): v for k, v in headers.items()}["x-amz-content-sha256"]
        assert (signed.decode() if isinstance(signed, bytes) else signed) == "UNSIGNED-PAYLOAD"

    def damage(request, **_):  # a bit flipped on the way, after the checksum was computed
        if isinstance(request.body, (bytes, bytearray)) and request.body:
            body = bytearray(request.body)
            body[0] ^= 1
            request.body = bytes(body)

    store.client.meta.events.register("before-send.s3.PutObject", damage)
    with pytest.raises(StorageUnavailable, match="BadDigest|did not match"):
        put(store, os.urandom(1000))


def test_missing_blob_is_file_not_found(store: S3BlobStore):
    missing = "ab" * 32
    with pytest.raises(FileNotFoundError):
        store.open(missing)
    with pytest.raises(FileNotFoundError):  # size given: no HEAD, the GET finds it missing
        store.open(missing, size=10).read(0, 10)
    assert store.remove(missing) == 0


def test_remove_and_digests(store: S3BlobStore):
    blobs = {digest_of(d): d for d in (os.urandom(10), os.urandom(2000), os.urandom(PART + 1))}
    for data in blobs.values():
        put(store, data)
    store.client.put_object(Bucket=store.bucket, Key="tannery/blobs/zz/not-a-blob", Body=b"x")
    store.client.put_object(Bucket=store.bucket, Key="other/blobs/00/00/" + "0" * 64, Body=b"x")
    assert sorted(store.digests()) == sorted(blobs)
    first = next(iter(blobs))
    assert store.remove(first) == len(blobs[first])
    assert store.remove(first) == 0
    assert sorted(store.digests()) == sorted(d for d in blobs if d != first)


def test_digests_lists_past_one_page(s3_url: str):
    store = S3BlobStore(s3_url)
    count = 1010  # ListObjectsV2 answers 1000 keys a page
    names = sorted(hashlib.sha256(str(i).encode()).hexdigest() for i in range(count))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda d: store.client.put_object(Bucket=store.bucket, Key=store.key(d), Body=b""), names))
    assert sorted(store.digests()) == names


def test_clear_temporary_removes_what_is_idle_and_aborts_stale_uploads(store: S3BlobStore):
    client = store.client
    old, new = time.time_ns() - 10**12, time.time_ns() + 10**12
    client.put_object(Bucket=store.bucket, Key=f"tannery/tmp/{old}-a", Body=b"old")
    client.put_object(Bucket=store.bucket, Key=f"tannery/tmp/{new}-b", Body=b"new")
    stale = store.create()
    stale.write(os.urandom(2 * PART))  # past the part held: a multipart upload is open
    client.create_multipart_upload(Bucket=store.bucket, Key=store.key("cd" * 32))  # a held payload cut short
    assert len(uploads(store)) == 2
    # "a" was begun long ago but written just now (an upload that completed, about to be copied).
    assert store.clear_temporary(time.time_ns() - 10**11) == 0
    assert len(uploads(store)) == 2
    cutoff = time.time_ns() + 10**9  # after everything above, before "new"
    assert store.clear_temporary(cutoff) == 3  # "a" and both uploads ("b" began after the cutoff)
    assert uploads(store) == []
    assert keys(store, "tmp/") == [f"tannery/tmp/{new}-b"]
    assert store.clear_temporary() == 1
    assert keys(store, "tmp/") == []


def test_clear_temporary_keeps_an_upload_begun_long_ago_that_still_receives_parts(store: S3BlobStore):
    temp = store.create()
    temp.write(os.urandom(2 * PART))  # an upload begins, with its first part
    began = time.time_ns()
    time.sleep(3)  # the bucket's times have whole seconds
    temp.write(os.urandom(PART))  # a later part
    wait = time.time_ns()
    while temp._parts and not all(f.done() for f in temp._parts) and time.time_ns() - wait < 30 * 10**9:
        time.sleep(0.05)
    assert store.clear_temporary(began + 15 * 10**8) == 0  # begun before the cutoff, but a part came after
    assert len(uploads(store)) == 1
    temp.discard()
    assert uploads(store) == []


def test_check_and_a_missing_bucket(store: S3BlobStore, seaweedfs):
    store.check()
    other = S3BlobStore("s3://no-such-bucket-here/x")
    with pytest.raises(StorageUnavailable, match="no-such-bucket-here.*no such bucket"):
        other.check()
    with pytest.raises(StorageUnavailable, match="no-such-bucket-here.*write .*no such bucket"):
        put(other, b"some bytes")


def test_unreachable_bucket_is_unavailable_then_recovers(store: S3BlobStore, seaweedfs):
    data = os.urandom(2000)
    digest, _ = put(store, data)
    large = os.urandom(4 * MiB)
    large_digest, _ = put(store, large)
    reading = store.open(large_digest)
    assert reading.read(0, 1000) + reading.read(1000, 1000) == large[:2000]  # read-ahead on
    seaweedfs.stop()
    try:
        with pytest.raises(StorageUnavailable):
            reading.read(2000, 3 * MiB)  # past what was read ahead before the stop
        for action in (store.check, lambda: store.open(digest), lambda: put(store, os.urandom(10)),
                       lambda: store.open(digest, size=2000).read(0, 10), lambda: list(store.digests())):
            with pytest.raises(StorageUnavailable) as caught:
                action()
            message = str(caught.value)
            assert store.bucket in message and seaweedfs.endpoint in message, message
            assert "failed" in message
    finally:
        seaweedfs.start()
    store.check()  # the same store object: no restart of tannery needed
    assert store.open(digest).read(0, 2000) == data
    assert reading.read(2000, 3 * MiB) == large[2000:2000 + 3 * MiB]  # the open blob recovers too


def test_wrong_credentials_are_access_denied(s3_url: str, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageUnavailable, match="access denied"):
        S3BlobStore(s3_url).check()


def test_streaming_upload_holds_a_few_parts_not_the_payload(s3_url: str):
    """256 MiB written in 1 MiB pieces: Python's allocations peak near (in flight + 1) parts."""
    part = 8 * MiB
    store = S3BlobStore(s3_url, part_size=part, parts_in_flight=3)
    piece = os.urandom(MiB)
    tracemalloc.start()
    try:
        temp = store.create()
        for _ in range(256):
            temp.write(piece)
        temp.discard()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (3 + 1) * part + 8 * MiB, f"peak {peak / MiB:.0f} MiB"


def test_bad_url():
    with pytest.raises(ValueError, match="s3://BUCKET"):
        S3BlobStore("file:///tmp/x")


# -- the local cache -------------------------------------------------------------------------


def test_cache_serves_a_local_file_after_the_first_open(store: S3BlobStore, tmp_path: Path):
    cache = CachedBlobStore(store, tmp_path / "cache", max_bytes=10 * MiB)
    data = os.urandom(3 * MiB + 5)
    digest, _ = put(cache, data)
    first = cache.open(digest)
    assert isinstance(first, S3Blob)
    cache.wait_for_fills()
    second = cache.open(digest, size=len(data))
    assert isinstance(second, FileBlob) and second.fileno() >= 0
    assert second.read(0, len(data)) == data
    assert cache.remove(digest) == len(data)
    assert not (tmp_path / "cache" / digest).exists()
    with pytest.raises(FileNotFoundError):
        cache.open(digest)


def test_cache_evicts_the_least_recently_used(store: S3BlobStore, tmp_path: Path):
    cache = CachedBlobStore(store, tmp_path / "cache", max_bytes=5 * MiB)
    blobs = [os.urandom(2 * MiB) for _ in range(3)]
    digests = [put(cache, d)[0] for d in blobs]
    for digest in digests[:2]:
        cache.open(digest)
        cache.wait_for_fills()
    assert isinstance(cache.open(digests[0]), FileBlob)  # 0 is now used more recently than 1
    cache.open(digests[2])
    cache.wait_for_fills()
    assert set(cache.cached()) == {digests[0], digests[2]}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([digests[0], digests[2]])
    big = put(cache, os.urandom(6 * MiB))[0]  # larger than the whole cache: never cached
    cache.open(big)
    cache.wait_for_fills()
    assert big not in cache.cached() and cache.cached_bytes <= 5 * MiB


def test_cache_fills_a_blob_once_at_a_time(store: S3BlobStore, tmp_path: Path):
    cache = CachedBlobStore(store, tmp_path / "cache", max_bytes=10 * MiB)
    digest, _ = put(cache, os.urandom(2 * MiB))
    release = threading.Event()
    fills = []
    original = cache._fill

    def slow_fill(*args):
        fills.append(args)
        release.wait(10)
        original(*args)

    cache._fill = slow_fill
    for _ in range(3):  # opened three times while the first copy is still being made
        assert isinstance(cache.open(digest), S3Blob)
    release.set()
    cache.wait_for_fills()
    assert len(fills) == 1
    assert isinstance(cache.open(digest), FileBlob)


def test_cache_keeps_no_copy_whose_bytes_are_not_its_digest(store: S3BlobStore, tmp_path: Path):
    cache = CachedBlobStore(store, tmp_path / "cache", max_bytes=10 * MiB)
    named = digest_of(b"the bytes the name promises")
    store.client.put_object(Bucket=store.bucket, Key=store.key(named), Body=b"other bytes")  # rotten in the bucket
    cache.open(named)
    cache.wait_for_fills()
    assert cache.cached() == {} and list((tmp_path / "cache").iterdir()) == []
    assert isinstance(cache.open(named), S3Blob)  # served from the bucket, where the CRCs find it


def test_cache_is_rebuilt_from_its_directory(store: S3BlobStore, tmp_path: Path):
    directory = tmp_path / "cache"
    cache = CachedBlobStore(store, directory, max_bytes=10 * MiB)
    data = [os.urandom(MiB + i) for i in range(2)]
    digests = [put(cache, d)[0] for d in data]
    for digest in digests:
        cache.open(digest)
        cache.wait_for_fills()
    (directory / f"{'f' * 64}.part").write_bytes(b"half")  # a fill cut short
    again = CachedBlobStore(store, directory, max_bytes=10 * MiB)
    assert set(again.cached()) == set(digests)
    assert not (directory / f"{'f' * 64}.part").exists()
    blob = again.open(digests[1])
    assert isinstance(blob, FileBlob) and blob.read(0, len(data[1])) == data[1]
    smaller = CachedBlobStore(store, directory, max_bytes=MiB + 5)  # rebuilt into a smaller bound
    assert len(smaller.cached()) == 1


def test_truncated_cache_file_is_not_served(store: S3BlobStore, tmp_path: Path):
    directory = tmp_path / "cache"
    cache = CachedBlobStore(store, directory, max_bytes=10 * MiB)
    data = os.urandom(2 * MiB)
    digest, _ = put(cache, data)
    cache.open(digest)
    cache.wait_for_fills()
    os.truncate(directory / digest, MiB)
    blob = cache.open(digest)  # the recorded size no longer matches: read from the bucket
    assert isinstance(blob, S3Blob) and blob.read(0, len(data)) == data
    cache.wait_for_fills()  # and cached again, whole
    assert cache.open(digest, size=len(data)).read(0, len(data)) == data
    # A file truncated while tannery was down: found at start, checked against the store once.
    os.truncate(directory / digest, 100)
    rebuilt = CachedBlobStore(store, directory, max_bytes=10 * MiB)
    assert isinstance(rebuilt.open(digest), S3Blob)
    rebuilt.wait_for_fills()
    assert isinstance(rebuilt.open(digest, size=len(data)), FileBlob)
    with open(directory / digest, "r+b") as f:  # of the right size but damaged: the CRCs of a read
        f.write(b"\0" * 16)  # find it (fetching.py); evict drops it
    rebuilt.evict(digest)
    assert isinstance(rebuilt.open(digest, size=len(data)), S3Blob)
    rebuilt.wait_for_fills()
