"""``tannery scrub --repair`` marks the blobs whose bytes are gone (issue 43), so people see the
loss before they fetch: Describe names the archive's lost entries (client API, ``tannery show``
and its ``--json``), the mark survives a restart, and a scrub that finds the bytes back (restored
from a backup) clears it. Both backends: a data directory (SQLite and files), and a PostgreSQL
catalog with a SeaweedFS bucket beside a running replica."""

from __future__ import annotations

import hashlib
import json
import os
from urllib.parse import urlsplit

import pytest

import tannery
from tannery.cli import main as client_main
from tannery_server.cli import main
from tannery_server.storage import Storage, lost_marks

from .server_harness import running_server
from .test_replicas import SHORT, objects, payload, store
from .test_storage import _store

LOST_LINE = "1 entry's bytes are gone (tannery scrub found them): w; fetch them from a backup, or delete the archive"


def _scrub(capsys, *flags: str) -> tuple[int, str]:
    status = main(["scrub", *flags])
    out = capsys.readouterr().out
    with capsys.disabled():
        print(out)
    return status, out


def _shown(server, capsys, name: str) -> tuple[str, dict]:
    """``tannery show NAME``: its text, and its --json."""
    capsys.readouterr()
    assert client_main(["--target", server.target, "show", name]) == 0
    text = capsys.readouterr().out
    assert client_main(["--target", server.target, "show", name, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def _lost_entries(server, name: str) -> tuple[str, ...]:
    with tannery.Client(server.target) as client:
        return client.describe(name).lost_entries


def test_repair_marks_a_missing_blob_describe_and_show_name_it_across_restarts_and_a_restore_clears_it(
        tmp_path, capsys, monkeypatch):
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN", "TANNERY_TLS"):
        monkeypatch.delenv(name, raising=False)
    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    gone_payload, kept_payload = os.urandom(7000), os.urandom(5000)
    try:
        _store(storage, "kept", {"w": kept_payload})
        _store(storage, "lost", {"w": gone_payload, "b": os.urandom(6000)})
    finally:
        storage.close()
    gone = hashlib.sha256(gone_payload).hexdigest()
    blob = data_dir / "blobs" / gone[:2] / gone
    backup = blob.read_bytes()
    blob.unlink()

    status, out = _scrub(capsys, "--data-dir", str(data_dir))
    assert status == 1 and "; marked" not in out, "without --repair scrub writes nothing"
    with running_server(tmp_path) as server:
        assert _lost_entries(server, "lost") == ()
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--repair")
    assert status == 1
    assert f"blob {gone} is missing: its bytes are gone from the blob store; used by lost:w; marked\n" in out, out

    for _ in range(2):  # a server started on the catalog, and started again: the mark is kept
        with running_server(tmp_path) as server:
            assert _lost_entries(server, "lost") == ("w",)
            assert _lost_entries(server, "kept") == ()
            with tannery.Client(server.target) as client:
                assert client.describe("lost", names=["b"]).lost_entries == ("w",), "whatever names ask"
            text, shown = _shown(server, capsys, "lost")
            assert LOST_LINE in text, text
            assert shown["lost_entries"] == ["w"]
            text, shown = _shown(server, capsys, "kept")
            assert "gone" not in text and shown["lost_entries"] == []
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--repair")
    assert status == 1 and out.count("; marked") == 1, "marked again: still one mark"

    blob.write_bytes(backup)  # restored from a backup
    status, out = _scrub(capsys, "--data-dir", str(data_dir), "--repair")
    assert status == 0 and f"blob {gone} is no longer missing; its lost mark cleared\n" in out, out
    with running_server(tmp_path) as server:
        assert _lost_entries(server, "lost") == ()
        text, shown = _shown(server, capsys, "lost")
        assert "gone" not in text and shown["lost_entries"] == []


def test_the_sqlite_catalog_of_the_previous_schema_gets_the_table_at_open(tmp_path):
    import sqlite3

    from tannery_server.storage.sqlite_schema import MIGRATIONS, SCHEMA_VERSION

    data_dir = tmp_path / "data"
    Storage.open_local(data_dir).close()
    conn = sqlite3.connect(data_dir / "catalog.sqlite3")
    conn.execute("DROP TABLE lost_blobs")
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) - 1}")
    conn.commit()
    conn.close()
    storage = Storage.open_local(data_dir)
    try:
        assert lost_marks.mark(storage.catalog, ["ab" * 32], 5) == ["ab" * 32]
        assert lost_marks.marked(storage.catalog) == {"ab" * 32: 5}
    finally:
        storage.close()
    conn = sqlite3.connect(data_dir / "catalog.sqlite3")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


@pytest.mark.slow
def test_repair_marks_a_missing_object_of_a_shared_store_and_a_restored_one_is_cleared(
        tmp_path, postgres_url, s3_url, seaweedfs, capsys):
    parts = urlsplit(s3_url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    key = lambda digest: f"{prefix}/blobs/{digest[:2]}/{digest[2:4]}/{digest}"  # noqa: E731
    s3 = seaweedfs.client()
    flags = ("--catalog", postgres_url, "--blobs", s3_url, "--gc-grace-seconds", "0")
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        store(server, "kept", {"w": payload(1)})
        before = objects(server)
        store(server, "lost", {"w": payload(2)})
        (gone,) = objects(server) - before
        backup = s3.get_object(Bucket=bucket, Key=key(gone))["Body"].read()
        s3.delete_object(Bucket=bucket, Key=key(gone))
        status, out = _scrub(capsys, *flags, "--repair")  # beside the running replica
        assert status == 1 and "used by lost:w; marked\n" in out, out
        assert _lost_entries(server, "lost") == ("w",)
        assert _lost_entries(server, "kept") == ()
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:  # a restart
        assert _lost_entries(server, "lost") == ("w",)
        s3.put_object(Bucket=bucket, Key=key(gone), Body=backup)  # restored from a backup
        status, out = _scrub(capsys, *flags, "--repair")
        assert status == 0 and f"blob {gone} is no longer missing; its lost mark cleared\n" in out, out
        assert _lost_entries(server, "lost") == ()


def test_a_postgres_catalog_of_the_previous_schema_gets_the_table_at_open(postgres_url):
    import psycopg

    from tannery_server.storage.postgres_catalog import PostgresCatalog
    from tannery_server.storage.postgres_schema import SCHEMA_VERSION

    PostgresCatalog(postgres_url).close()
    with psycopg.connect(postgres_url) as conn:  # the schema as version 6 left it
        conn.execute("DROP TABLE lost_blobs")
        conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION - 1,))
    catalog = PostgresCatalog(postgres_url)
    try:
        assert lost_marks.mark(catalog, ["cd" * 32], 7) == ["cd" * 32]
        assert lost_marks.mark(catalog, ["cd" * 32], 9) == ["cd" * 32]
        assert lost_marks.marked(catalog) == {"cd" * 32: 7}, "marked again: the first finding's time kept"
        assert lost_marks.clear(catalog, ["cd" * 32, "ef" * 32]) == ["cd" * 32]
        assert lost_marks.marked(catalog) == {}
    finally:
        catalog.close()
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
