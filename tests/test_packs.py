"""Small payloads packed into one blob per Store (docs/packs.md): what holds for any entry holds
for a packed one, on both storage backends and every transport."""

from __future__ import annotations

import hashlib
import threading

import grpc
import pytest
import torch

import tannery
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.cli import main as server_main
from tannery_server.storage import Storage
from tannery_server.storage.packs import PACK_BLOCK_SIZE

from .backends import SHARED_TIMINGS, shared_blobs_url
from .server_harness import ServerProcess, collect_fetch, running_server, store_requests, wait_for

pytestmark = pytest.mark.slow

#: Entries of one archive: many small tensors of several dtypes, and one large one (2 MiB).
SMALL = {f"layers.{i}.{kind}": torch.randn(16, generator=torch.Generator().manual_seed(i)).to(dtype)
         for i in range(150) for kind, dtype in (("w", torch.float32), ("scale", torch.bfloat16))}
SMALL["step"] = torch.tensor(7, dtype=torch.int64)
SMALL["mask"] = torch.tensor([True, False, True])
LARGE = {"embed": torch.randn(512, 1024, generator=torch.Generator().manual_seed(99))}


def _entries(storage, archive: str) -> dict:
    return {e.name: e for e in storage.catalog.entries_under(archive, "")}


def _same(got, want: dict) -> None:
    """``got`` (an archive, or pairs) holds exactly ``want``'s tensors, dtype and bytes."""
    if not isinstance(got, dict):
        got = {name: got.find(name) for name in got.names()} if hasattr(got, "names") else dict(got)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_small_entries_share_one_pack_and_every_read_returns_them_byte_exact(tmp_path, backend, transport):
    with running_server(tmp_path, **backend) as server:
        with tannery.Client(server.target, transport=transport) as client:
            client.store("model", {**SMALL, **LARGE})
            entries = _entries(server.storage, "model")
            packs = {e.blob for e in entries.values() if e.packed}
            assert len(packs) == 1, "the small entries of one Store share one pack"
            assert not entries["embed"].packed and entries["embed"].blob == entries["embed"].digest
            assert sorted(server.storage.blobs.digests()) == sorted(packs | {entries["embed"].blob})
            offsets = sorted(e.blob_offset for e in entries.values() if e.packed)
            assert len(set(offsets)) == len(SMALL) and offsets[0] == 0

            _same(client.fetch("model"), {**SMALL, **LARGE})
            _same(dict(client.fetch_iter("model")), {**SMALL, **LARGE})
            _same(client.fetch("model", prefix="layers.3"),
                  {k: v for k, v in SMALL.items() if k.startswith("layers.3.")})
            archive = client.archive("model")
            assert torch.equal(archive.tensor("layers.7.w", (16,), "float32"), SMALL["layers.7.w"])
            assert torch.equal(archive.find("mask"), SMALL["mask"])
            assert torch.equal(archive.rows("layers.9.w", 3, 11), SMALL["layers.9.w"][3:11])
            assert torch.equal(archive.float("layers.9.scale", (16,), "float32"), SMALL["layers.9.scale"].float())
            described = {e.name: e.digest for e in client.describe("model").entries}
            stored = tannery.torch.serialize(SMALL["layers.5.scale"])
            assert described["layers.5.scale"] == hashlib.sha256(stored).hexdigest()


def test_a_pack_lives_while_any_archive_uses_it_and_a_union_copies_no_byte(tmp_path, backend):
    shared = bool(backend)
    settings = {**backend, "gc_grace_seconds": 3600.0} if shared else {}
    with running_server(tmp_path, **settings) as server:
        storage = server.storage
        with tannery.Client(server.target) as client:
            client.store("a", SMALL)
            blobs = sorted(storage.blobs.digests())
            client.union("b", ["a"])
            assert sorted(storage.blobs.digests()) == blobs, "a union writes no blob"
            assert {e.blob for e in _entries(storage, "b").values()} == set(blobs)
            client.delete("a")
            if shared:
                storage.sweep()
            assert sorted(storage.blobs.digests()) == blobs, "archive b still uses the pack"
            _same(client.fetch("b"), SMALL)
            client.delete("b")
            if shared:
                assert storage.sweep().blobs == 0, "collected before the grace period"
                assert sorted(storage.blobs.digests()) == blobs
                import time
                storage.sweep(now_ns=time.time_ns() + int(3601e9))
            assert list(storage.blobs.digests()) == []


