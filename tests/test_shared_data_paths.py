"""Every transport on a replica of the shared backend (PostgreSQL and a SeaweedFS bucket): the
gRPC streams, the same-host socket and the direct data connection serve blobs read from the
bucket, or from the replica's read cache, with the same checks (a damaged object is
DATA_LOSS naming the entry; a damaged cached copy is dropped and the next read goes to the
bucket)."""

from __future__ import annotations

import boto3
import pytest
import torch

import tannery
from tannery_protocol.errors import DataLoss

from .server_harness import running_server, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_client_environment")]
TRANSPORTS = ["grpc", "local", "tcp"]
SHORT = {"lease_seconds": 2.0, "gc_grace_seconds": 0.0, "health_check_seconds": 0.2}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 256, generator=g),
        "big": torch.randn(3, 1 << 19, generator=g),  # 6 MiB: several checksum blocks
        "mask": torch.rand(1000, generator=g) > 0.5,
        "step": torch.tensor(7),
    }


def same(archive, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a fetched archive holds exactly these tensors, bit for bit."""
    return sorted(archive.names()) == sorted(tensors) and all(
        archive.find(k).dtype == v.dtype and torch.equal(archive.find(k), v) for k, v in tensors.items())


@pytest.fixture
def replica(tmp_path, postgres_url, s3_url):
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        yield server


@pytest.fixture
def cached_replica(tmp_path, postgres_url, s3_url):
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, cache_dir=tmp_path / "cache",
                        cache_size=64 << 20, **SHORT) as server:
        yield server


def bucket_object(server, digest: str) -> tuple[object, str, str]:
    """The S3 client, bucket and key of a blob of the server's bucket."""
    store = getattr(server.storage.blobs, "inner", server.storage.blobs)
    client = boto3.client("s3", endpoint_url=store.endpoint)
    return client, store.bucket, store.key(digest)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_transport_stores_and_fetches_through_the_bucket(replica, transport):
    tensors = state(1)
    with tannery.Client(replica.target, transport=transport) as client:
        client.store("m", tensors)
        assert same(client.fetch("m"), tensors)
        part = client.archive("m")
        assert torch.equal(part.rows("big", 1, 3), tensors["big"][1:3])
        assert torch.equal(part.float("embed.weight", (512, 256), torch.float16), tensors["embed.weight"].half())
        assert torch.equal(part.rows("mask", 10, 20), tensors["mask"][10:20])
    assert set(replica.storage.blobs.digests()) == set(replica.storage.catalog.referenced_digests())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_same_store_again_on_a_replica_stores_nothing_and_other_content_is_refused_before_its_bytes(
        replica, transport):
    """With digests sent ahead, a repeated Store is compared digest by digest; a differing entry
    is refused at its name, on every transport, and nothing reaches the bucket."""
    tensors = state(2)
    with tannery.Client(replica.target, transport=transport) as client:
        first = client.store("m", tensors)
        objects = set(replica.storage.blobs.digests())
        again = client.store("m", {name: t.clone() for name, t in tensors.items()})
        assert again.already_stored and again.created == first.created
        with pytest.raises(tannery.AlreadyExists, match=r"'m' already exists with other content: entry 'big' differs "
                                                        r"\(sha256 [0-9a-f]{16}\.\.\. there"):
            client.store("m", {**tensors, "big": tensors["big"] + 1})
        assert same(client.fetch("m"), tensors)
    assert set(replica.storage.blobs.digests()) == objects
    assert wait_for(lambda: list(replica.storage.blobs.temporaries()) == [])


def test_the_replica_asks_for_digests_ahead_and_an_embedded_server_does_not(replica, tmp_path):
    with tannery.Client(replica.target, transport="grpc") as client:
        assert client._wants_digests()
    with running_server(tmp_path / "embedded") as embedded, tannery.Client(embedded.target) as client:
        assert not client._wants_digests()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("backend", ["replica", "embedded"])
def test_a_payload_that_is_not_the_digest_sent_ahead_of_it_stores_nothing(request, tmp_path, monkeypatch,
                                                                         backend, transport):
    import tannery.dataplane.messages

    server = (request.getfixturevalue("replica") if backend == "replica"
              else request.getfixturevalue("embedded_server"))
    wrong = __import__("hashlib").sha256(b"something else").digest()
    monkeypatch.setattr(tannery.dataplane.messages, "_sha256", lambda parts: wrong)
    monkeypatch.setattr(tannery.Client, "_wants_digests", lambda self: True)  # the embedded server checks too
    with tannery.Client(server.target, transport=transport) as client:
        with pytest.raises(tannery.InvalidArgument) as caught:
            client.store("m", state(5))
        message = str(caught.value)
        assert "entry 'big'" in message and wrong.hex() in message and "nothing was stored" in message
        assert client.list() == []
    assert list(server.storage.blobs.digests()) == []
    if backend == "replica":
        store = getattr(server.storage.blobs, "inner", server.storage.blobs)
        assert store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_asyncio_client_sends_digests_ahead_too(replica, monkeypatch, transport):
    import asyncio

    import tannery.aio
    import tannery.dataplane.messages

    async def store(tensors) -> None:
        async with tannery.aio.Client(replica.target, transport=transport) as client:
            await client.store("m", tensors)

    tensors = state(6)
    wrong = bytes(32)
    real = tannery.dataplane.messages._sha256
    monkeypatch.setattr(tannery.dataplane.messages, "_sha256", lambda parts: wrong)
    with pytest.raises(tannery.InvalidArgument, match="entry 'big': its .* not to 0{64}"):
        asyncio.run(store(tensors))
    monkeypatch.setattr(tannery.dataplane.messages, "_sha256", real)
    asyncio.run(store(tensors))
    with tannery.Client(replica.target) as client:
        assert same(client.fetch("m"), tensors)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_payload_goes_to_its_digest_key_with_no_copy_and_a_wrong_one_leaves_no_upload(
        tmp_path, postgres_url, s3_url, monkeypatch, transport):
    import tannery.dataplane.messages

    # A grace period longer than the test: the sweeper leaves the uploads in progress alone.
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **{**SHORT, "gc_grace_seconds": 60.0}) as replica:
        store = getattr(replica.storage.blobs, "inner", replica.storage.blobs)
        monkeypatch.setattr(store, "part_size", 5 << 20)  # 12 MiB entries stream, in parts of 5 MiB
        monkeypatch.setattr(store, "parts_in_flight", 1)
        made: list[str] = []
        store.client.meta.events.register("before-call.s3.*", lambda model, **_: made.append(model.name))
        tensors = {"a": torch.randn(3 << 20), "b": torch.randn(3 << 20)}
        with tannery.Client(replica.target, transport=transport) as client:
            client.store("big", tensors)
            assert same(client.fetch("big"), tensors)
            assert made.count("CreateMultipartUpload") == 2 and "CopyObject" not in made
            keys = [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket).get("Contents", [])]
            assert not [k for k in keys if "/tmp/" in k]
            made.clear()
            client.store("again", tensors)  # the same tensors: found in the bucket, not uploaded again
            assert not {"CreateMultipartUpload", "UploadPart", "PutObject"} & set(made)
            assert same(client.fetch("again"), tensors)
            made.clear()
            monkeypatch.setattr(tannery.dataplane.messages, "_sha256", lambda parts: bytes(32))
            with pytest.raises(tannery.InvalidArgument, match="entry 'a'"):
                client.store("wrong", {"a": torch.randn(3 << 20)})
        assert "CreateMultipartUpload" in made and "AbortMultipartUpload" in made
        assert "CompleteMultipartUpload" not in made
        assert store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


