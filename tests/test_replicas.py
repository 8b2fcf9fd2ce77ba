"""Two replicas on one PostgreSQL catalog and one S3 bucket (SeaweedFS), all real, on loopback.

Any replica answers any call; what one stores the other serves; concurrent writers of one
name or of equal tensors; a replica killed mid-Store; PostgreSQL and the bucket going away
and coming back; a Delete racing a Store that shares its blobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tannery_protocol.codec import encode_numpy
from tannery_protocol.names import join
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import ServerProcess, collect_fetch, free_port, running_server, store_requests, wait_for

pytestmark = pytest.mark.slow

#: Short enough that a test sees leases expire and blobs collected in seconds.
SHORT = {"lease_seconds": 2.0, "gc_grace_seconds": 1.0, "health_check_seconds": 0.2}


def payload(seed: int, size: int = 1 << 16) -> bytes:
    return encode_numpy(np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8))


@pytest.fixture
def shared(postgres_url, s3_url):
    """The settings of a replica on this test's database and bucket."""
    return {"catalog": postgres_url, "blobs": s3_url, **SHORT}


@pytest.fixture
def replicas(tmp_path, shared):
    """Two in-process replicas (each its own data directory, for its socket only)."""
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        yield a, b


def store(server, name: str, entries: dict[str, bytes], replace: bool = False) -> pb.StoreResponse:
    return server.archives().Store(store_requests(name, entries, replace=replace), timeout=60)


def fetch(server, name: str, **kwargs) -> dict[str, bytes]:
    return collect_fetch(server.archives().Fetch(pb.FetchRequest(archive=name, **kwargs), timeout=60))


def objects(server) -> set[str]:
    """The digests of the blobs in the bucket, as the replica's blob store lists them."""
    return set(server.storage.blobs.digests())


def test_what_one_replica_stores_the_other_serves_describes_unions_and_deletes(replicas):
    a, b = replicas
    entries = {"layer.0/weight": payload(1), "layer.0/bias": payload(2, 64)}
    store(a, "model", entries)
    assert fetch(b, "model") == entries
    rows = fetch(b, "model", entries=[pb.EntryAsk(name="layer.0/weight", rows=pb.RowRange(start=10, stop=20))])
    assert rows["layer.0/weight"].endswith(entries["layer.0/weight"][-(1 << 16):][10:20])
    described = b.archives().Describe(pb.DescribeRequest(archive="model"))
    assert sorted(e.name for e in described.entries) == sorted(entries)
    b.archives().Union(pb.UnionRequest(target="both", sources=[pb.UnionSource(archive="model", prefix="m")]))
    assert fetch(a, "both") == {join("m", k): v for k, v in entries.items()}
    listed = a.archives().List(pb.ListRequest())
    assert [r.name for r in listed.archives] == ["both", "model"]
    b.archives().Delete(pb.DeleteRequest(archive="model"))
    with pytest.raises(grpc.RpcError) as missing:
        fetch(a, "model")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert fetch(a, "both") == {join("m", k): v for k, v in entries.items()}  # blobs still referenced


def test_two_replicas_storing_one_name_at_once_one_succeeds_the_other_is_told_it_exists(replicas):
    a, b = replicas
    for round_ in range(3):
        name = f"race-{round_}"
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(store, server, name, {"w": payload(10 * round_ + i)}) for i, server in
                       enumerate((a, b))]
            outcomes = []
            for future in futures:
                try:
                    future.result()
                    outcomes.append("ok")
                except grpc.RpcError as exc:
                    outcomes.append(exc.code())
        assert sorted(map(str, outcomes)) == sorted(["ok", str(grpc.StatusCode.ALREADY_EXISTS)]), outcomes
        winner = 10 * round_ + outcomes.index("ok")
        assert fetch(a, name) == {"w": payload(winner)}


def test_replacing_one_name_from_two_replicas_at_once_keeps_one_whole_archive(replicas):
    a, b = replicas
    store(a, "m", {"x": payload(0)})
    versions = {server: {f"e{i}": payload(100 * n + i) for i in range(6)} for n, server in enumerate((a, b))}
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(store, s, "m", versions[s], True) for s in (a, b)]:
            future.result()
    got = fetch(b, "m")
    assert got in (versions[a], versions[b])  # never a mix of the two, never the first one's x


