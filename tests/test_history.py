"""Alias history, on both storage backends: every move (Tag, Untag, a forced Delete) recorded with
from, to, when and the token that made it; read back in order; the cap; tag --back as a
compare-and-set; migrate copies it; tannery log and tag --back on the command line."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import tannery
from tannery.cli import main
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import running_server
from .test_migrate import migrate, source, target  # noqa: F401  (their fixtures)

TOKENS = {"ingest": "tok-ingest-1", "deploy": "tok-deploy-2", "ops": "tok-ops-3"}


def _by(token: str) -> str:
    return f"write token sha256:{hashlib.sha256(token.encode()).hexdigest()[:8]}"


@pytest.fixture
def srv(tmp_path, backend):
    tokens = ",".join(f"{token}:write" for token in TOKENS.values())
    with running_server(tmp_path, tokens=tokens, **backend) as server:
        yield server


def _client(srv, who: str = "ops") -> tannery.Client:
    return tannery.Client(srv.target, token=TOKENS[who], retries=0)


def test_a_hundred_moves_by_three_tokens_are_read_back_in_order(srv):
    clients = {who: _client(srv, who) for who in TOKENS}
    try:
        ops = clients["ops"]
        for i in range(5):
            ops.store(f"v{i}", {"w": torch.full((2,), float(i))})
        made = []  # (previous, archive, by), oldest first
        current = ""
        for i in range(100):
            who = list(TOKENS)[i % 3]
            target = f"v{(i + 1 + i // 5) % 5}"
            if target == current:
                target = f"v{(int(target[1]) + 1) % 5}"
            clients[who].tag("prod", target)
            made.append((current, target, _by(TOKENS[who])))
            current = target
        clients["ops"].tag("prod", current)  # no move: not recorded
        moves = ops.history("prod")
        assert [(m.previous, m.archive, m.by) for m in moves] == made[::-1]
        assert all(m.alias == "prod" for m in moves)
        assert [m.moved for m in moves] == sorted((m.moved for m in moves), reverse=True)
        assert [(m.previous, m.archive) for m in ops.history("prod", 3)] == [(p, a) for p, a, _ in made[::-1][:3]]
    finally:
        for client in clients.values():
            client.close()


def test_untag_and_a_forced_delete_are_moves_too(srv):
    with _client(srv, "deploy") as client:
        client.store("a", {"w": torch.ones(1)})
        client.store("b", {"w": torch.zeros(1)})
        client.tag("prod", "a")
        client.tag("canary", "b")
        client.untag("prod")
        client.delete("b", force=True)
        assert [(m.previous, m.archive) for m in client.history("prod")] == [("a", ""), ("", "a")]
        assert [(m.previous, m.archive, m.by) for m in client.history("canary")] == [
            ("b", "", _by(TOKENS["deploy"])), ("", "b", _by(TOKENS["deploy"]))]
        with pytest.raises(tannery.NotFound, match="alias 'never' not found, and no move of it is recorded"):
            client.history("never")
        with pytest.raises(tannery.NotFound, match="'a' not found.*it is an archive's name"):
            client.history("a")


def test_tag_back_is_a_compare_and_set(srv, monkeypatch):
    with _client(srv) as client, _client(srv, "ingest") as other:
        for name in ("a", "b", "c"):
            client.store(name, {"w": torch.ones(1)})
        client.tag("prod", "a")
        with pytest.raises(tannery.AliasError, match="created pointing at 'a' and never moved"):
            client.tag_back("prod")
        client.tag("prod", "b")
        back = client.tag_back("prod")
        assert (back.alias.archive, back.previous, back.changed) == ("a", "b", True)
        assert client.tag_back("prod").alias.archive == "b"  # back again: where it was before "a"
        # Another writer moves the alias between the history read and the tag: refused, nothing moved.
        history = client._history

        def stale(alias, limit):
            moves = yield from history(alias, limit)
            other.tag("prod", "c")
            return moves

        monkeypatch.setattr(client, "_history", stale)
        with pytest.raises(tannery.AliasError, match="points at 'c', not at 'b' as expected"):
            client.tag_back("prod")
        monkeypatch.undo()
        assert client.resolve("prod") == "c"
        client.tag("prod", "b")
        client.tag("prod", "c")
        client.delete("b")
        with pytest.raises(tannery.NotFound, match="cannot go back from 'c' to 'b'"):
            client.tag_back("prod")


def test_the_history_is_capped_per_alias(tmp_path, backend):
    with running_server(tmp_path, alias_history=5, **backend) as server, tannery.Client(server.target) as client:
        client.store("a", {"w": torch.ones(1)})
        client.store("b", {"w": torch.zeros(1)})
        for i in range(8):
            client.tag("prod", "ab"[i % 2])
        client.tag("other", "a")
        moves = client.history("prod")
        assert len(moves) == 5 and [m.archive for m in moves] == ["b", "a", "b", "a", "b"]
        assert moves[-1].previous == "a" and all(m.by == "" for m in moves)  # an open server: no token
        assert len(client.history("other")) == 1


def test_migrate_copies_the_history(source, target, tmp_path, capsys):  # noqa: F811
    with running_server(tmp_path / "tagging", data_dir=source) as server:
        stub = server.archives()
        for archive in ("base", "tuned", "base"):
            stub.Tag(pb.TagRequest(alias="prod", archive=archive))
    code, out = migrate(source, target, capsys)
    assert code == 0 and "alias prod -> base migrated (3 of its 3 moves copied)" in out, out
    with running_server(tmp_path / "replica", **target) as replica:
        moves = replica.archives().History(pb.HistoryRequest(alias="prod")).moves
        assert [(m.previous, m.archive) for m in moves] == [("tuned", "base"), ("base", "tuned"), ("", "base")]
    code, out = migrate(source, target, capsys)  # again: nothing copied twice
    assert "alias prod -> base migrated (0 of its 3 moves copied)" in out, out


def test_log_and_tag_back_on_the_command_line(tmp_path, capsys, monkeypatch):
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with running_server(tmp_path) as server:
        with tannery.Client(server.target) as client:
            client.store("one", {"w": torch.ones(1)})
            client.store("two", {"w": torch.zeros(1)})
        run = ["--target", server.target]
        assert main([*run, "tag", "prod", "one"]) == 0
        assert main([*run, "tag", "prod", "two"]) == 0
        capsys.readouterr()
        assert main([*run, "tag", "prod", "--back"]) == 0
        assert capsys.readouterr().out == "moved prod: two -> one\n"
        assert main([*run, "log", "prod"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["MOVED", "FROM", "TO", "BY"]
        assert [line.split()[2:] for line in lines[1:]] == [["moved", "two", "one", "-"], ["moved", "one", "two", "-"],
                                                            ["created", "-", "one", "-"]]
        assert main([*run, "log", "prod", "-n", "1", "--json"]) == 0
        (move,) = json.loads(capsys.readouterr().out)
        assert (move["previous"], move["archive"], move["by"]) == ("two", "one", None) and move["moved"].endswith("Z")
        assert main([*run, "tag", "prod", "two", "--back"]) == 1
        assert "takes no ARCHIVE and no --expect" in capsys.readouterr().err
        assert main([*run, "tag", "prod"]) == 1
        assert "give ARCHIVE, or --back" in capsys.readouterr().err


def test_a_dcp_writers_moves_are_recorded_with_its_token(srv):
    import torch.distributed.checkpoint as dcp

    import tannery.dcp

    model = torch.nn.Linear(4, 2)
    with _client(srv, "ingest") as client:
        for step in (1, 2):
            writer = tannery.dcp.Writer(client, f"runs/9/step-{step}", alias="runs/9/latest")
            dcp.save(model.state_dict(), storage_writer=writer)
        moves = client.history("runs/9/latest")
    assert [(m.previous, m.archive, m.by) for m in moves] == [
        ("runs/9/step-1", "runs/9/step-2", _by(TOKENS["ingest"])), ("", "runs/9/step-1", _by(TOKENS["ingest"]))]


def test_the_asyncio_twins(srv):
    import asyncio

    import tannery.aio

    with _client(srv) as client:
        client.store("a", {"w": torch.ones(1)})
        client.store("b", {"w": torch.zeros(1)})
        client.tag("prod", "a")
        client.tag("prod", "b")

    async def run():
        async with tannery.aio.Client(srv.target, token=TOKENS["deploy"], retries=0) as client:
            back = await client.tag_back("prod")
            return back, await client.history("prod", 2)

    back, moves = asyncio.run(run())
    assert (back.previous, back.alias.archive) == ("b", "a")
    assert [(m.previous, m.archive, m.by) for m in moves] == [("b", "a", _by(TOKENS["deploy"])),
                                                             ("a", "b", _by(TOKENS["ops"]))]
