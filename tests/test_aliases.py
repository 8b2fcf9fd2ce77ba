"""Aliases (a name pointing at an archive, moved atomically) and retention (prune), on the real
server, on both storage backends where storage is involved."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

import tannery
import tannery.aio
from tannery.cli import main
from tannery_protocol.errors import AliasError, InvalidArgument, NotFound, PermissionDenied

from .server_harness import running_server

WRITE, READ = "alias-write-7c1e", "alias-read-3f9a"


@pytest.fixture
def srv(tmp_path, backend):
    with running_server(tmp_path, chunk_size=4096, **backend) as server:
        yield server


def versions(client: tannery.Client, *names: str) -> None:
    """Archive ``names[i]`` holds a Linear(4, 2)'s weights all equal to ``i + 1``."""
    for index, name in enumerate(names):
        client.store(name, {"weight": torch.full((2, 4), float(index + 1)), "bias": torch.full((2,), float(index + 1))})


def value_of(tensors) -> set[float]:
    return {float(v) for t in tensors for v in t.flatten().tolist()}


def every(archive) -> list:
    """Every tensor of an archive (local or remote)."""
    return [archive.find(name) for name in archive.names()]


def cli(server, capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--target", server.target, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_read_path_accepts_an_alias_and_reads_its_target(srv, tmp_path, capsys):
    with tannery.Client(srv.target) as client:
        versions(client, "runs/7/step-1000", "runs/7/step-2000")
        tagged = client.tag("prod", "runs/7/step-1000")
        assert (tagged.alias.archive, tagged.previous, tagged.changed) == ("runs/7/step-1000", "", True)
        assert client.resolve("prod") == "runs/7/step-1000"
        assert client.resolve("runs/7/step-2000") == "runs/7/step-2000"  # an archive denotes itself
        assert client.describe("prod").name == "runs/7/step-1000"  # the Describe names the real archive
        assert value_of(every(client.fetch("prod"))) == {1.0}
        assert value_of(t for _n, t in client.fetch_iter("prod")) == {1.0}
        assert value_of([client.archive("prod").find("weight")]) == {1.0}
        module = torch.nn.Linear(4, 2)
        client.load_state_dict(module, "prod")
        assert value_of([module.weight.detach(), module.bias.detach()]) == {1.0}
        client.union("both", {"a": "prod", "b": "runs/7/step-2000"})
        assert value_of([client.fetch("both").find("a.weight")]) == {1.0}
        assert [a.alias for a in client.aliases()] == ["prod"]
        moved = client.tag("prod", "runs/7/step-2000")
        assert (moved.previous, moved.changed) == ("runs/7/step-1000", True)
        assert value_of(every(client.fetch("prod"))) == {2.0}

    async def asynchronous() -> None:
        async with tannery.aio.Client(srv.target) as aio:
            assert await aio.resolve("prod") == "runs/7/step-2000"
            assert value_of(every(await aio.fetch("prod"))) == {2.0}
            remote = await aio.archive("prod")
            await aio.tag("prod", "runs/7/step-1000", expect="runs/7/step-2000")
            assert value_of([await remote.find("weight")]) == {2.0}  # opened on step-2000: stays there

    asyncio.run(asynchronous())

    # The command line: pull, show and ls name aliases.
    out = tmp_path / "prod.safetensors"
    assert cli(srv, capsys, "pull", "prod", "-o", str(out))[0] == 0
    assert value_of(every(tannery.load_safetensors(out))) == {1.0}
    code, shown, _ = cli(srv, capsys, "show", "prod", "--json")
    assert code == 0 and json.loads(shown)["archive"] == "runs/7/step-1000" and json.loads(shown)["aliases"] == ["prod"]
    code, text, _ = cli(srv, capsys, "show", "prod")
    assert "archive: runs/7/step-1000 (alias prod)" in text
    code, listed, _ = cli(srv, capsys, "ls", "--json")
    assert {a["name"]: a["aliases"] for a in json.loads(listed)} == {
        "both": [], "runs/7/step-1000": ["prod"], "runs/7/step-2000": []}
    code, table, _ = cli(srv, capsys, "ls")
    assert "ALIASES" in table.splitlines()[0] and table.splitlines()[2].rstrip().endswith("prod")


def test_two_writers_moving_one_alias_with_expect_exactly_one_wins(srv):
    with tannery.Client(srv.target) as one, tannery.Client(srv.target) as two:
        versions(one, "a", "b", "c")
        for round_ in range(4):
            one.tag("prod", "a")
            start = threading.Barrier(2)
            outcomes: dict[str, object] = {}

            def move(client: tannery.Client, target: str) -> None:
                start.wait()
                try:
                    outcomes[target] = client.tag("prod", target, expect="a")
                except AliasError as error:
                    outcomes[target] = error

            threads = [threading.Thread(target=move, args=(c, t)) for c, t in ((one, "b"), (two, "c"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            won = [t for t, o in outcomes.items() if not isinstance(o, Exception)]
            lost = [o for o in outcomes.values() if isinstance(o, AliasError)]
            assert len(won) == 1 and len(lost) == 1, outcomes
            assert one.resolve("prod") == won[0]
            assert f"alias 'prod' points at {won[0]!r}, not at 'a' as expected" in str(lost[0])
            # The winner's tag sent again (its answer lost, say) succeeds and changes nothing.
            again = two.tag("prod", won[0], expect="a")
            assert again.changed is False and again.alias.archive == won[0]


def test_a_fetch_begun_before_a_move_reads_the_old_version_whole(srv):
    big = {f"e{i}": torch.full((16384,), 1.0) for i in range(6)}  # 64 KiB each, 16 chunks of 4 KiB
    with tannery.Client(srv.target, transport="grpc") as reader, tannery.Client(srv.target) as writer:
        writer.store("v1", big)
        writer.store("v2", {name: torch.full((16384,), 2.0) for name in big})
        writer.tag("prod", "v1")
        stream = reader.fetch_iter("prod")
        first = next(stream)
        writer.tag("prod", "v2")  # mid-stream
        rest = list(stream)
        assert [n for n, _ in [first, *rest]] == sorted(big)
        assert value_of(t for _n, t in [first, *rest]) == {1.0}
        assert value_of(t for _n, t in reader.fetch_iter("prod")) == {2.0}


def test_a_remote_archive_opened_on_an_alias_keeps_reading_its_version(srv):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2")
        client.tag("prod", "v1")
        remote = client.archive("prod")
        client.tag("prod", "v2")
        assert value_of([remote.find("weight"), remote.find("bias")]) == {1.0}
        assert value_of(every(remote)) == {1.0} and remote.description.name == "v1"
        assert value_of([client.archive("prod").find("weight")]) == {2.0}


def test_prune_keeps_the_newest_and_every_aliased_archive(srv, capsys):
    with tannery.Client(srv.target) as client:
        for step in range(1, 6):
            client.store(f"runs/7/step-{step}", {"w": torch.full((2,), float(step))})
        client.store("runs/8/step-1", {"w": torch.zeros(2)})
        client.tag("prod", "runs/7/step-1")
        dry = client.prune("runs/7/", keep_last=2, dry_run=True)
        assert [i.name for i in dry.deleted] == ["runs/7/step-3", "runs/7/step-2"]
        assert [i.name for i in dry.kept] == ["runs/7/step-5", "runs/7/step-4", "runs/7/step-1"]
        assert dry.aliased == {"runs/7/step-1": ("prod",)} and dry.dry_run
        assert len(client.list("runs/")) == 6  # nothing deleted
        code, out, _ = cli(srv, capsys, "prune", "runs/7/", "--keep-last", "2", "--dry-run", "--json")
        assert code == 0 and [i["name"] for i in json.loads(out)["deleted"]] == ["runs/7/step-3", "runs/7/step-2"]
        assert len(client.list("runs/")) == 6
        code, out, _ = cli(srv, capsys, "prune", "runs/7/", "--keep-last", "2")
        assert code == 0 and "2 deleted, 3 kept" in out
        assert [i.name for i in client.list("runs/")] == ["runs/7/step-1", "runs/7/step-4", "runs/7/step-5",
                                                          "runs/8/step-1"]
        for bad in (0, -1):
            with pytest.raises(ValueError, match=f"keep_last {bad} keeps nothing: give 1 or more"):
                client.prune("runs/7/", keep_last=bad)
        with pytest.raises(ValueError, match="empty prefix"):
            client.prune("", keep_last=1)
        code, _out, err = cli(srv, capsys, "prune", "runs/7/", "--keep-last", "0")
        assert code == 1 and "--keep-last 0 keeps nothing" in err and "hint: give --keep-last 1 or more" in err


def test_each_bad_input_is_refused_naming_the_problem_and_the_remedy(srv, capsys):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2")
        client.tag("prod", "v1")
        with pytest.raises(AliasError, match="alias 'v2': that name is an archive's"):
            client.tag("v2", "v1")
        with pytest.raises(AliasError, match=r"'prod' is itself an alias \(of 'v1'\).*tag 'v1' instead"):
            client.tag("staging", "prod")
        with pytest.raises(NotFound, match="archive 'v9' not found: alias 'staging' must point at an archive"):
            client.tag("staging", "v9")
        with pytest.raises(InvalidArgument, match="empty name"):
            client.tag("", "v1")
        for write in (lambda: client.store("prod", {"w": torch.ones(1)}),
                      lambda: client.store("prod", {"w": torch.ones(1)}, replace=True),
                      lambda: client.union("prod", ["v2"])):
            with pytest.raises(AliasError, match=r"archive 'prod': that name is an alias \(of archive 'v1'\).*untag prod"):
                write()
        with pytest.raises(AliasError, match="'prod' points at 'v1', not at 'v2' as expected"):
            client.tag("prod", "v2", expect="v2")
        with pytest.raises(AliasError, match="points at 'v1', not at no archive"):
            client.tag("prod", "v2", expect="")
        assert client.tag("fresh", "v2", expect="").changed  # "": only when the alias is new
        with pytest.raises(AliasError, match="'fresh2' does not exist, not pointing at 'v1'"):
            client.tag("fresh2", "v2", expect="v1")
        with pytest.raises(NotFound, match="alias 'nope' not found"):
            client.untag("nope")
        with pytest.raises(NotFound, match="alias 'v1' not found: it is an archive"):
            client.untag("v1")
        with pytest.raises(NotFound, match="it is an alias"):
            client.delete("prod")
        with pytest.raises(NotFound, match="no archive or alias 'gone'"):
            client.resolve("gone")
        with pytest.raises(AliasError, match=r"archive 'v1' is what alias 'prod' points at.*force"):
            client.delete("v1")
        code, _out, err = cli(srv, capsys, "tag", "prod", "v2", "--expect", "v0")
        assert code == 1 and "alias 'prod' points at 'v1', not at 'v0' as expected" in err
        code, _out, err = cli(srv, capsys, "rm", "v1")
        assert code == 1 and "alias 'prod' points at" in err and "rm --force" in err
        code, out, _ = cli(srv, capsys, "rm", "v1", "--force", "--json")
        assert code == 0 and json.loads(out)[0]["aliases_removed"] == ["prod"]
        with pytest.raises(NotFound):
            client.resolve("prod")
        code, out, _ = cli(srv, capsys, "untag", "fresh", "--json")
        assert json.loads(out) == {"alias": "fresh", "archive": "v2"}
        assert client.aliases() == []


def test_a_lost_compare_and_set_names_tannery_resolve_which_answers(srv, capsys):
    with tannery.Client(srv.target) as client:
        versions(client, "v1", "v2")
        client.tag("prod", "v1")
    code, _out, err = cli(srv, capsys, "tag", "prod", "v2", "--expect", "v0")
    assert code == 1 and "(tannery resolve)" in err
    code, out, _ = cli(srv, capsys, "resolve", "prod")
    assert (code, out) == (0, "v1\n")
    code, out, _ = cli(srv, capsys, "resolve", "prod", "--json")
    assert json.loads(out) == {"name": "prod", "archive": "v1", "alias": True}
    code, out, _ = cli(srv, capsys, "resolve", "v2", "--json")
    assert json.loads(out) == {"name": "v2", "archive": "v2", "alias": False}
    code, out, err = cli(srv, capsys, "resolve", "gone")
    assert (code, out) == (1, "") and "tannery resolve: error: no archive or alias 'gone'" in err


def test_the_read_token_cannot_tag_untag_or_prune(tmp_path):
    from tannery_server.auth import READ_METHODS

    assert {"Resolve", "ListAliases"} <= {m.rsplit("/", 1)[-1] for m in READ_METHODS}
    with running_server(tmp_path, tokens=f"{WRITE}:write,{READ}:read") as server:
        with tannery.Client(server.target, token=WRITE) as writer, tannery.Client(server.target, token=READ) as reader:
            versions(writer, "runs/1", "runs/2", "runs/3")
            writer.tag("prod", "runs/1")  # runs/2 is the one a prune keeping 1 would delete
            assert reader.resolve("prod") == "runs/1" and [a.alias for a in reader.aliases()] == ["prod"]
            assert value_of(every(reader.fetch("prod"))) == {1.0}
            for call in (lambda: reader.tag("prod", "runs/2"), lambda: reader.untag("prod"),
                         lambda: reader.prune("runs/", keep_last=1)):
                with pytest.raises(PermissionDenied):
                    call()
            assert writer.resolve("prod") == "runs/1" and len(writer.list()) == 3


def test_a_replica_sees_the_other_replicas_move_at_once(tmp_path, postgres_url, s3_url):
    from .backends import SHARED_TIMINGS

    shared = {"catalog": postgres_url, "blobs": s3_url, **SHARED_TIMINGS}
    with running_server(tmp_path / "a", **shared) as a, running_server(tmp_path / "b", **shared) as b:
        with tannery.Client(a.target) as on_a, tannery.Client(b.target) as on_b:
            versions(on_a, "v1", "v2")
            on_a.tag("prod", "v1")
            assert on_b.resolve("prod") == "v1"
            on_b.tag("prod", "v2", expect="v1")
            assert on_a.resolve("prod") == "v2" and value_of(every(on_a.fetch("prod"))) == {2.0}
            with pytest.raises(AliasError, match="points at 'v2', not at 'v1'"):
                on_a.tag("prod", "v1", expect="v1")
            with pytest.raises(AliasError, match="alias 'prod'"):
                on_b.delete("v2")


def test_a_forced_delete_names_at_most_1000_aliases_and_counts_them_all(srv, capsys):
    """No answer grows without a bound: a Delete that removes 1,005 aliases names the first 1,000."""
    with tannery.Client(srv.target) as client:
        client.store("crowded", {"w": torch.arange(3)})
        for i in range(1005):
            client.tag(f"to/{i:04d}", "crowded")
        deleted = client.delete("crowded", force=True)
        assert deleted.aliases_removed_count == 1005
        assert list(deleted.aliases_removed) == [f"to/{i:04d}" for i in range(1000)]
        with pytest.raises(NotFound):
            client.resolve("to/1004")  # every one removed, named or not
        client.store("crowded", {"w": torch.arange(3)})
        for i in range(1003):
            client.tag(f"to/{i:04d}", "crowded")
    code, out, _ = cli(srv, capsys, "rm", "crowded", "--force")
    assert code == 0 and out.rstrip().endswith("to/0999 and 3 more)"), out[-200:]