def test_a_corrupted_byte_in_a_pack_is_data_loss_naming_the_entry_and_scrub_finds_it(tmp_path, capsys):
    data_dir = tmp_path / "data"
    tensors = {f"t{i}": torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(40)}  # 16 KiB
    with running_server(tmp_path) as server:
        with tannery.Client(server.target) as client:
            client.store("model", tensors)
            victim = _entries(server.storage, "model")["t39"]
            other = _entries(server.storage, "model")["t0"]
            assert victim.packed and victim.blob == other.blob
            assert victim.blob_offset // PACK_BLOCK_SIZE != other.blob_offset // PACK_BLOCK_SIZE
            path = data_dir / "blobs" / victim.blob[:2] / victim.blob
            with open(path, "r+b") as f:
                f.seek(victim.blob_offset + victim.payload_bytes - 1)
                byte = f.read(1)
                f.seek(victim.blob_offset + victim.payload_bytes - 1)
                f.write(bytes([byte[0] ^ 0x40]))
            for transport in ("grpc", "local", "tcp"):
                with tannery.Client(server.target, transport=transport) as reader:
                    with pytest.raises(tannery.DataLoss, match="'t39'"):
                        reader.fetch("model", names=["t39"])
                    assert torch.equal(reader.fetch("model", names=["t0"]).find("t0"), tensors["t0"])
    storage = Storage.open_local(data_dir)
    try:
        assert storage.scrub() == [victim.blob]
    finally:
        storage.close()
    assert server_main(["scrub", "--data-dir", str(data_dir)]) == 1
    assert "model:t39" in capsys.readouterr().out


def test_a_server_killed_during_a_packed_store_leaves_nothing_partial(tmp_path):
    payloads = {name: tannery.torch.serialize(t) for name, t in SMALL.items()}
    half = len(payloads) // 2
    sent_half, hold = threading.Event(), threading.Event()

    def requests():
        for index, request in enumerate(store_requests("model", payloads)):
            if index == half:
                sent_half.set()
                hold.wait(30)
            yield request

    with ServerProcess(tmp_path / "data") as process:
        failure: list[BaseException] = []

        def store() -> None:
            try:
                process.archives().Store(requests(), timeout=60)
            except grpc.RpcError as exc:
                failure.append(exc)

        thread = threading.Thread(target=store)
        thread.start()
        assert sent_half.wait(30)
        process.kill()
        hold.set()
        thread.join(30)
        assert failure, "the Store of a killed server cannot succeed"
    storage = Storage.open_local(tmp_path / "data")  # recovers what the kill left
    try:
        assert storage.catalog.archive("model") is None
        assert list(storage.blobs.digests()) == [] and storage.blobs.temporaries() == []
    finally:
        storage.close()


def test_migrate_copies_a_pack_once_and_a_replica_serves_its_entries(request, tmp_path, postgres_url, capsys):
    source = tmp_path / "embedded"
    with running_server(tmp_path, data_dir=source) as server:
        with tannery.Client(server.target) as client:
            client.store("model", {**SMALL, **LARGE})
            client.union("copy", ["model"])
    target = {"catalog": postgres_url, "blobs": shared_blobs_url(request, tmp_path)}
    assert server_main(["migrate", "--data-dir", str(source), "--catalog", target["catalog"],
                        "--blobs", target["blobs"]]) == 0, capsys.readouterr()
    with running_server(tmp_path, data_dir=tmp_path / "replica", **target, **SHARED_TIMINGS) as replica:
        assert len(list(replica.storage.blobs.digests())) == 2, "one pack and the large blob"
        stub = replica.archives()
        for name in ("model", "copy"):
            got = collect_fetch(stub.Fetch(pb.FetchRequest(archive=name)))
            assert got == {k: tannery.torch.serialize(v) for k, v in sorted({**SMALL, **LARGE}.items())}


