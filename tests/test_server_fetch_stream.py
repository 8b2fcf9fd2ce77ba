"""Fetch streams that know their end: one trip for a small fetch, and pins released however a fetch ends."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from tannery_protocol import codec
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.dataplane.fetch import FETCH_BATCH_BYTES, FetchStream
from tannery_server.storage import Damaged

from .server_harness import collect_fetch, running_server, store_requests

CHUNK = 64 << 10


@pytest.fixture
def srv(tmp_path):
    with running_server(tmp_path, chunk_size=CHUNK) as server:
        stub = server.archives()
        payloads = {"small": codec.encode_numpy(np.arange(1024, dtype=np.float32)),
                    "big": codec.encode_numpy(np.arange(3 * FETCH_BATCH_BYTES // 4, dtype=np.float32))}
        stub.Store(store_requests("a", payloads, CHUNK))
        server.payloads = payloads
        yield server


def pins(server) -> dict:
    return dict(server.storage._pins)


def wait_unpinned(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pins(server) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pins(server) == {}


def request(*names: str) -> pb.FetchRequest:
    return pb.FetchRequest(archive="a", entries=[pb.EntryAsk(name=n) for n in names])


def test_a_fetch_that_fits_in_one_batch_is_over_after_one_trip(srv):
    stream, batch = FetchStream.open(srv.storage, request("small"), CHUNK, FETCH_BATCH_BYTES)
    assert stream.done and pins(srv) == {}  # resolved, read, blob closed and unpinned: nothing left to do
    assert b"".join(batch).endswith(srv.payloads["small"])


def test_a_longer_fetch_says_which_batch_is_its_last(srv):
    stream, batch = FetchStream.open(srv.storage, request("small", "big"), CHUNK, FETCH_BATCH_BYTES)
    batches = [batch]
    assert not stream.done and pins(srv)
    while not stream.done:
        batches.append(stream.next_batch(FETCH_BATCH_BYTES))
    assert len(batches) == 4 and all(batches) and pins(srv) == {}
    sizes = [sum(map(len, b)) for b in batches]
    assert all(size >= FETCH_BATCH_BYTES for size in sizes[:-1]), sizes


def test_a_failing_first_batch_releases_the_pins(srv):
    digest = srv.storage.catalog.entries("a", ["small"])["small"].digest
    srv.storage.blobs.path(digest).unlink()
    with pytest.raises(Damaged, match=f"'small'.*: stored blob {digest} is missing$"):
        FetchStream.open(srv.storage, request("small"), CHUNK, FETCH_BATCH_BYTES)
    assert pins(srv) == {}


def test_a_failure_comes_after_the_messages_before_it(srv):
    digest = srv.storage.catalog.entries("a", ["big"])["big"].digest
    srv.storage.blobs.path(digest).unlink()
    stream, batch = FetchStream.open(srv.storage, request("small", "big"), CHUNK, FETCH_BATCH_BYTES)
    assert b"".join(batch).endswith(srv.payloads["small"]) and not stream.done
    with pytest.raises(Damaged, match=f"'big'.*: stored blob {digest} is missing$"):
        stream.next_batch(FETCH_BATCH_BYTES)
    stream.close()
    assert pins(srv) == {}


@pytest.mark.parametrize("names", [("small",), ("small", "big")])
def test_fetches_serve_everything_and_unpin(srv, names):
    got = collect_fetch(srv.archives().Fetch(request(*names)))
    assert [(n, bytes(p)) for n, p in got.items()] == [(n, srv.payloads[n]) for n in names]
    wait_unpinned(srv)


def test_a_fetch_cancelled_midway_unpins_and_its_blobs_can_go(srv):
    call = srv.archives().Fetch(request("big"))
    next(call)
    assert pins(srv)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    wait_unpinned(srv)
    deleted = srv.archives().Delete(pb.DeleteRequest(archive="a"))
    assert deleted.blobs_removed == 2