def test_equal_tensors_stored_at_once_by_two_replicas_are_one_object(replicas):
    a, b = replicas
    shared_bytes = payload(7, 3 << 20)  # several parts: a multipart upload on each replica
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda args: store(*args), [(a, "one", {"w": shared_bytes}), (b, "two", {"w": shared_bytes})]))
    assert fetch(b, "one") == fetch(a, "two") == {"w": shared_bytes}
    assert len(objects(a)) == 1


def test_a_delete_racing_a_store_that_shares_its_blobs_loses_nothing_referenced(replicas):
    a, b = replicas
    common = {f"w{i}": payload(200 + i) for i in range(4)}
    for round_ in range(4):
        store(a, "old", common, replace=True)
        with ThreadPoolExecutor(2) as pool:
            deleting = pool.submit(b.archives().Delete, pb.DeleteRequest(archive="old"))
            storing = pool.submit(store, a, f"new-{round_}", common)
            deleting.result()
            storing.result()
        time.sleep(SHORT["gc_grace_seconds"] + 1.5)  # past the grace period: a sweep has run
        assert fetch(b, f"new-{round_}") == common


def test_unreferenced_blobs_are_collected_after_the_grace_period_not_before(replicas):
    a, b = replicas
    store(a, "m", {"w": payload(300)})
    (digest,) = objects(a)
    b.archives().Delete(pb.DeleteRequest(archive="m"))
    assert digest in objects(a)  # the grace period runs from the delete
    assert wait_for(lambda: digest not in objects(a), timeout=15)
    assert b.storage.catalog.blob(digest) is None


def _health(server) -> int:
    stub = health_pb2_grpc.HealthStub(server.channel())
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _outage_then_recovery(replicas, service, named: tuple[str, ...], seed: int) -> None:
    """``service`` (PostgreSQL or SeaweedFS) stopped: a Fetch and a Store answer UNAVAILABLE naming
    it, health goes NOT_SERVING; started again: health SERVING, everything works, no restart."""
    a, b = replicas
    entries = {"w": payload(seed)}
    store(a, "m", entries)
    service.stop()
    try:
        with pytest.raises(grpc.RpcError) as down:
            fetch(b, "m")
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert all(word in down.value.details() for word in named), down.value.details()
        with pytest.raises(grpc.RpcError) as store_down:
            store(a, "n", entries)
        assert store_down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_for(lambda: _health(a) == _health(b) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=15)
    finally:
        service.start()
    assert wait_for(lambda: _health(a) == _health(b) == health_pb2.HealthCheckResponse.SERVING, timeout=60)
    assert fetch(b, "m") == entries
    store(a, "n", entries)
    assert fetch(b, "n") == entries


def test_postgres_stopped_during_traffic_answers_unavailable_naming_it_then_recovers(replicas, postgres_server):
    _outage_then_recovery(replicas, postgres_server, ("catalog", "postgresql://"), 400)


def test_the_bucket_unreachable_answers_unavailable_naming_it_then_recovers(replicas, seaweedfs):
    _outage_then_recovery(replicas, seaweedfs, ("bucket",), 500)


