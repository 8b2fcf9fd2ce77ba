"""Scrub finds leaks both ways (issue 43): bytes that no catalog row references (reported once
older than the grace period, deleted by ``--repair``) and rows whose bytes are gone (reported
with the archive entries that use them). Both backends: a data directory (SQLite and files),
and a PostgreSQL catalog with a SeaweedFS bucket beside a running replica."""

from __future__ import annotations

import hashlib
import os
from urllib.parse import urlsplit

import pytest

from tannery_server.cli import main
from tannery_server.storage import Storage

from .server_harness import running_server
from .test_replicas import SHORT, objects, payload, store
from .test_storage import _store


def _leak_lines(out: str, leak: str, gone: str, used_by: str) -> None:
    """The scrub's output names the leak and the missing blob with the entry that uses it."""
    assert f"blob {leak} leaked: no catalog row references it" in out, out
    assert f"blob {gone} is missing: its bytes are gone from the blob store; used by {used_by}" in out, out


def _scrub(capsys, *flags: str) -> tuple[int, str]:
    status = main(["scrub", *flags])
    out = capsys.readouterr().out
    with capsys.disabled():
        print(out)  # what scrub printed (the issue asks for it), shown with -s
    return status, out


def test_scrub_of_a_data_directory_names_a_leaked_file_and_a_missing_one_and_repair_removes_the_leak(
        tmp_path, capsys):
    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    try:
        _store(storage, "kept", {"w": os.urandom(5000)})
        gone_payload = os.urandom(7000)
        _store(storage, "lost", {"w": gone_payload})
    finally:
        storage.close()
    blob = lambda digest: data_dir / "blobs" / digest[:2] / digest  # noqa: E731
    leaked_bytes = os.urandom(3000)
    leak = hashlib.sha256(leaked_bytes).hexdigest()
    blob(leak).parent.mkdir(exist_ok=True)
    blob(leak).write_bytes(leaked_bytes)  # bytes nothing references
    gone = hashlib.sha256(gone_payload).hexdigest()
    blob(gone).unlink()  # a row whose bytes were deleted by hand

    status, out = _scrub(capsys, "--data-dir", str(data_dir))
    assert status == 1 and leak not in out, "a leak younger than the grace period may be a Store under way"
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--gc-grace-seconds", "0")
    assert status == 1
    _leak_lines(out, leak, gone, "lost:w")
    assert out.endswith("checked 2 blobs: 1 missing, 1 leaked\n"), out
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--gc-grace-seconds", "0", "--repair")
    assert status == 1 and f"blob {leak} leaked" in out and "; removed" in out
    assert not blob(leak).exists()
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--gc-grace-seconds", "0")
    assert status == 1 and leak not in out and out.endswith("checked 2 blobs: 1 missing\n"), out


@pytest.mark.slow
def test_scrub_of_a_shared_store_names_a_leaked_object_and_a_missing_one_and_repair_removes_the_leak(
        tmp_path, postgres_url, s3_url, seaweedfs, capsys):
    parts = urlsplit(s3_url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    key = lambda digest: f"{prefix}/blobs/{digest[:2]}/{digest[2:4]}/{digest}"  # noqa: E731
    s3 = seaweedfs.client()
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        store(server, "kept", {"w": payload(1)})
        before = objects(server)
        store(server, "lost", {"w": payload(2)})
        (gone,) = objects(server) - before
        leaked_bytes = os.urandom(3000)
        leak = hashlib.sha256(leaked_bytes).hexdigest()
        s3.put_object(Bucket=bucket, Key=key(leak), Body=leaked_bytes)  # an object nothing references
        s3.delete_object(Bucket=bucket, Key=key(gone))  # a row whose object was deleted by hand
        flags = ("--catalog", postgres_url, "--blobs", s3_url, "--gc-grace-seconds", "0")

        status, out = _scrub(capsys, *flags)  # beside the running replica
        assert status == 1
        _leak_lines(out, leak, gone, "lost:w")
        assert out.endswith("checked 2 blobs: 1 missing, 1 leaked\n"), out
        status, out = _scrub(capsys, *flags, "--repair")
        assert status == 1 and "; removed" in out
        assert leak not in objects(server)
        assert server.storage.catalog.blob(leak) is None, "the claim's placeholder row is gone with the object"
        status, out = _scrub(capsys, *flags)
        assert status == 1 and leak not in out and out.endswith("checked 2 blobs: 1 missing\n"), out