@pytest.mark.parametrize("reads_inline", [True, False], ids=["server-reads-inline", "server-without"])
def test_same_host_small_payloads_go_on_the_connection_itself_only_with_a_server_that_reads_them(
        tmp_path, monkeypatch, reads_inline):
    """A memory file per small payload (Store) or the pack passed once per entry (Fetch) costs more
    than the bytes: they go inline, but only to and from a server that says it reads them (one
    that does not, ``batched_entries`` off, gets memory files and sends files, as before)."""
    from tannery.dataplane import links

    sealed, mapped = [], []
    send_sealed, map_entry = links._send_sealed, links._mapped
    monkeypatch.setattr(links, "_send_sealed", lambda *a, **k: (sealed.append(1), send_sealed(*a, **k))[1])
    monkeypatch.setattr(links, "_mapped", lambda *a, **k: (mapped.append(1), map_entry(*a, **k))[1])
    with running_server(tmp_path, batched_entries=reads_inline) as server:
        with tannery.Client(server.target, transport="local") as client:
            client.store("model", {**SMALL, **LARGE})
            _same(client.fetch("model"), {**SMALL, **LARGE})
    # The 2 MiB entry is one memory file, and one file passed, either way.
    assert len(sealed) == (1 if reads_inline else len(SMALL) + 1)
    assert len(mapped) == (1 if reads_inline else len(SMALL) + 1)


def test_a_read_racing_a_delete_reads_the_archive_as_it_was_never_an_empty_one(tmp_path, monkeypatch):
    """The archive is found, then deleted before its entries are read (a prune right behind an
    alias's move): Describe and Fetch read the record and the entries in one snapshot, so they
    answer the archive whole, as it was when the read began, never OK with no entries."""
    from tannery_server.storage import sqlite_catalog

    with running_server(tmp_path) as server:
        with tannery.Client(server.target, transport="grpc") as client:
            client.store("model", SMALL)
            client.tag("latest", "model")
            catalog = server.storage.catalog
            deleted = []

            def deleted_first(real):
                def read(conn, archive, *rest):
                    # fault injection: a Delete commits between the read's two queries
                    deleted.append(catalog.delete_archive(archive, force=True)[0])
                    return real(conn, archive, *rest)
                return read

            monkeypatch.setattr(sqlite_catalog, "_entries_under", deleted_first(sqlite_catalog._entries_under))
            _same(client.fetch("latest"), SMALL)
            assert deleted[-1].name == "model"
            with pytest.raises(tannery.NotFound, match="'latest'"):
                client.fetch("latest")  # it was deleted all the same
            client.store("other", SMALL)
            described = client.describe("other")
            assert deleted[-1].name == "other"
            assert described.info.entries == len(SMALL)
            assert sorted(e.name for e in described.entries) == sorted(SMALL)
            client.store("third", SMALL)
            monkeypatch.setattr(sqlite_catalog, "_entries_named", deleted_first(sqlite_catalog._entries_named))
            _same(client.fetch("third", ["step", "mask"]), {n: SMALL[n] for n in ("step", "mask")})
            assert deleted[-1].name == "third"


def test_a_store_that_finds_its_content_stored_meanwhile_leaves_no_pack(tmp_path):
    """Two Stores of one name and the same small entries, in other orders, both begun before either
    commits: the second finds the archive there (OK, already stored) and its own pack, which no
    entry references, is collected at once (not left on disk until the next start)."""
    from .server_harness import commit_request
    from .store_checks import temporary_files

    payloads = {name: tannery.torch.serialize(t) for name, t in list(SMALL.items())[:20]}
    with running_server(tmp_path) as server:
        stub = server.archives()
        messages = list(store_requests("model", dict(reversed(list(payloads.items()))), commit=False))
        release = threading.Event()

        def held():
            yield from messages
            release.wait(30)
            yield commit_request(len(payloads), sum(len(p) for p in payloads.values()))

        future = stub.Store.future(held())
        try:
            # Its pack is begun (a temporary file): it found no archive of that name.
            assert wait_for(lambda: temporary_files(server.data_dir))
            assert not stub.Store(store_requests("model", payloads)).already_stored
        finally:
            release.set()
        assert future.result(timeout=30).already_stored
        [pack] = {e.blob for e in _entries(server.storage, "model").values()}
        assert sorted(server.storage.blobs.digests()) == [pack] and not temporary_files(server.data_dir)