@pytest.fixture
def embedded_server(tmp_path):
    with running_server(tmp_path / "embedded") as server:
        yield server


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_damaged_object_in_the_bucket_is_data_loss_naming_the_entry(replica, transport):
    tensors = state(2)
    with tannery.Client(replica.target, transport=transport) as client:
        client.store("m", tensors)
        digest = {e.name: e.digest for e in client.describe("m").entries}["big"]
        s3, bucket, key = bucket_object(replica, digest)
        damaged = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        damaged[len(damaged) // 2] ^= 0x10
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(damaged))
        with pytest.raises(DataLoss, match="entry 'big'"):
            client.fetch("m", ["big"])
        assert torch.equal(client.fetch("m", ["step"]).find("step"), tensors["step"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cached_checkpoint_is_served_from_local_disk_after_its_first_fetch(cached_replica, transport):
    tensors = state(3)
    cache = cached_replica.storage.blobs
    with tannery.Client(cached_replica.target, transport=transport) as client:
        client.store("m", tensors)
        assert same(client.fetch("m"), tensors)  # from the bucket; the cache fills behind it
        digests = set(cached_replica.storage.catalog.referenced_digests())
        assert wait_for(lambda: set(cache.cached()) == digests, timeout=20)
        s3, bucket, key = bucket_object(cached_replica, next(iter(digests)))
        for digest in digests:  # the bucket's copies gone: only the cache can answer now
            s3.delete_object(Bucket=bucket, Key=cache.inner.key(digest))
        assert same(client.fetch("m"), tensors)


def test_a_damaged_cached_copy_is_dropped_and_the_bucket_answers_next(cached_replica):
    tensors = state(4)
    cache = cached_replica.storage.blobs
    with tannery.Client(cached_replica.target, transport="tcp") as client:
        client.store("m", tensors)
        client.fetch("m")
        digest = {e.name: e.digest for e in client.describe("m").entries}["big"]
        assert wait_for(lambda: digest in cache.cached(), timeout=20)
        path = cache.cache_dir / digest
        damaged = bytearray(path.read_bytes())
        damaged[100] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(DataLoss, match="entry 'big'"):
            client.fetch("m", ["big"])
        assert digest not in cache.cached()
        assert torch.equal(client.fetch("m", ["big"]).find("big"), tensors["big"])
