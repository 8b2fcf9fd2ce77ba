"""A full disk never locks the operator out.

On a small tmpfs mounted by the test (root only): Stores through the real server fill it
until RESOURCE_EXHAUSTED, which names the disk and leaves nothing partial; then, with not
one byte free, Describe, List and Fetch go on, Delete works and frees space, and a Store
succeeds after it. The space reserve (``<data_dir>/reserve``) is what lets the Delete's
catalog write through; it is re-created once space is back, and at start-up.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.storage import Storage, StorageFull

from .server_harness import collect_fetch, mounted_tmpfs, running_server, store_requests

MiB = 1 << 20
DISK = 24 * MiB


def payload_of(nbytes: int, seed: int) -> bytes:
    """A payload of ``nbytes`` random bytes (incompressible, and unique per seed)."""
    return encode_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(path: Path) -> Path:
    """Write ``path`` until the disk it is on has no free byte; the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (MiB, 64 << 10, 4096, 1):
            block = bytes(size)
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 24 MiB tmpfs, unmounted at the end (skips unless root and mount works)."""
    with mounted_tmpfs(tmp_path / "disk", str(DISK)) as mount_point:
        yield mount_point


def names(stub) -> list[str]:
    return [a.name for a in stub.List(pb.ListRequest()).archives]


def store_until_full(stub, data_dir: Path) -> dict[str, bytes]:
    """Store 3 MiB archives until the disk refuses one; the archives stored."""
    stored: dict[str, bytes] = {}
    for n in range(DISK // (3 * MiB) + 2):
        payload = payload_of(3 * MiB, n)
        try:
            stub.Store(store_requests(f"a{n}", {"w": payload}))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            assert_names_the_disk(exc.details(), data_dir)
            return stored
        stored[f"a{n}"] = payload
    raise AssertionError(f"a {DISK}-byte disk took {len(stored)} archives of 3 MiB")


def assert_names_the_disk(details: str, data_dir: Path) -> None:
    assert details.startswith("storage is full: no space left on device in "), details
    assert str(data_dir.resolve()) in details and details.endswith("delete archives to free space"), details


def assert_nothing_partial(server, stored: dict[str, bytes]) -> None:
    """No temporary file, every blob file referenced, and List shows the complete archives only."""
    data_dir = server.data_dir
    assert list((data_dir / "tmp").iterdir()) == []
    blobs = {p.name for p in (data_dir / "blobs").glob("*/*")}
    assert blobs == server.storage.catalog.referenced_digests()
    stub = server.archives()
    assert names(stub) == sorted(stored)
    for name, payload in stored.items():
        info = stub.Describe(pb.DescribeRequest(archive=name))
        assert [e.name for e in info.entries] == ["w"] and info.info.payload_bytes == len(payload)


def test_a_full_disk_refuses_stores_but_not_reads_or_deletes(small_disk):
    with running_server(small_disk, data_dir=small_disk / "data") as server:
        stub = server.archives()
        reserve = server.data_dir / "reserve"
        assert reserve.stat().st_size == server.storage.reserve.size >= 512 << 10

        stored = store_until_full(stub, server.data_dir)
        assert len(stored) >= 4
        assert_nothing_partial(server, stored)

        fill(small_disk / "filler")  # outside the data directory, on the same disk
        assert free_bytes(small_disk) == 0

        # Reads go on.
        first = min(stored)
        assert stub.Describe(pb.DescribeRequest(archive=first)).info.payload_bytes == len(stored[first])
        assert names(stub) == sorted(stored)
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive=first))) == {"w": stored[first]}

        # A Store is refused, naming the disk, and leaves nothing.
        with pytest.raises(grpc.RpcError) as refused:
            stub.Store(store_requests("more", {"w": payload_of(64 << 10, 99)}))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_names_the_disk(refused.value.details(), server.data_dir)
        assert_nothing_partial(server, stored)

        # Delete works with no free byte, and frees the archive's space.
        deleted = stub.Delete(pb.DeleteRequest(archive=first))
        assert deleted.deleted.name == first and deleted.blobs_removed == 1
        assert deleted.bytes_freed == len(stored.pop(first))
        assert free_bytes(small_disk) >= 2 * MiB  # 3 MiB back, less the re-created reserve
        assert reserve.stat().st_size == server.storage.reserve.size > 0 and server.storage.reserve.held

        # Stores resume.
        after = payload_of(MiB, 100)
        stub.Store(store_requests("after", {"w": after}))
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="after"))) == {"w": after}
        stored["after"] = after
        assert_nothing_partial(server, stored)


def test_a_server_restarted_on_a_full_disk_starts_and_lets_deletes_free_space(small_disk):
    data_dir = small_disk / "data"
    with running_server(small_disk, data_dir=data_dir) as server:
        stored = store_until_full(server.archives(), data_dir)
    # A clean stop removed SQLite's WAL and WAL index: fill what they held too.
    filler = fill(small_disk / "filler")
    assert free_bytes(small_disk) == 0

    with running_server(small_disk, data_dir=data_dir) as server:  # the catalog opens on the reserve's space
        stub = server.archives()
        assert not server.storage.reserve.held  # no room to re-create it: Stores are refused
        assert names(stub) == sorted(stored)
        first = min(stored)
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive=first))) == {"w": stored[first]}
        with pytest.raises(grpc.RpcError) as refused:
            stub.Store(store_requests("more", {"w": payload_of(4096, 99)}))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "kept in reserve so that Delete works on a full disk" in refused.value.details()
        assert_names_the_disk(refused.value.details(), data_dir)

        assert stub.Delete(pb.DeleteRequest(archive=first)).bytes_freed == len(stored.pop(first))
        assert server.storage.reserve.held and (data_dir / "reserve").is_file()
        stub.Store(store_requests("after", {"w": payload_of(MiB, 100)}))
        assert names(stub) == sorted([*stored, "after"])
    filler.unlink()


def test_a_missing_reserve_is_re_created_at_start(tmp_path):
    data_dir = tmp_path / "data"
    Storage.open_local(data_dir).close()
    reserve = data_dir / "reserve"
    size = reserve.stat().st_size
    assert size >= 1 << 20 and reserve.stat().st_blocks * 512 >= size  # allocated, not sparse
    reserve.unlink()  # as a crash between its release and its re-creation leaves it
    storage = Storage.open_local(data_dir)
    try:
        assert reserve.stat().st_size == size and storage.reserve.held
    finally:
        storage.close()
    Storage.open_local(data_dir, reserve_bytes=0).close()  # none asked for: the old one is left alone


def test_a_payload_in_flight_stops_writing_once_the_reserve_is_released(tmp_path):
    """The space a Delete released is not written into by a Store already under way."""
    storage = Storage.open_local(tmp_path / "data")
    try:
        writer = storage.new_payload()
        writer.write(b"x" * 1000)
        storage.reserve.release()  # as a Delete on a full disk does
        with pytest.raises(StorageFull, match="kept in reserve so that Delete works on a full disk"):
            writer.write(b"y" * 1000)
        writer.temp.discard()
        assert storage.reserve.ensure() and (tmp_path / "data" / "reserve").is_file()  # room again: writes resume
        writer = storage.new_payload()
        writer.write(b"z" * 1000)
        writer.temp.discard()
    finally:
        storage.close()
