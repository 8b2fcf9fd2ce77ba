"""A start-up that does not grow with the store (issue 43): recovery reads the blob journal and the
temporary directory, never every blob or every entry, and still removes what an interrupted
Store or Delete left; a data directory from before the journal is swept whole once. The web
page's /server never counts the catalog."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from pathlib import Path

import pytest
import torch

import tannery
from tannery_server.storage import Storage
from tannery_server.storage import blob_journal
from tannery_server.storage.blob_journal import BlobJournal

from .server_harness import running_server
from .test_storage import _blob_files, _store
from .test_web import get, web_port


def _refuse_full_scans(monkeypatch) -> None:
    """Make reading every blob or every entry fail the test."""
    from tannery_server.storage.file_blobs import FileBlobStore
    from tannery_server.storage.sqlite_catalog import SqliteCatalog

    def walked(*_args):
        raise AssertionError("recovery read every blob or every entry")

    monkeypatch.setattr(FileBlobStore, "digests", walked)
    monkeypatch.setattr(SqliteCatalog, "referenced_digests", walked)
    monkeypatch.setattr(SqliteCatalog, "forget_unreferenced_blobs", walked)


def _fill(data_dir: Path, count: int) -> None:
    """``count`` blob files, each referenced by an entry of one bulk archive (written directly: seconds)."""
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(count)]
    for digest in digests:
        directory = data_dir / "blobs" / digest[:2]
        directory.mkdir(exist_ok=True)
        (directory / digest).write_bytes(b"x")
    conn = sqlite3.connect(data_dir / "catalog.sqlite3")
    with conn:
        archive = conn.execute("INSERT INTO archives (name, created_ns, entries, nbytes, payload_bytes) "
                               "VALUES ('bulk', 1, ?, 0, 0)", (count,)).lastrowid
        conn.executemany("INSERT INTO blobs (digest, size, block_size, block_crcs) VALUES (?, 1, 1048576, x'')",
                         ((d,) for d in digests))
        conn.executemany("INSERT INTO entries (archive_id, name, dtype, shape, nbytes, payload_bytes, data_offset, "
                         "blob, digest) VALUES (?, ?, 'uint8', '[1]', 1, 1, 0, ?, ?)",
                         ((archive, f"e{i}", d, d) for i, d in enumerate(digests)))
    conn.close()


def _opened_in(data_dir: Path) -> float:
    started = time.perf_counter()
    Storage.open_local(data_dir).close()
    return time.perf_counter() - started


def test_recovery_reads_the_journal_not_the_store_and_removes_what_a_crash_left(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    _store(storage, "kept", {"x": b"kept"})
    _store(storage, "doomed", {"y": b"doomed"})
    orphan = storage.new_payload()  # a Store that sealed its blob and never committed
    orphan.write(b"orphan")
    storage.seal(orphan)
    monkeypatch.setattr(storage, "collect", lambda digests: None)  # a Delete stopped after its catalog write
    storage.delete("doomed")
    storage.close()
    monkeypatch.undo()
    assert len(_blob_files(data_dir)) == 3
    _refuse_full_scans(monkeypatch)
    storage = Storage.open_local(data_dir)
    try:
        assert _blob_files(data_dir) == {hashlib.sha256(b"kept").hexdigest()}
        assert storage.catalog.blob(hashlib.sha256(b"doomed").hexdigest()) is None  # its row forgotten too
        assert (data_dir / blob_journal.NAME).stat().st_size == 0
    finally:
        storage.close()


def test_start_up_time_does_not_grow_with_the_blobs_stored(tmp_path, monkeypatch, capsys):
    empty, full = tmp_path / "empty", tmp_path / "full"
    Storage.open_local(empty).close()
    Storage.open_local(full).close()
    _fill(full, 20_000)
    _refuse_full_scans(monkeypatch)
    alone = min(_opened_in(empty) for _ in range(5))
    crowded = min(_opened_in(full) for _ in range(5))
    with capsys.disabled():
        print(f"\nstart-up: {alone * 1000:.1f} ms empty, {crowded * 1000:.1f} ms with 20000 blobs")
    assert crowded <= 2 * alone + 0.005, (alone, crowded)  # 5 ms: the catalog file's larger pages


def test_a_data_directory_from_before_the_journal_is_swept_whole_once(tmp_path):
    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    _store(storage, "kept", {"x": b"kept"})
    storage.close()
    (data_dir / blob_journal.NAME).unlink()
    stray = hashlib.sha256(b"stray").hexdigest()
    (data_dir / "blobs" / stray[:2]).mkdir(exist_ok=True)
    (data_dir / "blobs" / stray[:2] / stray).write_bytes(b"stray")  # left by a run before the journal
    Storage.open_local(data_dir).close()
    assert _blob_files(data_dir) == {hashlib.sha256(b"kept").hexdigest()}
    assert (data_dir / blob_journal.NAME).exists()


def test_the_journal_keeps_only_what_is_in_flight(tmp_path, monkeypatch):
    monkeypatch.setattr(blob_journal, "EMPTY_AT", 100)
    journal = BlobJournal(tmp_path)
    first, second, third = ("a" * 64, "b" * 64, "c" * 64)
    journal.note([first, second])
    journal.note([third])
    journal.done([first, third])  # past 100 bytes with `second` in flight: rewritten to hold it alone
    assert journal.left() == [second]
    journal.note([first])
    journal.done([second, first])
    assert journal.left() == [] and os.path.getsize(journal.path) == 0
    journal.close()


def test_the_server_page_never_counts_the_catalog(tmp_path, monkeypatch):
    with running_server(tmp_path, web_port=0) as server, tannery.Client(server.target) as client:
        client.store("a", {"w": torch.zeros(2)})
        catalog = server.storage.catalog
        counted = []
        monkeypatch.setattr(type(catalog), "totals", lambda self: counted.append(1) or pytest.fail("counted"))
        for _ in range(3):
            status, _, body = get(web_port(server), "/server")
            assert status == 200 and 'data-method="Store"' in body
        assert counted == []
