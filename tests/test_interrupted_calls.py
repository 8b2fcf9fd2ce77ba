"""Calls cut off the way real clients cut them off: nothing committed, nothing held.

A Store commits only on its client's final ``commit``: cancelled, past its deadline, over
the message size limit or simply ended without it, it stores nothing and leaves no file.
A cancelled Fetch releases its pins and closes its blobs at once, so a Delete frees them.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc
import pytest
import torch

import tannery
from tannery.torch import serialize
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import collect_fetch, commit_request, running_server, store_requests, wait_for


def payload_of(n: int, seed: int = 0) -> bytes:
    return serialize(torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def blob_files(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "blobs").rglob("*") if p.is_file()}


def temporary_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "tmp").iterdir())


def archive_names(stub) -> list[str]:
    return [a.name for a in stub.List(pb.ListRequest()).archives]


def settled(srv, stub, names: list[str], blobs: set[str]) -> bool:
    """The store holds exactly ``names`` and ``blobs``, with no temporary file."""
    return archive_names(stub) == names and blob_files(srv.data_dir) == blobs and not temporary_files(srv.data_dir)


class CallLog(logging.Handler):
    """The status of every call the server logs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if fields:
            self.calls.append(fields)


@pytest.fixture
def call_log():
    handler = CallLog()
    logger = logging.getLogger("tannery_server.calls")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def entries_then_wait(archive: str, entries: dict[str, bytes], sent: threading.Event, release: threading.Event):
    """Whole entries, then nothing until ``release``: a client killed between two entries."""
    yield from store_requests(archive, entries, 64 * 1024, commit=False)
    sent.set()
    release.wait(30)


# Store: whole or nothing --------------------------------------------------------------


def test_a_store_cancelled_between_whole_entries_commits_nothing(tmp_path, call_log):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        stub.Store(store_requests("kept", {"w": payload_of(100)}))
        kept = blob_files(srv.data_dir)
        for attempt in range(10):
            sent, release = threading.Event(), threading.Event()
            future = stub.Store.future(entries_then_wait(  # payloads over 1 MiB: a blob each, not a pack
                f"cut-{attempt}", {"a": payload_of(300_000, 1), "b": payload_of(300_001, 2)}, sent, release))
            assert sent.wait(30)
            # Both entries are blobs on the server: it holds the call, between two entries.
            assert wait_for(lambda: len(blob_files(srv.data_dir)) == len(kept) + 2)
            future.cancel()
            release.set()
            assert wait_for(lambda: settled(srv, stub, ["kept"], kept)), f"attempt {attempt}: {archive_names(stub)}"
        assert wait_for(lambda: len([c for c in call_log.calls if c.get("archive", "").startswith("cut-")]) == 10)
        stores = [c for c in call_log.calls if c.get("archive", "").startswith("cut-")]
        assert {c["status"] for c in stores} == {"CANCELLED"}


def test_a_store_past_its_deadline_commits_nothing(tmp_path):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        sent, release = threading.Event(), threading.Event()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Store(entries_then_wait("late", {"a": payload_of(5000)}, sent, release), timeout=1.0)
        release.set()
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: settled(srv, stub, [], set()))


def test_a_store_that_ends_without_commit_stores_nothing(tmp_path):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Store(store_requests("a", {"w": payload_of(10), "v": payload_of(20)}, commit=False))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ended without commit, after 2 whole entries" in caught.value.details()
        assert settled(srv, stub, [], set())


@pytest.mark.parametrize("entries, sent, said", [
    (1, None, "commit says 1 entries of"), (3, None, "commit says 3 entries"), (2, 5, "commit says 2 entries of 5"),
])
def test_a_commit_whose_counts_disagree_stores_nothing(tmp_path, entries, sent, said):
    payloads = {"w": payload_of(10), "v": payload_of(20)}
    total = sum(map(len, payloads.values())) if sent is None else sent
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        messages = [*store_requests("a", payloads, commit=False), commit_request(entries, total)]
        with pytest.raises(grpc.RpcError) as caught:
            stub.Store(iter(messages))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert said in caught.value.details() and "2 entries of" in caught.value.details()
        assert settled(srv, stub, [], set())


