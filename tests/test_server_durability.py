"""What the server keeps and refuses when things go wrong: cancels, restarts, kill -9,
corrupted blobs, full disks, and many calls at once."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from pathlib import Path

import grpc
import pytest
import torch

from tannery.torch import deserialize, serialize
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import ServerProcess, collect_fetch, mounted_tmpfs, running_server, store_requests, wait_for

MiB = 1 << 20


def blob_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "blobs").glob("*/*"))


def temporary_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "tmp").iterdir())


def payload_of(n: int, seed: int = 0) -> bytes:
    return serialize(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def archive_names(stub) -> list[str]:
    return [a.name for a in stub.List(pb.ListRequest()).archives]


def blocking_store(archive: str, complete: dict[str, bytes], partial: bytes, sent: threading.Event,
                   release: threading.Event, chunk: int = 64 * 1024):
    """Requests that store ``complete`` entries, then half of ``partial``, then wait for ``release``."""
    yield from store_requests(archive, complete, chunk, commit=False)
    half = len(partial) // 2
    yield pb.StoreRequest(entry="partial", chunk=partial[:chunk])
    for start in range(chunk, half, chunk):
        yield pb.StoreRequest(chunk=partial[start : start + chunk])
    sent.set()
    release.wait(30)


def test_a_cancelled_store_leaves_nothing(tmp_path):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        stub.Store(store_requests("kept", {"w": payload_of(100)}))
        kept_blobs = blob_files(srv.data_dir)
        sent, release = threading.Event(), threading.Event()
        future = stub.Store.future(
            blocking_store("cancelled", {"a": payload_of(5000, 1), "b": payload_of(7000, 2)}, payload_of(500_000, 3),
                           sent, release))
        assert sent.wait(30)
        # a and b in the Store's open pack, partial in a file of its own: two temporary files.
        assert wait_for(lambda: len(temporary_files(srv.data_dir)) == 2 and blob_files(srv.data_dir) == kept_blobs)
        future.cancel()
        release.set()
        assert wait_for(lambda: not temporary_files(srv.data_dir) and blob_files(srv.data_dir) == kept_blobs)
        assert archive_names(stub) == ["kept"]


def test_archives_persist_across_a_restart(tmp_path):
    payloads = {"w": payload_of(70_000), "b": serialize(torch.tensor([True, False]))}
    with running_server(tmp_path) as srv:
        info = srv.archives().Store(store_requests("a", payloads))
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        assert stub.Describe(pb.DescribeRequest(archive="a")).info == info
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="a"))) == dict(sorted(payloads.items()))


def test_kill_9_during_a_store_loses_no_committed_archive_and_exposes_no_partial_one(tmp_path):
    data_dir = tmp_path / "data"
    kept = {"w": payload_of(300_000, 4), "v": payload_of(10, 5)}
    with ServerProcess(data_dir) as proc:
        stub = proc.archives()
        stub.Store(store_requests("kept", kept))
        kept_blobs = blob_files(data_dir)
        sent, release = threading.Event(), threading.Event()
        future = stub.Store.future(blocking_store(
            "doomed", {"a": payload_of(20_000, 6), "b": payload_of(30_000, 7)}, payload_of(1_000_000, 8), sent, release))
        assert sent.wait(30)
        # The complete entries are in the Store's open pack, the partial one in a temporary file of
        # its own (docs/packs.md): kill now.
        assert wait_for(lambda: len(temporary_files(data_dir)) == 2 and blob_files(data_dir) == kept_blobs)
        proc.kill()
        release.set()
        with pytest.raises(grpc.RpcError):
            future.result(30)
        assert temporary_files(data_dir), "a crash leaves its temporary file behind"
        proc.start()
        stub = proc.archives()
        assert archive_names(stub) == ["kept"]
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="kept"))) == dict(sorted(kept.items()))
        assert temporary_files(data_dir) == [] and blob_files(data_dir) == kept_blobs, "start-up cleans up"
        # The pack and the partial payload were temporary files; a and b were never blobs of their own.
        assert "recovery: removed 2 temporary files, 0 unreferenced blobs" in "\n".join(proc.log_lines)


# Integrity ----------------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def received_until_error(responses) -> tuple[int, grpc.RpcError]:
    received = 0
    with pytest.raises(grpc.RpcError) as info:
        for response in responses:
            received += len(response.chunk)
    return received, info.value


def test_a_corrupted_blob_is_data_loss_and_never_served_whole(tmp_path):
    with running_server(tmp_path, chunk_size=64 * 1024) as srv:
        stub = srv.archives()
        table = torch.randn(3000, 257, generator=torch.Generator().manual_seed(9))  # 3 MB: 3 checksum blocks
        payload = serialize(table)
        stub.Store(store_requests("a", {"emb": payload, "other": payload_of(10)}))
        digest = hashlib.sha256(payload).hexdigest()
        blob = srv.data_dir / "blobs" / digest[:2] / digest
        flip_byte(blob, 2 * MiB + 100)  # in the third block

        def fetch(*asks):
            return stub.Fetch(pb.FetchRequest(archive="a", entries=list(asks)))

        received, error = received_until_error(fetch(pb.EntryAsk(name="emb")))
        assert error.code() == grpc.StatusCode.DATA_LOSS
        assert f"entry 'emb': stored blob {digest} no longer matches its digest" in error.details()
        assert received < len(payload), "the last chunk is held back until the digest is verified"
        _, error = received_until_error(fetch(pb.EntryAsk(name="emb", cast="float16")))
        assert error.code() == grpc.StatusCode.DATA_LOSS

        # Row ranges check the blocks they read: the corrupted one fails, the others serve.
        rows = pb.RowRange(start=2500, stop=2600)
        received, error = received_until_error(fetch(pb.EntryAsk(name="emb", rows=rows)))
        assert error.code() == grpc.StatusCode.DATA_LOSS and "checksum in block 2" in error.details()
        got = collect_fetch(fetch(pb.EntryAsk(name="emb", rows=pb.RowRange(start=10, stop=900))))
        assert torch.equal(deserialize(got["emb"]), table[10:900])
        assert collect_fetch(fetch(pb.EntryAsk(name="other"))) == {"other": payload_of(10)}

        blob.write_bytes(payload[:-10])
        _, error = received_until_error(fetch(pb.EntryAsk(name="emb")))
        assert error.code() == grpc.StatusCode.DATA_LOSS and f"has {len(payload) - 10} bytes, {len(payload)} were stored" in error.details()
        blob.unlink()
        _, error = received_until_error(fetch(pb.EntryAsk(name="emb")))
        assert error.code() == grpc.StatusCode.DATA_LOSS and f"stored blob {digest} is missing" in error.details()


# Full disks ---------------------------------------------------------------------------


def check_full_disk_behaviour(stub, data_dir: Path, too_big: int) -> None:
    small = {"w": payload_of(1000, 1)}
    stub.Store(store_requests("small", small))
    with pytest.raises(grpc.RpcError) as info:
        stub.Store(store_requests("big", {"a": payload_of(1000, 2), "b": payload_of(too_big // 4, 3)}))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "storage is full" in info.value.details()
    assert archive_names(stub) == ["small"]
    assert temporary_files(data_dir) == [] and len(blob_files(data_dir)) == 1
    # Reads go on, and so do writes that fit.
    assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="small"))) == small
    stub.Store(store_requests("small2", {"w": payload_of(500, 4)}))
    assert archive_names(stub) == ["small", "small2"]


def test_a_file_size_limit_is_resource_exhausted_and_the_server_keeps_serving(tmp_path):
    """RLIMIT_FSIZE makes writes fail with EFBIG, as a full disk fails them with ENOSPC."""
    data_dir = tmp_path / "data"
    with ServerProcess(data_dir, fsize_limit=6 * MiB) as proc:
        check_full_disk_behaviour(proc.archives(), data_dir, too_big=8 * MiB)
        assert proc.process.poll() is None


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "small-disk", "6m") as mount_point:
        yield mount_point


def test_a_full_disk_is_resource_exhausted_and_the_server_keeps_serving(small_tmpfs):
    with running_server(small_tmpfs, data_dir=small_tmpfs / "data") as srv:
        check_full_disk_behaviour(srv.archives(), srv.data_dir, too_big=8 * MiB)


# Concurrency --------------------------------------------------------------------------


def test_concurrent_readers_and_writers(tmp_path):
    with running_server(tmp_path, chunk_size=64 * 1024) as srv:
        stub = srv.archives()
        base = {f"layer{i}": payload_of(100_000, i) for i in range(4)}  # 1.6 MB
        stub.Store(store_requests("base", base))
        versions = [{"w": payload_of(200_000, 100)}, {"w": payload_of(150_000, 101), "v": payload_of(10, 102)}]
        stub.Store(store_requests("hot", versions[0]))
        expected_base = dict(sorted(base.items()))

        def read_base(_):
            for _ in range(5):
                assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="base"))) == expected_base

        def read_hot(_):
            for _ in range(10):
                got = collect_fetch(stub.Fetch(pb.FetchRequest(archive="hot")))
                assert got in (versions[0], dict(sorted(versions[1].items()))), "a mix of two versions"

        def write(index):
            for k in range(5):
                stub.Store(store_requests("hot", versions[k % 2], replace=True))
                stub.Store(store_requests(f"new-{index}-{k}", {"x": payload_of(50_000, 1000 * index + k)}))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(read_base, i) for i in range(4)]
            jobs += [pool.submit(read_hot, i) for i in range(2)]
            jobs += [pool.submit(write, i) for i in range(2)]
            for job in jobs:
                job.result(120)
        assert len(archive_names(stub)) == 2 + 10
        # Every replaced version of "hot" was collected: the blob files are exactly those the 12
        # archives reference (base's pack, hot's blob, and one for each new archive).
        referenced = srv.storage.catalog.referenced_digests()
        assert len(referenced) == 1 + 1 + 10
        assert {p.name for p in blob_files(srv.data_dir)} == referenced
