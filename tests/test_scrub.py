"""The on-demand scrub: every blob re-hashed against its SHA-256 name (Fetch checks block CRCs instead)."""

from __future__ import annotations

import hashlib
import os

from tannery_server.storage import Storage

from .test_storage import _store


def test_scrub_names_corrupted_truncated_and_missing_blobs(tmp_path):
    storage = Storage.open_local(tmp_path / "data")
    try:
        payloads = {name: os.urandom(size) for name, size in (("a", 3 << 20), ("b", 1000), ("c", 5000), ("d", 70))}
        _store(storage, "x", payloads)
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in payloads.items()}
        assert storage.scrub() == []

        path = lambda name: tmp_path / "data" / "blobs" / digests[name][:2] / digests[name]  # noqa: E731
        with open(path("a"), "r+b") as f:  # one bit, deep inside the second block
            f.seek((1 << 20) + 12345)
            byte = f.read(1)
            f.seek((1 << 20) + 12345)
            f.write(bytes([byte[0] ^ 1]))
        path("b").write_bytes(payloads["b"][:-1])
        path("c").unlink()
        assert storage.scrub() == sorted([digests["a"], digests["b"], digests["c"]])
    finally:
        storage.close()


def test_pieces_of_any_size_hashed_slice_by_slice_give_the_payloads_digest(tmp_path):
    storage = Storage.open_local(tmp_path / "data")
    try:
        data = os.urandom((2 << 20) + 7)
        writer = storage.new_payload()
        view = memoryview(data)
        for start, stop in ((0, 100), (100, (1 << 20) + 100), ((1 << 20) + 100, len(data))):  # small, large, large
            writer.write(view[start:stop])
        assert writer.size == len(data)
        blob = storage.seal(writer)
        assert blob.digest == hashlib.sha256(data).hexdigest() and blob.size == len(data) and blob.blocks == 3
        storage.release([blob.digest], collect=True)
    finally:
        storage.close()


def test_the_scrub_command_reports_damaged_blobs_with_the_entries_that_use_them(tmp_path, capsys):
    from tannery.cli import main

    data_dir = tmp_path / "data"
    storage = Storage.open_local(data_dir)
    payloads = {"w": os.urandom(5000), "b": os.urandom(70)}
    try:
        _store(storage, "model", payloads)
        _store(storage, "copy", {"w2": payloads["w"]})  # the same blob, stored once
    finally:
        storage.close()
    assert main(["scrub", "--data-dir", str(data_dir)]) == 0
    assert capsys.readouterr().out == "checked 2 blobs: all match\n"

    digest = hashlib.sha256(payloads["w"]).hexdigest()
    blob = data_dir / "blobs" / digest[:2] / digest
    blob.write_bytes(b"\x00" + blob.read_bytes()[1:])
    assert main(["scrub", "--data-dir", str(data_dir)]) == 1
    assert capsys.readouterr().out == (
        f"blob {digest} is missing or no longer matches its SHA-256; used by copy:w2, model:w\n"
        "checked 2 blobs: 1 damaged\n"
    )


def test_the_scrub_command_refuses_a_data_directory_in_use_or_absent(tmp_path, capsys):
    from tannery.cli import main

    storage = Storage.open_local(tmp_path / "data")
    try:
        assert main(["scrub", "--data-dir", str(tmp_path / "data")]) == 1
        assert "stop the server first" in capsys.readouterr().err
    finally:
        storage.close()
    assert main(["scrub", "--data-dir", str(tmp_path / "absent")]) == 1
    assert "no tannery data directory" in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()