def test_a_message_after_commit_is_refused(tmp_path):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        messages = [*store_requests("a", {"w": payload_of(10)}), pb.StoreRequest(entry="v", chunk=payload_of(5))]
        with pytest.raises(grpc.RpcError) as caught:
            stub.Store(iter(messages))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a message after commit" in caught.value.details()
        assert settled(srv, stub, [], set())


@pytest.mark.parametrize("big_first", [False, True])
def test_a_message_over_the_size_limit_commits_nothing(tmp_path, big_first):
    """gRPC refuses the message (RESOURCE_EXHAUSTED) and ends the server's request stream."""
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        small = payload_of(10)
        over = pb.StoreRequest(entry="big", chunk=bytes(5 << 20))  # over gRPC's 4 MiB receive limit
        whole = [pb.StoreRequest(entry="a", chunk=small)]
        messages = [pb.StoreRequest(begin=pb.StoreBegin(archive="x")),
                    *([over] if big_first else whole + [over]), commit_request(1, len(small))]
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Store(iter(messages))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert wait_for(lambda: settled(srv, stub, [], set()))


def test_an_existing_name_is_refused_before_any_tensor_byte(tmp_path):
    """ALREADY_EXISTS at the entry's header (another shape than the one stored): the client's
    upload stops at once, not after 512 MiB."""
    with running_server(tmp_path) as srv:
        with tannery.Client(srv.target) as client:
            client.store("taken", {"w": torch.ones(3)})
            big = torch.zeros(128 << 20)  # 512 MiB
            sent = []
            with pytest.raises(tannery.AlreadyExists) as caught:
                client.store("taken", {"w": big}, progress=sent.append)
            assert "--replace" in str(caught.value) or "replace" in str(caught.value)
            assert sum(sent) < 64 << 20, f"{sum(sent)} bytes sent before the refusal"
            assert client.fetch("taken").tensor("w", (3,), torch.float32).tolist() == [1.0, 1.0, 1.0]


# Fetch: cancelled, everything released --------------------------------------------------


def open_blob_fds(data_dir: Path) -> list[str]:
    """Files under ``data_dir/blobs`` this process (the in-process server) holds open."""
    blobs = str((data_dir / "blobs").resolve())
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(blobs):
            held.append(target)
    return held


def test_a_cancelled_fetch_releases_its_pins_and_files_at_once(tmp_path, call_log):
    with running_server(tmp_path) as srv:
        stub = srv.archives()
        entries = {f"e{i}": payload_of(8 << 20, i) for i in range(4)}  # 4 x 32 MiB
        stub.Store(store_requests("big", entries))
        for _ in range(3):
            responses = stub.Fetch(pb.FetchRequest(archive="big"))
            next(responses)
            responses.cancel()
        assert wait_for(lambda: not srv.storage._pins and not open_blob_fds(srv.data_dir)), (
            dict(srv.storage._pins), open_blob_fds(srv.data_dir))
        deleted = stub.Delete(pb.DeleteRequest(archive="big"))
        assert deleted.blobs_removed == 4 and blob_files(srv.data_dir) == set()
        assert wait_for(lambda: sum(c["method"] == "Fetch" for c in call_log.calls) == 3)
        assert {c["status"] for c in call_log.calls if c["method"] == "Fetch"} == {"CANCELLED"}


def test_a_fetch_cancelled_at_any_moment_leaves_nothing_held(tmp_path):
    with running_server(tmp_path, chunk_size=64 << 10) as srv:
        stub = srv.archives()
        entries = {f"e{i}": payload_of(1 << 20, i) for i in range(6)}
        stub.Store(store_requests("a", entries))
        for received in range(0, 300, 23):
            responses = stub.Fetch(pb.FetchRequest(archive="a"))
            for _ in range(received):
                next(responses, None)
            responses.cancel()
        assert wait_for(lambda: not srv.storage._pins and not open_blob_fds(srv.data_dir))
        assert collect_fetch(stub.Fetch(pb.FetchRequest(archive="a"))) == dict(sorted(entries.items()))
