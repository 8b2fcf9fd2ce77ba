"""``tannery migrate``: an embedded data directory copied into a PostgreSQL catalog and a
blob store replicas share, every digest checked, resumable; and ``tannery scrub`` there."""

from __future__ import annotations

import numpy as np
import pytest

from tannery_protocol.codec import encode_numpy
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_server.cli import main as server_main

from .backends import shared_blobs_url
from .server_harness import collect_fetch, running_server, store_requests

pytestmark = pytest.mark.slow


def payload(seed: int, size: int = 1 << 18) -> bytes:
    """A float32 payload; 1 MiB of them by default, a blob of its own (a smaller payload shares its
    Store's pack with the others, unless it is alone: docs/packs.md, tests/test_packs.py)."""
    return encode_numpy(np.random.default_rng(seed).standard_normal(size).astype(np.float32))


ARCHIVES = {
    "base": {"w": payload(1), "b": payload(2, 10)},
    "tuned": {"w": payload(1), "head": payload(3)},  # shares base's w
    "big": {"x": payload(4, 3 << 20)},  # several blocks and parts
}


@pytest.fixture
def source(tmp_path):
    """An embedded data directory holding :data:`ARCHIVES`, its server stopped."""
    data_dir = tmp_path / "embedded"
    with running_server(tmp_path, data_dir=data_dir) as server:
        stub = server.archives()
        for name, entries in ARCHIVES.items():
            stub.Store(store_requests(name, entries))
    return data_dir


@pytest.fixture
def target(request, tmp_path, postgres_url) -> dict:
    return {"catalog": postgres_url, "blobs": shared_blobs_url(request, tmp_path)}


def migrate(source, target, capsys) -> tuple[int, str]:
    code = server_main(["migrate", "--data-dir", str(source), "--catalog", target["catalog"],
                        "--blobs", target["blobs"]])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def contents(server) -> dict[str, dict[str, bytes]]:
    stub = server.archives()
    return {a.name: collect_fetch(stub.Fetch(pb.FetchRequest(archive=a.name)))
            for a in stub.List(pb.ListRequest()).archives}


def test_migrate_copies_every_archive_and_a_replica_serves_them(source, target, tmp_path, capsys):
    code, out = migrate(source, target, capsys)
    assert code == 0, out
    assert "migrated 3 archives (4 blobs" in out and "1 blob already there" in out
    with running_server(tmp_path / "replica", **target) as replica:
        assert contents(replica) == ARCHIVES
        assert len(set(replica.storage.blobs.digests())) == 4  # the shared w is one blob
        assert replica.storage.blobs.temporaries() == []


def test_migrate_run_again_skips_what_is_there_and_reports_a_conflict(source, target, tmp_path, capsys):
    assert migrate(source, target, capsys)[0] == 0
    code, out = migrate(source, target, capsys)
    assert code == 0, out
    assert "migrated 0 archives (0 blobs, 0 bytes copied" in out and "3 archives were there already" in out
    with running_server(tmp_path / "replica", **target) as replica:
        stub = replica.archives()
        stub.Delete(pb.DeleteRequest(archive="tuned"))
        stub.Store(store_requests("base", {"other": payload(9)}, replace=True))
    code, out = migrate(source, target, capsys)
    assert code == 1
    assert "base: CONFLICT" in out and "delete or rename them there" in out
    # tuned again: both its blobs are still there (head's grace period runs), so none is copied
    assert "migrated 1 archive (0 blobs, 0 bytes copied, 2 blobs already there)" in out
    with running_server(tmp_path / "replica", **target) as replica:
        assert contents(replica)["tuned"] == ARCHIVES["tuned"]


def test_a_blob_that_does_not_match_its_name_stops_the_migration_naming_it(source, target, tmp_path, capsys):
    import hashlib

    digest = hashlib.sha256(ARCHIVES["tuned"]["head"]).hexdigest()
    path = source / "blobs" / digest[:2] / digest
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01
    path.write_bytes(bytes(damaged))
    code, out = migrate(source, target, capsys)
    assert code == 1
    assert f"entry 'head': blob {digest}" in out and "not what it was stored as" in out
    assert "run the same command again: it resumes" in out
    with running_server(tmp_path / "replica", **target) as replica:
        migrated = {a.name for a in replica.archives().List(pb.ListRequest()).archives}
        assert "tuned" not in migrated and "base" in migrated  # archives before it are in; none half-copied


