"""Memory files made ready between versions (issue 37): a same-host publisher writes each
version's payloads into files whose pages were allocated ahead, off the push's path; each
file is still written once, sealed and sent once."""

from __future__ import annotations

import fcntl
import gc
import os

import pytest
import torch

import tannery
from tannery.dataplane.memory_files import MIN_PREPARED, MemoryFiles
from tannery.weights import Follower, Publisher

from .server_harness import running_server
from .weights_worker import digests

MiB = 1 << 20


def prepared(files: MemoryFiles) -> list[int]:
    files._thread.join()
    return [capacity for capacity, _ in files._ready]


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def identities(files: MemoryFiles) -> list[tuple[int, int]]:
    """Each ready file's descriptor and inode (a descriptor's number is reused once closed)."""
    return [(fd, os.fstat(fd).st_ino) for _, fd in files._ready]


def closed(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino != inode
    except OSError:
        return True


def test_files_are_made_ready_for_the_sizes_sent_within_the_budget_largest_first():
    files = MemoryFiles(budget=9 * MiB)
    files.expect([2 * MiB, 100, 8 * MiB, MiB, MIN_PREPARED - 1])
    assert prepared(files) == [MiB, 8 * MiB]  # 8 + 1 fit the budget; 2 does not; small ones are not made
    assert all(allocated(fd) >= capacity for capacity, fd in files._ready)  # their pages are there
    files.close()


def test_take_cuts_the_smallest_file_that_holds_the_payload_and_it_can_be_sealed():
    files = MemoryFiles()
    files.expect([8 * MiB, 3 * MiB])
    prepared(files)
    fd = files.take("x", 5 * MiB)  # the 8 MiB file: the 3 MiB one is too small
    try:
        assert os.fstat(fd).st_size == 5 * MiB and allocated(fd) <= 5 * MiB + 64 * 1024
        os.pwrite(fd, b"tannery", 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)
    fresh = files.take("y", 4 * MiB)  # only the 3 MiB file is left: a fresh one
    assert (files.hits, files.misses) == (1, 1) and os.fstat(fresh).st_size == 4 * MiB
    os.close(fresh)
    assert prepared(files) == [3 * MiB]
    files.close()


def test_a_new_expect_drops_what_was_not_taken_and_close_frees_everything():
    files = MemoryFiles()
    files.expect([2 * MiB])
    prepared(files)
    old = identities(files)
    files.expect([4 * MiB])
    assert prepared(files) == [4 * MiB]
    assert old and all(closed(fd, inode) for fd, inode in old)
    kept = identities(files)
    files.close()
    assert files._ready == [] and all(closed(fd, inode) for fd, inode in kept)


def test_a_publisher_dropped_lets_its_ready_files_go():
    files = MemoryFiles()
    files.expect([2 * MiB])
    prepared(files)
    kept = identities(files)
    assert kept
    del files
    gc.collect()
    assert all(closed(fd, inode) for fd, inode in kept)


def test_a_same_host_publisher_writes_its_next_versions_into_ready_files_bit_exact(tmp_path):
    sizes = {"embed.weight": (512, 1024), "layers.0.weight": (1024, 1024), "layers.0.bias": (1024,)}
    versions = [{k: torch.randn(shape, generator=torch.Generator().manual_seed(v)) for k, shape in sizes.items()}
                for v in range(3)]
    with running_server(tmp_path) as srv, tannery.Client(srv.target, transport="local") as client:
        publisher = Publisher(client, "policy", delta=False)
        files = publisher._pushing.files
        target = {k: torch.zeros(shape) for k, shape in sizes.items()}
        with Follower(client, "policy", target) as follower:
            for version, state in enumerate(versions):
                publisher.push(state, version)
                assert next(iter(follower)).version == version
                assert digests(target) == digests(state)
                prepared(files)
        # Five payloads a version (manifest, three tensors, end): version 0 found nothing ready;
        # versions 1 and 2 found a file for each of the two payloads of 1 MiB or more.
        assert (files.hits, files.misses) == (2 * 2, 5 + 2 * 3)
        fetched = client.fetch("policy/v2")
        assert digests({k: fetched.find(k) for k in fetched.names()}) == digests(versions[2])


def test_ready_bytes_zero_makes_no_files_and_tcp_never_uses_them(tmp_path):
    with running_server(tmp_path) as srv, tannery.Client(srv.target, transport="tcp") as client:
        assert Publisher(client, "off", ready_bytes=0)._pushing.files is None
        publisher = Publisher(client, "policy", delta=False)
        publisher.push({"w": torch.randn(1024, 1024)}, 0)
        assert publisher._pushing.files.prepared_bytes == 0
