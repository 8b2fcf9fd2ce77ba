"""Remote archives opened lazily, against the real server on loopback.

``client.archive(name)`` describes no entry when it opens; each read describes the entries it
names, once, and ``names()`` or ``to_value`` the whole archive, once. What the server
described is read from its call log (every Describe notes ``described``, the entries in its
answer, and ``bytes_out``), so an open that described everything fails these tests. Errors
are compared with those of a local archive and of an archive described whole when opened
(``lazy=False``): they must not differ. The synchronous client opens lazily by default; the
asyncio one with ``lazy=True`` (its ``names``, ``info``, ``entry`` and ``in`` answer at once).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery_protocol.v1 import archives_pb2

from . import server_harness
from .server_harness import running_server, wait_for
from .test_client import Blocking, LoopThread

_names = itertools.count()


def fresh(stem: str = "lazy") -> str:
    """An archive name no other test of this module uses."""
    return f"{stem}{next(_names)}"


class CallLog(server_harness.CallLog):
    """The call log, with the Describes of an archive counted."""

    def describes(self, archive: str, count: int) -> list[dict[str, Any]]:
        """The Describes of ``archive``, once ``count`` of them are logged (a line is written
        after the client has its answer), and no more."""
        assert wait_for(lambda: len(self.of("Describe", archive)) >= count, timeout=5), self.of("Describe", archive)
        found = self.of("Describe", archive)
        assert len(found) == count, found
        return found


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Any]:
    with running_server(tmp_path_factory.mktemp("lazy")) as running:
        yield running


@pytest.fixture(scope="module")
def calls() -> Iterator[CallLog]:
    handler = CallLog()
    logger = logging.getLogger("tannery_server.calls")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(params=["sync", "aio"])
def client(request, server) -> Iterator[Any]:
    """A client of either kind; the asyncio one driven from these tests on a loop thread."""
    if request.param == "sync":
        with tannery.Client(server.target) as sync:
            sync.kind = "sync"
            yield sync
        return
    loop = LoopThread()

    async def create() -> tannery.aio.Client:
        return tannery.aio.Client(server.target)

    aio = Blocking(loop.run(create()), loop)
    aio.kind = "aio"
    yield aio
    aio.close()
    loop.close()


def open_lazily(client: Any, name: str, **options: Any) -> Any:
    """The archive as the synchronous client opens it by default, the asyncio one with lazy=True."""
    return client.archive(name, lazy=True, **options) if client.kind == "aio" else client.archive(name, **options)


def small(count: int) -> dict[str, torch.Tensor]:
    return {f"e{i:04d}": torch.full((16,), float(i)) for i in range(count)}


# -- what is described ------------------------------------------------------------------------------


def test_opening_describes_no_entry_and_each_read_describes_its_own_once(client, calls):
    name = fresh()
    state = small(200)
    client.store(name, state)
    remote = open_lazily(client, name)
    assert [d["described"] for d in calls.describes(name, 1)] == [0]
    assert len(remote) == 200 and remote.archive_info.entries == 200  # from the archive's info
    assert torch.equal(remote.tensor("e0007", [16], torch.float32), state["e0007"])
    assert torch.equal(remote.rows("e0007", 2, 5), state["e0007"][2:5])
    assert torch.equal(remote.float("e0150", [16], torch.float64), state["e0150"].double())
    assert remote.find("nope") is None and remote.find("nope") is None
    assert [d["described"] for d in calls.describes(name, 4)] == [0, 1, 1, 0]
    # Several names in one call, each described once: those already known are not asked again.
    described = remote.describe(["e0100", "e0007", "nope", "e0101"])
    assert [e.name for e in described.entries] == ["e0007", "e0100", "e0101"]
    assert described.info.entries == 200
    assert [d["described"] for d in calls.describes(name, 5)] == [0, 1, 1, 0, 2]
    assert remote.entry("e0100").shape == (16,) and remote.info("e0101").dtype == "float32"
    assert "e0100" in remote and "nope" not in remote
    calls.describes(name, 5)
    # The whole list is described once, on first need; then nothing is described again.
    if client.kind == "aio":  # (its names() answers at once: what is described)
        assert len(remote.describe().entries) == 200
    assert remote.names() == sorted(state) and remote.names() == sorted(state)
    assert "e0199" in remote and remote.find("e0198") is not None and remote.find("other") is None
    assert [d["described"] for d in calls.describes(name, 6)] == [0, 1, 1, 0, 2, 200]
    assert [e.name for e in remote.description] == sorted(state)


def test_one_entry_of_ten_thousand_moves_a_description_of_that_entry_only(client, calls):
    """10,000 entries (a union of one stored archive under 100 prefixes: no blob copied)."""
    base = fresh("base")
    client.store(base, small(100))
    name = fresh("big")
    assert client.union(name, {f"p{i:02d}": base for i in range(100)}).entries == 10_000
    remote = open_lazily(client, name)
    assert torch.equal(remote.tensor("p42.e0042", [16], torch.float32), torch.full((16,), 42.0))
    described = calls.describes(name, 2)
    assert [d["described"] for d in described] == [0, 1]
    assert sum(d["bytes_out"] for d in described) < 1024, described
    # What it would have cost: the whole description is hundreds of times larger.
    assert len(client.describe(name)) == 10_000
    assert calls.describes(name, 3)[-1]["bytes_out"] > 500_000


def test_to_value_describes_the_whole_archive_once_not_once_per_leaf(client, calls):
    name = fresh()
    state = small(50)
    client.store(name, state)
    remote = open_lazily(client, name)
    like = {key: torch.empty(16) for key in state}
    value = remote.to_value(like)
    assert all(torch.equal(value[key], state[key]) for key in state)
    assert [d["described"] for d in calls.describes(name, 2)] == [0, 50]
    assert wait_for(lambda: len(calls.of("Fetch", name)) == 1, timeout=5)


def test_an_archive_described_whole_when_opened_describes_nothing_more(client, calls):
    name = fresh()
    state = small(20)
    client.store(name, state)
    remote = client.archive(name, lazy=False)
    assert remote.names() == sorted(state) and remote.info("e0003").shape == (16,) and "e0019" in remote
    assert torch.equal(remote.tensor("e0003", [16], torch.float32), state["e0003"])
    assert remote.find("nope") is None
    assert [d["described"] for d in calls.describes(name, 1)] == [20]


# -- errors --------------------------------------------------------------------------------------------


def _outcome(read: Callable[[], Any]) -> tuple[str, str]:
    try:
        result = read()
    except Exception as error:  # the very type and message are what is compared
        return type(error).__name__, str(error)
    return "returned", "None" if result is None else type(result).__name__


READS: dict[str, Callable[[Any], Any]] = {
    "shape": lambda a: a.tensor("w", [3, 2], torch.float32),
    "dtype": lambda a: a.tensor("w", [2, 3], torch.float16),
    "missing": lambda a: a.tensor("x", [1], torch.float32),
    "did you mean": lambda a: a.tensor("ww", [2, 3], torch.float32),
    "not float": lambda a: a.float("i", [3], torch.float32),
    "float shape": lambda a: a.float("w", [2], torch.float32),
    "cast to int": lambda a: a.float("w", [2, 3], torch.int8),
    "find missing": lambda a: a.find("nope"),
    "name not a str": lambda a: a.tensor(3, [1], torch.float32),
    "leaf missing": lambda a: a.to_value({"w": torch.empty(2, 3)}),
    "leaf shape": lambda a: a.to_value({"w": torch.empty(2), "i": torch.empty(3, dtype=torch.int64),
                                        "s": torch.empty((), dtype=torch.int32)}),
    "leaf not in archive": lambda a: a.to_value({"w": torch.empty(2, 3), "i": torch.empty(3, dtype=torch.int64),
                                                 "s": torch.empty((), dtype=torch.int32), "q": torch.empty(1)}),
}
#: Reads only a remote archive has.
REMOTE_READS: dict[str, Callable[[Any], Any]] = {
    "rows past the end": lambda a: a.rows("w", 1, 3),
    "rows of a scalar": lambda a: a.rows("s", 0, 1),
    "rows backwards": lambda a: a.rows("w", 2, 1),
    "rows of a missing entry": lambda a: a.rows("nope", 0, 1),
    "rows of a near miss": lambda a: a.rows("ww", 0, 1),
    "rows of bool": lambda a: a.rows("w", True, 1),
}


def test_every_error_is_the_one_of_a_local_archive_and_of_one_described_whole(client):
    name = fresh()
    state = {"w": torch.zeros(2, 3), "i": torch.arange(3), "s": torch.tensor(7, dtype=torch.int32)}
    client.store(name, state)
    local = tannery.Archive.of_list(state)
    received: list[int] = []
    whole = client.archive(name, lazy=False, progress=received.append)
    for what, read in READS.items():
        lazy = open_lazily(client, name, progress=received.append)  # afresh: nothing described before the read
        expected = _outcome(lambda: read(local))
        assert expected[0] != "returned" or what == "find missing", (what, expected)
        assert _outcome(lambda: read(lazy)) == expected, what
        assert _outcome(lambda: read(whole)) == expected, what
    for what, read in REMOTE_READS.items():
        expected = _outcome(lambda: read(whole))
        assert expected[0] != "returned", (what, expected)
        assert _outcome(lambda: read(open_lazily(client, name, progress=received.append))) == expected, what
    assert received == []  # every refusal came before a byte moved
    if client.kind == "sync":  # (the asyncio archive's info and entry need a description first)
        for read in (lambda a: a.info("ww"), lambda a: a.entry("ww")):
            assert _outcome(lambda: read(open_lazily(client, name))) == _outcome(lambda: read(whole))
        assert "did you mean 'w'" in _outcome(lambda: open_lazily(client, name).info("ww"))[1]


def test_an_archive_that_is_not_there_is_not_found_at_open_and_after_a_delete(client):
    with pytest.raises(tannery.NotFound, match="archive 'nope' not found"):
        open_lazily(client, "nope")
    name = fresh()
    client.store(name, {"w": torch.zeros(2), "v": torch.ones(2)})
    remote = open_lazily(client, name)
    assert remote.find("w") is not None
    client.delete(name)
    for read in (lambda: remote.find("v"), lambda: remote.find("w"), lambda: remote.to_value({"w": torch.empty(2)})):
        with pytest.raises(tannery.NotFound, match=f"archive '{name}' not found"):
            read()


def test_an_entry_is_checked_against_the_archive_as_it_was_when_first_described(client):
    """Described before a replace, an entry's ask carries what was described and the server
    refuses it; described first after, it is checked against the archive as it is then."""
    name = fresh()
    client.store(name, {"w": torch.zeros(2, 3), "d": torch.zeros(4), "gone": torch.ones(1)})
    remote = open_lazily(client, name)
    assert remote.tensor("w", [2, 3], torch.float32).shape == (2, 3)
    client.store(name, {"w": torch.zeros(3, 2), "d": torch.zeros(4, dtype=torch.float16)}, replace=True)
    with pytest.raises(tannery.ArchiveError, match=r"w: shape \[3, 2\] in the archive, \[2, 3\] asked for"):
        remote.rows("w", 0, 1)  # the server's refusal: the ask said [2, 3]
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.tensor: d: float16 in the archive, float32 asked for$"):
        remote.tensor("d", [4], torch.float32)
    assert remote.find("gone") is None
    assert remote.tensor("d", [4], torch.float16).dtype == torch.float16


# -- the asyncio archive opened lazily ---------------------------------------------------------------


def test_the_asyncio_archive_answers_at_once_only_for_what_is_described(server, calls):
    loop = LoopThread()

    async def main() -> None:
        name = fresh()
        async with tannery.aio.Client(server.target) as client:
            await client.store(name, small(30))
            remote = await client.archive(name, lazy=True)
            assert len(remote) == 30
            with pytest.raises(RuntimeError, match=r"info\('e0001'\): .* opened with lazy=True and \['e0001'\] is "
                                                   r"not described yet: await archive.describe\(\['e0001'\]\) first"):
                remote.info("e0001")
            with pytest.raises(RuntimeError, match="its entries are not described yet: await archive.describe()"):
                remote.names()
            with pytest.raises(RuntimeError, match="not described yet"):
                _ = "e0001" in remote
            assert [e.name for e in (await remote.describe(["e0001", "e0002", "x"])).entries] == ["e0001", "e0002"]
            assert remote.info("e0001").shape == (16,) and "e0002" in remote and "x" not in remote
            assert torch.equal(await remote.tensor("e0009", [16], torch.float32), torch.full((16,), 9.0))
            assert remote.entry("e0009").shape == (16,)
            assert len((await remote.describe()).entries) == 30 and len(remote.names()) == 30
            assert [d["described"] for d in calls.describes(name, 4)] == [0, 2, 1, 30]
            # Described whole when opened (the default): everything answers at once.
            whole = await client.archive(name)
            assert "e0003" in whole and whole.names() == sorted(small(30))

    try:
        loop.run(main())
    finally:
        loop.close()


# -- the Describe call itself ---------------------------------------------------------------------------


def test_describe_requests_old_and_new(server, calls):
    name = fresh()
    with tannery.Client(server.target) as client:
        client.store(name, small(5), metadata={"format": "pt"})
        assert [e.name for e in client.describe(name, ["e0004", "e0001", "nope"]).entries] == ["e0001", "e0004"]
        assert client.describe(name, []).entries == () and client.describe(name, []).metadata == {"format": "pt"}
        with pytest.raises(TypeError, match="names is a list of entry names, not one str"):
            client.describe(name, "e0001")
    stub = server.archives()
    # A client from before the new fields: every entry, as ever.
    old = stub.Describe(archives_pb2.DescribeRequest(archive=name))
    assert [e.name for e in old.entries] == sorted(small(5)) and old.info.entries == 5
    assert dict(old.metadata) == {"format": "pt"}
    named = stub.Describe(archives_pb2.DescribeRequest(archive=name, names=["e0003", "e0000", "e0003", "zz"]))
    assert [e.name for e in named.entries] == ["e0000", "e0003"] and named.info == old.info
    assert {e.name: e for e in named.entries} == {e.name: e for e in old.entries if e.name in ("e0000", "e0003")}
    none = stub.Describe(archives_pb2.DescribeRequest(archive=name, no_entries=True))
    assert list(none.entries) == [] and none.info == old.info and dict(none.metadata) == {"format": "pt"}
    with pytest.raises(grpc.RpcError) as caught:
        stub.Describe(archives_pb2.DescribeRequest(archive=name, names=["e0000"], no_entries=True))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "names (1) and no_entries ask for some entries and for none: give one of them" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Describe(archives_pb2.DescribeRequest(archive="absent", no_entries=True))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND and "archive 'absent' not found" in caught.value.details()