def test_migrate_refuses_an_embedded_target_and_a_missing_source(source, tmp_path, capsys):
    assert server_main(["migrate", "--data-dir", str(source)]) == 1
    assert "the target must be a shared catalog" in capsys.readouterr().err
    assert server_main(["migrate", "--data-dir", str(tmp_path / "nothing"), "--catalog", "postgresql://x@127.0.0.1:1/d",
                        "--blobs", "s3://b/p"]) == 1
    assert "no tannery data directory" in capsys.readouterr().err


def test_scrub_checks_a_shared_store(source, target, tmp_path, capsys):
    assert migrate(source, target, capsys)[0] == 0
    args = ["scrub", "--catalog", target["catalog"], "--blobs", target["blobs"]]
    assert server_main(args) == 0
    assert "checked 4 blobs: all match" in capsys.readouterr().out


def test_migrate_keeps_each_archives_metadata(target, tmp_path, capsys):
    import torch

    from tannery import Client

    data_dir = tmp_path / "embedded"
    with running_server(tmp_path, data_dir=data_dir) as server, Client(server.target) as client:
        client.store("m", {"w": torch.ones(2)}, metadata={"format": "pt"})
        client.store("plain", {"w": torch.ones(3)})
    code, out = migrate(data_dir, target, capsys)
    assert code == 0, out
    with running_server(tmp_path / "replica", **target) as replica, Client(replica.target) as client:
        assert client.describe("m").metadata == {"format": "pt"}
        assert client.describe("plain").metadata == {}


def test_migrate_goes_on_past_a_damaged_archive_and_reports_each_at_the_end(source, target, tmp_path, capsys):
    import hashlib

    bad = {}
    for archive, entry in (("base", "b"), ("tuned", "head")):  # base is the first archive, tuned the last
        digest = hashlib.sha256(ARCHIVES[archive][entry]).hexdigest()
        path = source / "blobs" / digest[:2] / digest
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 0x01]))
        bad[archive] = digest
    code, out = migrate(source, target, capsys)
    assert code == 1, out
    assert "big: 1 entry migrated" in out  # past base's damage, the next archive is copied
    assert "migrated 1 archive (" in out
    report = out[out.index("tannery migrate: 2 archives NOT migrated, damaged in the source:"):]
    assert f"  base: archive 'base', entry 'b': blob {bad['base']} is not what it was stored as" in report
    assert f"  tuned: archive 'tuned', entry 'head': blob {bad['tuned']}" in report
    assert "run the same command again: it resumes" in report
    with running_server(tmp_path / "replica", **target) as replica:
        assert {a.name for a in replica.archives().List(pb.ListRequest()).archives} == {"big"}


def test_migrate_keeps_each_archives_creation_time(source, target, tmp_path, capsys):
    with running_server(tmp_path / "before", data_dir=source) as server:
        created = {a.name: (a.created.seconds, a.created.nanos)
                   for a in server.archives().List(pb.ListRequest()).archives}
    import time

    time.sleep(1.1)  # a migration that stamped "now" would show a later second
    assert migrate(source, target, capsys)[0] == 0
    with running_server(tmp_path / "replica", **target) as replica:
        after = {a.name: (a.created.seconds, a.created.nanos)
                 for a in replica.archives().List(pb.ListRequest()).archives}
    assert after == created


def test_migrate_help_names_only_its_own_options(capsys):
    with pytest.raises(SystemExit):
        server_main(["migrate", "--help"])
    text = capsys.readouterr().out
    assert "--reserve-bytes" not in text and "damaged" in text and "creation time" in text
    with pytest.raises(SystemExit):
        server_main(["scrub", "--help"])
    assert "--reserve-bytes" not in capsys.readouterr().out


def test_migrate_run_again_never_moves_an_alias_back(source, target, tmp_path, capsys):
    """An alias migrated, then moved on the shared store (the cut-over is done): running the
    migration again to resume leaves it where it was moved, and says so."""
    with running_server(tmp_path / "tagging", data_dir=source) as server:
        server.archives().Tag(pb.TagRequest(alias="prod", archive="base"))
    assert migrate(source, target, capsys)[0] == 0
    with running_server(tmp_path / "replica", **target) as replica:
        replica.archives().Tag(pb.TagRequest(alias="prod", archive="tuned"))
    code, out = migrate(source, target, capsys)
    assert "alias prod: CONFLICT" in out, out
    with running_server(tmp_path / "replica", **target) as replica:
        assert replica.archives().Resolve(pb.ResolveRequest(name="prod")).archive == "tuned"
