"""Aliases listed by prefix, a page at a time (issue 43): the catalog's ranges on both backends
(SQLite and PostgreSQL), and ListAliases' pages and tokens through the real server."""

from __future__ import annotations

import grpc
import pytest
import torch

import tannery
from tannery_protocol.v1 import archives_pb2
from tannery_server.storage import AliasPage
from tannery_server.storage.alias_sql import prefix_end

from .test_storage import _commit, catalog  # noqa: F401  (the fixture: each test on both catalogs)

#: Archives and the aliases of each, alias names interleaved with the archives' order.
ALIASED = {"other": ["o"], "run/1": ["z1", "a1", "m1"], "run/2": ["b2"], "run/3": ["y3", "c3"], "runs": ["r"]}


def _tagged(catalog) -> None:  # noqa: F811
    for archive, aliases in ALIASED.items():
        _commit(catalog, archive, ["w"])
        for alias in aliases:
            catalog.tag(alias, archive, None, 1)


def _pairs(records) -> list[tuple[str, str]]:
    return [(r.archive, r.alias) for r in records]


def test_aliases_by_archive_prefix_come_by_archive_then_name_and_page_without_gaps(catalog):  # noqa: F811
    _tagged(catalog)
    under = [("run/1", "a1"), ("run/1", "m1"), ("run/1", "z1"), ("run/2", "b2"), ("run/3", "c3"), ("run/3", "y3")]
    assert _pairs(catalog.aliases(page=AliasPage(archive_prefix="run/"))) == under
    paged, after = [], None
    while True:  # pages of two, each starting after the last one read
        page = catalog.aliases(page=AliasPage(archive_prefix="run/", after=after, limit=2))
        paged += _pairs(page)
        if len(page) < 2:
            break
        after = (page[-1].archive, page[-1].alias)
    assert paged == under
    assert _pairs(catalog.aliases(page=AliasPage(archives_from="run/2", archives_to="runs"))) == [
        ("run/2", "b2"), ("run/3", "c3"), ("run/3", "y3"), ("runs", "r")]
    assert _pairs(catalog.aliases("m", page=AliasPage(archive_prefix="run"))) == [("run/1", "m1")]
    assert _pairs(catalog.aliases("", "run/3", AliasPage(after=("run/3", "c3")))) == [("run/3", "y3")]


def test_aliases_by_name_page_by_name(catalog):  # noqa: F811
    _tagged(catalog)
    names = sorted(a for aliases in ALIASED.values() for a in aliases)
    assert [r.alias for r in catalog.aliases()] == names
    assert [r.alias for r in catalog.aliases(page=AliasPage(after=("", "m1"), limit=3))] == ["o", "r", "y3"]
    assert [r.alias for r in catalog.aliases("y")] == ["y3"]


def test_prefix_end_bounds_exactly_the_names_a_prefix_owns():
    assert prefix_end("run/") == "run0" and prefix_end("") is None
    assert prefix_end("a\U0010ffff") == "b" and prefix_end("\U0010ffff") is None
    assert prefix_end("x\ud7ff") == "x\ue000"  # past the surrogates, which no name holds


def test_list_aliases_pages_with_tokens_and_refuses_a_foreign_token(server):
    with tannery.Client(server.target) as client:
        for archive, aliases in ALIASED.items():
            client.store(archive, {"w": torch.zeros(1)})
            for alias in aliases:
                client.tag(alias, archive)
        stub = server.archives()
        seen, token, pages = [], "", 0
        while True:
            reply = stub.ListAliases(archives_pb2.ListAliasesRequest(archive_prefix="run/", page_size=2,
                                                                     page_token=token))
            seen += [(a.archive, a.alias) for a in reply.aliases]
            pages, token = pages + 1, reply.next_page_token
            if not token:
                break
        assert pages == 3 and [p[0] for p in seen] == ["run/1"] * 3 + ["run/2"] + ["run/3"] * 2
        assert len(set(seen)) == 6
        assert len(stub.ListAliases(archives_pb2.ListAliasesRequest(page_size=5000)).aliases) == 8  # capped, all here
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListAliases(archives_pb2.ListAliasesRequest(page_token="bm90LW91cnM="))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not one this server gave" in caught.value.details()
        assert [a.alias for a in client.aliases(archive_prefix="run/3")] == ["c3", "y3"]
        assert [a.alias for a in client.aliases("r", archive_prefix="run")] == ["r"]  # of runs
        assert [i.name for i in client.list(limit=2)] == ["other", "run/1"]
        with pytest.raises(ValueError, match="None for every archive"):
            client.list(limit=0)


def test_the_asyncio_client_pages_aliases_and_lists_with_a_limit(server):
    import asyncio

    from tannery import aio

    with tannery.Client(server.target) as client:
        for i in range(3):
            client.store(f"run/{i}", {"w": torch.zeros(1)})
            client.tag(f"run-{i}", f"run/{i}")

    async def main():
        async with aio.Client(server.target) as client:
            return (await client.aliases(archive_prefix="run/"), await client.list("run/", limit=2),
                    await client.aliases("run-2"))

    aliases, listed, one = asyncio.run(main())
    assert [(a.alias, a.archive) for a in aliases] == [("run-0", "run/0"), ("run-1", "run/1"), ("run-2", "run/2")]
    assert [i.name for i in listed] == ["run/0", "run/1"] and [a.alias for a in one] == ["run-2"]
