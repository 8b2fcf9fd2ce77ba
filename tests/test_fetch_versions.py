"""A Fetch cut off by a server killed (-9) and resumed never mixes two versions of its archive:
the rest is asked of the version the first attempt read (``FetchRequest.version``), so an
archive replaced before the retry gets through gives an error naming the remedy, never new
entries after old ones (issue 43, "one snapshot per read")."""

from __future__ import annotations

import pytest
import torch

import tannery
from tannery.rpc.retries import RetryPolicy, resumed_request
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import ServerProcess, free_port

MiB = 1 << 20
#: 16 MiB in 8 entries: more than the connection buffers, so a kill finds the Fetch midway.
ENTRIES = 8
ENTRY_FLOATS = 2 * MiB // 4
TRIES = 20


def version(v: int) -> dict[str, torch.Tensor]:
    """The archive's version ``v``: every element of every entry is ``v``."""
    return {f"layer{i}.weight": torch.full((ENTRY_FLOATS,), float(v)) for i in range(ENTRIES)}


@pytest.fixture
def server(tmp_path):
    port = free_port()
    with ServerProcess(tmp_path / "data", port=port) as srv:
        yield srv


class KillAndReplace:
    """A progress callback that, once ``after`` bytes came, kills the server (SIGKILL), starts
    it again and replaces the archive with version ``new`` before the Fetch's retry gets through."""

    def __init__(self, server: ServerProcess, name: str, new: int, after: int) -> None:
        self.server, self.name, self.new, self.after = server, name, new, after
        self.moved = 0
        self.fired = False

    def __call__(self, nbytes: int) -> None:
        self.moved += nbytes
        if self.moved >= self.after and not self.fired:
            self.fired = True
            self.server.kill()
            self.server.start()
            with tannery.Client(self.server.target, transport="grpc", retries=5) as writer:
                writer.store(self.name, version(self.new), replace=True)


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_fetch_resumed_after_a_kill_and_a_replace_is_all_old_or_an_error_never_a_mix(server, transport):
    refused = whole = 0
    tries = TRIES if transport == "grpc" else 5
    for attempt in range(tries):
        old, new = 2 * attempt, 2 * attempt + 1
        with tannery.Client(server.target, transport="grpc") as writer:
            writer.store("model", version(old), replace=True)
        cut = KillAndReplace(server, "model", new, after=int(2.5 * ENTRY_FLOATS * 4))
        names = sorted(version(old)) if attempt % 2 else None  # by name, and every entry (by prefix)
        got: list[tuple[str, torch.Tensor]] = []
        with tannery.Client(server.target, transport=transport, retries=RetryPolicy(6, first_delay=0.05)) as client:
            try:
                for name, tensor in client.fetch_iter("model", names, progress=cut):
                    got.append((name, tensor))
            except tannery.ArchiveError as error:
                assert "was replaced since this Fetch began" in str(error) and "fetch again" in str(error), error
                refused += 1
            else:
                whole += 1
                assert [n for n, _ in got] == sorted(version(old))
        assert cut.fired, "the server was never killed: the Fetch finished first"
        values = {float(t.unique().item()) for _, t in got if t.numel()}
        assert values <= {float(old)}, f"try {attempt}: entries of two versions in one answer: {values}"
        assert 0 < len(got) <= ENTRIES
    # A try is cut off after whole entries and the archive replaced: the rest is refused (a
    # Fetch whose bytes were all on their way before the kill may still end whole, all old).
    assert refused + whole == tries and refused >= tries // 2, (refused, whole)


def test_a_resumed_request_carries_the_version_it_began_on():
    request = pb.FetchRequest(archive="m", entries=[pb.EntryAsk(name="a"), pb.EntryAsk(name="b")])
    rest = resumed_request(request, ["a"], None, "123")
    assert [ask.name for ask in rest.entries] == ["b"] and rest.version == "123"
    again = resumed_request(rest, [], None)  # a later resume keeps the version
    assert again.version == "123"


def test_a_fetch_pinned_to_another_version_is_refused_and_a_malformed_one_is_invalid(server):
    """Without a kill: a Fetch naming the version it read gets the entries; naming another (the
    archive was replaced) gets FAILED_PRECONDITION with the remedy; a version no server gives,
    INVALID_ARGUMENT. The version comes in the initial metadata of every Fetch."""
    import grpc

    with tannery.Client(server.target, transport="grpc") as client:
        client.store("m", {"w": torch.ones(3)})
    channel = grpc.insecure_channel(server.target)
    try:
        from tannery_protocol.v1 import archives_pb2_grpc

        stub = archives_pb2_grpc.ArchivesStub(channel)
        call = stub.Fetch(pb.FetchRequest(archive="m"))
        assert list(call) and dict(call.initial_metadata())["tannery-archive-version"].isdigit()
        version = dict(call.initial_metadata())["tannery-archive-version"]
        assert list(stub.Fetch(pb.FetchRequest(archive="m", version=version)))
        with tannery.Client(server.target, transport="grpc") as client:
            client.store("m", {"w": torch.zeros(3)}, replace=True)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Fetch(pb.FetchRequest(archive="m", version=version)))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details().startswith(f"archive 'm' was replaced since this Fetch began (version {version}")
        assert refused.value.details().endswith("fetch again")
        for bad in ("v1", "9" * 40, "１２"):
            with pytest.raises(grpc.RpcError) as malformed:
                list(stub.Fetch(pb.FetchRequest(archive="m", version=bad)))
            assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "is not one this server gives" in malformed.value.details()
    finally:
        channel.close()