def test_a_replica_killed_mid_store_leaves_no_archive_the_other_serves_and_the_upload_is_collected(
        tmp_path, shared, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    flags = {k: v for k, v in shared.items()}
    with ServerProcess(tmp_path / "killed", env=env, **flags) as doomed, \
            running_server(tmp_path / "b", **shared) as survivor:
        kept = {"kept": payload(600)}
        store(survivor, "kept", kept)
        big = payload(601, 24 << 20)  # a multipart upload well under way when the kill comes
        requests = store_requests("partial", {"first": payload(602), "big": big}, chunk_size=1 << 20)
        started = threading.Event()

        def slow():
            for i, request in enumerate(requests):
                if i == 20:
                    started.set()
                    time.sleep(30)  # the kill comes meanwhile
                yield request

        call = doomed.archives().Store.future(slow(), timeout=60)
        assert started.wait(30)
        time.sleep(0.5)
        doomed.kill()
        with pytest.raises(grpc.RpcError):
            call.result()
        # No partial archive; the other replica serves; the first entry's blob, leased by the dead
        # replica, and its unfinished upload are collected once the lease and grace have passed.
        with pytest.raises(grpc.RpcError) as missing:
            fetch(survivor, "partial")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert fetch(survivor, "kept") == kept
        kept_digests = set(survivor.storage.catalog.referenced_digests())
        assert wait_for(lambda: objects(survivor) == kept_digests, timeout=30)
        assert wait_for(lambda: survivor.storage.blobs.temporaries() == [], timeout=30)
        assert fetch(survivor, "kept") == kept


def _serve(tmp_path, catalog: str, blobs: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """``tannery serve`` on ``catalog`` and ``blobs`` with ``flags``, run to its end (a start that fails)."""
    command = [*ServerProcess(tmp_path / "data", catalog=catalog, blobs=blobs).command(), *flags]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_a_replica_whose_bucket_does_not_exist_fails_its_start_with_one_line_naming_it_and_the_remedy(
        tmp_path, postgres_url, seaweedfs):
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    done = _serve(tmp_path, postgres_url, f"s3://{bucket}/tannery", seaweedfs.env())
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (f"tannery serve: bucket '{bucket}' does not exist at {seaweedfs.endpoint}: create it "
                           f"(aws s3 mb s3://{bucket} --endpoint-url {seaweedfs.endpoint}) or start with "
                           "--create-bucket\n")


def test_an_unreachable_bucket_fails_the_start_with_one_line_naming_it(tmp_path, postgres_url, seaweedfs):
    endpoint = f"http://127.0.0.1:{free_port()}"
    nowhere = {**seaweedfs.env(), "AWS_ENDPOINT_URL_S3": endpoint}
    done = _serve(tmp_path, postgres_url, "s3://checkpoints/tannery", nowhere)
    assert done.returncode == 1
    assert done.stderr.startswith(f"tannery serve: S3 bucket 'checkpoints' at {endpoint}: check the bucket failed: "
                                  "connection refused"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_with_create_bucket_a_replica_creates_its_missing_bucket_and_serves(tmp_path, postgres_url, seaweedfs,
                                                                              monkeypatch):
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"created-{uuid.uuid4().hex[:12]}"
    try:
        with running_server(tmp_path / "a", catalog=postgres_url, blobs=f"s3://{bucket}/tannery", create_bucket=True,
                            **SHORT) as a, \
                running_server(tmp_path / "b", catalog=postgres_url, blobs=f"s3://{bucket}/tannery",
                               create_bucket=True, **SHORT) as b:  # the bucket there already: nothing to do
            seaweedfs.client().head_bucket(Bucket=bucket)
            store(a, "m", {"w": payload(700)})
            assert fetch(b, "m") == {"w": payload(700)}
    finally:
        seaweedfs.client().delete_bucket(Bucket=bucket)


def test_create_bucket_is_a_flag_that_may_stand_alone():
    from tannery_server.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--create-bucket"]).create_bucket is True
    assert parser.parse_args(["serve", "--create-bucket", "off"]).create_bucket is False
    assert parser.parse_args(["serve"]).create_bucket is None  # not given: TANNERY_CREATE_BUCKET, then off
    assert parser.parse_args(["migrate", "--create-bucket"]).create_bucket is True


@pytest.mark.parametrize("command, remedy", [
    ("migrate", "create it (aws s3 mb s3://{bucket} --endpoint-url {endpoint}) or start with --create-bucket"),
    ("scrub", "check --blobs and AWS_ENDPOINT_URL_S3"),
])
def test_the_tools_name_a_missing_bucket_too(tmp_path, postgres_url, seaweedfs, command, remedy):
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "catalog.sqlite3").touch()  # migrate's source, never opened: the target fails first
    done = subprocess.run([sys.executable, "-m", "tannery_server", command, "--data-dir", str(tmp_path / "data"),
                           "--catalog", postgres_url, "--blobs", f"s3://{bucket}/tannery"],
                          env={**os.environ, **seaweedfs.env()}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr == (f"tannery {command}: bucket '{bucket}' does not exist at {seaweedfs.endpoint}: "
                           + remedy.format(bucket=bucket, endpoint=seaweedfs.endpoint) + "\n")


def test_a_catalog_unreachable_or_missing_at_start_fails_the_start_with_a_line_naming_it(tmp_path, postgres_server):
    unreachable = f"postgresql://tannery@127.0.0.1:{free_port()}/tannery"
    missing = postgres_server.url(f"missing_{uuid.uuid4().hex[:8]}")
    for url, reason in ((unreachable, "unreachable: connection refused"),
                        (missing, f'unreachable: database "{missing.rsplit("/", 1)[1]}" does not exist')):
        done = subprocess.run([*ServerProcess(tmp_path / "data", catalog=url).command()], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1
        last = done.stderr.splitlines()[-1]
        assert last == f"tannery serve: catalog {url} {reason} (creating or migrating the schema)", done.stderr
        assert "Traceback" not in done.stderr
