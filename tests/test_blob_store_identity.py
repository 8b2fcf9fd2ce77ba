"""A shared catalog knows its bucket (issue #43): a replica started on it with another bucket or
prefix, or on a bucket that is not the one recorded, stops at start naming both and the remedy.
Real PostgreSQL and SeaweedFS."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from tannery_server.storage.deployment import IDENTITY

from .server_harness import ServerProcess, running_server
from .test_replicas import SHORT, fetch, payload, store

pytestmark = pytest.mark.slow


def serve(tmp_path, catalog: str, blobs: str) -> subprocess.CompletedProcess:
    """``tannery serve`` on ``catalog`` and ``blobs``, run to its end (a start that fails)."""
    command = ServerProcess(tmp_path / f"data-{uuid.uuid4().hex[:6]}", catalog=catalog, blobs=blobs).command()
    return subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=120)


def bucket_of(s3_url: str) -> str:
    return s3_url[len("s3://"):].split("/", 1)[0]


def test_a_replica_on_the_catalog_with_another_prefix_is_refused_naming_both_and_migrate(tmp_path, postgres_url,
                                                                                         s3_url, seaweedfs):
    with running_server(tmp_path / "a", catalog=postgres_url, blobs=s3_url, **SHORT) as first:
        store(first, "kept", {"w": payload(1)})
        other = f"s3://{bucket_of(s3_url)}/elsewhere"
        done = serve(tmp_path, postgres_url, other)
        assert done.returncode == 1, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("tannery serve: catalog "), done.stderr
        assert f"belongs to blobs {s3_url} (recorded at its first start), not {other}: start with --blobs {s3_url}" \
            in line and "tannery migrate" in line, line
        assert "Traceback" not in done.stderr
        assert fetch(first, "kept") == {"w": payload(1)}  # the first deployment is untouched
    # The same bucket and prefix, spelled with a trailing slash, starts.
    with running_server(tmp_path / "b", catalog=postgres_url, blobs=s3_url + "/", **SHORT) as again:
        assert fetch(again, "kept") == {"w": payload(1)}


def test_the_identity_object_is_written_once_and_a_bucket_without_it_is_refused(tmp_path, postgres_url, s3_url,
                                                                                 seaweedfs):
    bucket, prefix = bucket_of(s3_url), s3_url.split("/", 3)[3]
    key = f"{prefix}/{IDENTITY}"
    with running_server(tmp_path / "a", catalog=postgres_url, blobs=s3_url, **SHORT):
        pass
    client = seaweedfs.client()
    identity = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert identity["url"] == s3_url and len(identity["identity"]) == 32
    with running_server(tmp_path / "b", catalog=postgres_url, blobs=s3_url, **SHORT):
        pass  # started again: the same identity, not a new one
    assert json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read()) == identity
    client.delete_object(Bucket=bucket, Key=key)  # as if another endpoint's bucket of the same name
    done = serve(tmp_path, postgres_url, s3_url)
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert f"with identity {identity['identity']}, but {s3_url} at {seaweedfs.endpoint} has no {IDENTITY} object" \
        in line and "AWS_ENDPOINT_URL_S3" in line, line


def test_a_new_catalog_on_a_prefix_that_holds_another_catalogs_identity_is_refused(tmp_path, postgres_url,
                                                                                    postgres_server, s3_url):
    with running_server(tmp_path / "a", catalog=postgres_url, blobs=s3_url, **SHORT):
        pass
    name = f"second_{uuid.uuid4().hex[:8]}"
    second = postgres_server.create_database(name)
    try:
        done = serve(tmp_path, second, s3_url)
        assert done.returncode == 1
        line = done.stderr.strip().splitlines()[-1]
        assert f"{s3_url} at " in line and "belongs to another catalog" in line and "bucket or prefix of its own" \
            in line, line
    finally:
        postgres_server.drop_database(name)


def test_a_shared_directory_of_blobs_is_recorded_and_checked_the_same_way(tmp_path, postgres_url):
    from tannery_server.storage import WrongBlobStore
    from tannery_server.storage.deployment import check_blob_store
    from tannery_server.storage.file_blobs import FileBlobStore

    mounted, other = tmp_path / "mounted", tmp_path / "other"
    identity = check_blob_store(postgres_url, "the catalog", f"file:{mounted}", FileBlobStore(mounted))
    assert json.loads((mounted / IDENTITY).read_text())["identity"] == identity
    assert (mounted / IDENTITY).stat().st_mode & 0o077 == 0  # private, as every file of the store
    assert check_blob_store(postgres_url, "the catalog", f"file:{mounted}", FileBlobStore(mounted)) == identity
    with pytest.raises(WrongBlobStore, match=f"catalog the catalog belongs to blobs file:{mounted} .recorded at its "
                                             f"first start., not file:{other}: start with --blobs file:{mounted}"):
        check_blob_store(postgres_url, "the catalog", f"file:{other}", FileBlobStore(other))
    (mounted / IDENTITY).unlink()  # the directory another one mounted at the same path
    with pytest.raises(WrongBlobStore, match=f"but file:{mounted} has no {IDENTITY} object"):
        check_blob_store(postgres_url, "the catalog", f"file:{mounted}", FileBlobStore(mounted))


def test_a_catalog_from_before_the_record_is_recorded_only_with_the_bucket_its_archives_are_in(
        tmp_path, postgres_url, s3_url, seaweedfs):
    import psycopg

    with running_server(tmp_path / "a", catalog=postgres_url, blobs=s3_url, **SHORT) as first:
        store(first, "kept", {"w": payload(2)})
    bucket, prefix = bucket_of(s3_url), s3_url.split("/", 3)[3]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP TABLE blob_store")  # as a catalog of a tannery from before it
    seaweedfs.client().delete_object(Bucket=bucket, Key=f"{prefix}/{IDENTITY}")
    done = serve(tmp_path, postgres_url, f"s3://{bucket}/elsewhere")
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert "holds archives whose blob" in line and f"is not in s3://{bucket}/elsewhere at " in line, line
    with running_server(tmp_path / "b", catalog=postgres_url, blobs=s3_url, **SHORT) as again:
        assert fetch(again, "kept") == {"w": payload(2)}
    assert serve(tmp_path, postgres_url, f"s3://{bucket}/elsewhere").returncode == 1  # recorded now
