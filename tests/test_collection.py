"""Collection that never stalls (issue 43): a bucket that refuses the DELETE of one object does
not stop the others being collected; the stuck one is counted in the metrics, named in the log,
and collected once the bucket lets it go. Real PostgreSQL and SeaweedFS, a proxy in between."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from prometheus_client import generate_latest

from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.config import Config
from tannery_server.metrics import ServerMetrics
from tannery_server.storage.factory import open_storage

from .s3_proxy import S3Proxy
from .server_harness import running_server, store_requests
from .test_replicas import SHORT, fetch, objects, payload, store

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(s3_url, seaweedfs, monkeypatch):
    """A proxy in front of this test's SeaweedFS, which the servers of the test use."""
    server = S3Proxy(seaweedfs.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    yield server
    server.close()


def _metric(metrics: ServerMetrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not exported")


def _wait(condition, seconds: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails naming ``what`` after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_stuck_object_does_not_stop_collection_and_shows_in_the_metric_and_the_log(
        tmp_path, postgres_url, s3_url, proxy, caplog):
    caplog.set_level(logging.WARNING, logger="tannery_server.storage")
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        metrics = ServerMetrics()
        metrics.watch_storage(server.storage)
        digests = []
        for i in range(6):
            before = objects(server)
            store(server, f"a{i}", {"w": payload(i)})
            digests += sorted(objects(server) - before)
        assert len(digests) == 6 and fetch(server, "a3") == {"w": payload(3)}
        stuck = digests[0]  # the oldest: first among the candidates of every sweep
        proxy.refuse_delete = stuck
        for i in range(6):
            server.archives().Delete(pb.DeleteRequest(archive=f"a{i}"))
        deleted = time.monotonic()
        _wait(lambda: objects(server) == {stuck}, 20, "the five other orphans collected")
        past_stuck = time.monotonic() - deleted
        _wait(lambda: proxy.refused >= 1, 5, "the stuck DELETE tried")
        assert _metric(metrics, "tannery_collection_failures_total") >= 1
        assert _metric(metrics, "tannery_collection_stuck_blobs") == 1
        named = [r.getMessage() for r in caplog.records if stuck in r.getMessage()]
        assert named and "access denied" in named[0] and "could not collect blob" in named[0], named
        print(f"collection got past the stuck object: the 5 other orphans gone {past_stuck:.2f} s after the "
              f"deletes (grace {SHORT['gc_grace_seconds']} s, sweep every {server.storage.sweep_seconds} s); "
              f"log: {named[0]}")
        proxy.refuse_delete = None  # the bucket lets it go: its backoff ends and it is collected
        _wait(lambda: objects(server) == set(), 30, "the stuck object collected once the bucket allows it")
        _wait(lambda: _metric(metrics, "tannery_collection_stuck_blobs") == 0, 5, "the stuck gauge back to 0")


def test_a_store_that_leases_a_blob_under_collection_waits_and_keeps_its_bytes(postgres_url, s3_url, proxy):
    """A lease of a blob whose row a collection has claimed waits for the delete, then the
    Store uploads the bytes again: the archive it commits reads back whole."""
    config = Config(catalog=postgres_url, blobs=s3_url, gc_grace_seconds=0.0, lease_seconds=60.0)
    storage = open_storage(config, collecting=True)
    try:
        catalog = storage.catalog
        writer = storage.new_payload()
        writer.write(b"x" * 1000)
        blob = storage.seal(writer, "h1")
        storage.release([], holder="h1")  # unleased, unreferenced: collectable now
        time.sleep(0.01)
        now = time.time_ns()
        claimed = {}

        def slow_remove(digest: str) -> None:
            claimed["lease"] = threading.Thread(
                target=lambda: claimed.setdefault("existed", catalog.lease(blob, "r", "h2", now + 60 * 10**9)))
            claimed["lease"].start()
            time.sleep(0.5)
            assert "existed" not in claimed, "the lease did not wait for the claim"
            storage.blobs.remove(digest)

        assert catalog.collect_blob(blob.digest, now, now, slow_remove) is True
        claimed["lease"].join(5)
        assert claimed["existed"] is False, "the lease must tell its caller to upload the bytes again"
        assert catalog.blob(blob.digest) is not None
    finally:
        storage.close()


def test_leases_are_renewed_while_a_collection_waits_on_a_slow_bucket(tmp_path, postgres_url, s3_url, proxy):
    """A Store that holds its first blob's lease past ``lease_seconds`` commits while the sweeper
    is stuck for longer in one slow DELETE: leases are renewed by a thread of their own."""
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        store(server, "old", {"w": payload(0)})
        (orphan,) = objects(server)
        proxy.slow_delete, proxy.slow_seconds = orphan, 3 * SHORT["lease_seconds"]
        server.archives().Delete(pb.DeleteRequest(archive="old"))
        big = {"a": payload(1, 3 << 20), "b": payload(2, 3 << 20)}  # each its own blob, leased when sealed

        def slow_requests():
            for request in store_requests("new", big):
                if request.entry == "b":  # "a" is sealed and leased: wait past its lease's first expiry
                    time.sleep(2 * SHORT["lease_seconds"])
                yield request

        _wait(lambda: orphan not in set(server.storage.catalog.collectable(time.time_ns(), time.time_ns(), 10))
              and server.storage.catalog.blob(orphan) is not None, 10, "the sweeper claiming the orphan")
        server.archives().Store(slow_requests(), timeout=60)
        assert fetch(server, "new") == big
        _wait(lambda: orphan not in objects(server), 20, "the slow delete done")
