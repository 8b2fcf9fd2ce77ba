"""Derive: an archive built on the server from a base archive and per-entry changes (SAME, DELTA,
WHOLE), on both storage backends: bit-exact results, SAME entries sharing the base's blob, and
every refusal clear, naming the entry, with nothing stored."""

from __future__ import annotations

import grpc
import pytest
import torch

import tannery
from tannery.weights.deltas import bits, diff_entry
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import running_server


def _base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (17, 5), generator=g),
        "mask": torch.rand(1001, generator=g) > 0.5,
        "same": torch.randn(4096, generator=g),
        "whole": torch.randn(8, 8, generator=g),
        "c128": torch.randn(5, dtype=torch.complex128, generator=g),
    }


def _next(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = {k: v.clone() for k, v in base.items()}
    new["f32"].view(-1)[::97] += 1.0
    new["bf16"][3:9] = -0.0
    new["i64"][2, 3] = 2**62
    new["mask"][::5] = ~new["mask"][::5]
    new["whole"] = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    new["c128"][2] = complex(1.5, -2.5)
    return new


def _changes(base, new):
    out = []
    for name in new:
        change = diff_entry(name, base[name], new[name], limit=2.0)  # never whole by size
        if name == "whole":
            change.kind, change.payloads = "whole", [new[name]]
        out.append((change.name, change.kind, change.digest, change.payloads))
    return out


@pytest.fixture
def srv(tmp_path, backend):
    with running_server(tmp_path, **backend) as server:
        yield server


def _client(srv) -> tannery.Client:
    return tannery.Client(srv.target, retries=0)


def _fetched(client, name: str) -> dict[str, torch.Tensor]:
    archive = client.fetch(name)
    return {entry: archive.find(entry) for entry in archive.names()}


def _assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits(got.contiguous()), bits(want.contiguous()))


def test_derive_is_bit_exact_and_same_entries_share_the_base_blob(srv):
    base, new = _base(), _next(_base())
    with _client(srv) as client:
        client.store("B", base)
        changes = _changes(base, new)
        kinds = {name: kind for name, kind, _, _ in changes}
        assert kinds["same"] == "same" and kinds["whole"] == "whole"
        assert {kinds[k] for k in ("f32", "bf16", "i64", "mask", "c128")} == {"delta"}
        info = client.derive("T", "B", changes, metadata={"k": "v"})
        assert info.name == "T" and info.entries == len(new) and not info.already_stored
        fetched = _fetched(client, "T")
        for name, tensor in new.items():
            _assert_exact(fetched[name], tensor)
        described_b = {e.name: e for e in client.describe("B").entries}
        described_t = {e.name: e for e in client.describe("T").entries}
        assert described_t["same"].digest == described_b["same"].digest
        assert described_t["f32"].digest != described_b["f32"].digest
        assert client.describe("T").metadata == {"k": "v"}
        # The same Derive again: already there, nothing stored (as a Store).
        assert client.derive("T", "B", changes, metadata={"k": "v"}).already_stored
        # Other content without replace: AlreadyExists; with replace: stored.
        other = [(n, "same", 0, []) for n in new]
        with pytest.raises(tannery.AlreadyExists):
            client.derive("T", "B", other, metadata={"k": "v"})
        client.derive("T", "B", other, replace=True)
        for name, tensor in _fetched(client, "T").items():
            _assert_exact(tensor, base[name])


def test_a_delta_derived_equals_its_store(srv):
    """The derived archive is the archive a Store of the new tensors makes: the same digests."""
    base, new = _base(), _next(_base())
    with _client(srv) as client:
        client.store("B", base)
        client.derive("T", "B", _changes(base, new))
        client.store("S", new)
        assert ({e.name: e.digest for e in client.describe("T").entries}
                == {e.name: e.digest for e in client.describe("S").entries})


def _refused(client, changes, base="B"):
    with pytest.raises(tannery_errors()) as caught:
        client.derive("T", base, changes)
    names = [a.name for a in client.list()]
    assert "T" not in names
    return caught.value


def tannery_errors():
    return (tannery.InvalidArgument, tannery.NotFound)


def test_refusals_name_the_entry_and_store_nothing(srv):
    base = {"w": torch.arange(10, dtype=torch.float32), "m": torch.zeros(9, dtype=torch.bool)}
    new_w = base["w"].clone()
    new_w[3] = 7.5
    good = diff_entry("w", base["w"], new_w, limit=2.0)
    with _client(srv) as client:
        client.store("B", base)
        same_m = ("m", "same", 0, [])

        error = _refused(client, [("w", "delta", good.digest ^ 1, good.payloads), same_m])
        assert isinstance(error, tannery.InvalidArgument)
        assert "'w'" in str(error) and "CRC-32C" in str(error) and "'T'" in str(error)

        far = torch.tensor([10], dtype=torch.int32)
        error = _refused(client, [("w", "delta", good.digest, [far, good.payloads[1]]), same_m])
        assert isinstance(error, tannery.InvalidArgument) and "index 10 is out of range" in str(error)
        assert "'w'" in str(error)

        negative = torch.tensor([-1], dtype=torch.int64)
        error = _refused(client, [("w", "delta", good.digest, [negative, good.payloads[1]]), same_m])
        assert "index -1 is out of range" in str(error)

        wrong = good.payloads[1].view(torch.float32)
        error = _refused(client, [("w", "delta", good.digest, [good.payloads[0], wrong]), same_m])
        assert isinstance(error, tannery.InvalidArgument) and "int32" in str(error) and "float32" in str(error)

        counts = [good.payloads[0], torch.cat([good.payloads[1], good.payloads[1]])]
        error = _refused(client, [("w", "delta", good.digest, counts), same_m])
        assert "1 delta indices but 2 values" in str(error)

        two = torch.tensor([2], dtype=torch.uint8)
        error = _refused(client, [("w", "same", 0, []), ("m", "delta", 0, [torch.tensor([0], dtype=torch.int32), two])])
        assert "'m'" in str(error) and "bool" in str(error)

        error = _refused(client, [("w", "same", 0, [])], base="absent")
        assert isinstance(error, tannery.NotFound) and "'absent'" in str(error)

        error = _refused(client, [("w", "same", 0, []), ("x", "same", 0, [])])
        assert isinstance(error, tannery.NotFound) and "'x'" in str(error)
        error = _refused(client, [("x", "delta", good.digest, good.payloads)])
        assert isinstance(error, tannery.NotFound) and "'x'" in str(error)

        # A WHOLE entry the base lacks is fine: the archive is the entries named.
        client.derive("T", "B", [("w", "delta", good.digest, good.payloads),
                                 ("x", "whole", 0, [torch.ones(3)])])
        got = _fetched(client, "T")
        assert sorted(got) == ["w", "x"]
        _assert_exact(got["w"], new_w)


def test_a_derive_of_an_alias_base_and_a_malformed_stream(srv):
    base = {"w": torch.arange(6, dtype=torch.int64)}
    with _client(srv) as client:
        client.store("B", base)
        client.tag("cur", "B")
        client.derive("T", "cur", [("w", "same", 0, [])])
        assert client.describe("T").entries[0].digest == client.describe("B").entries[0].digest
    stub = srv.archives()
    begin = pb.DeriveRequest(begin=pb.DeriveBegin(archive="U", base="B"))
    entry = pb.DeriveRequest(entry=pb.DeriveEntry(name="w", change=pb.DeriveEntry.SAME))
    with pytest.raises(grpc.RpcError) as caught:  # no commit
        stub.Derive(iter([begin, entry]))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as caught:  # commit's count differs
        stub.Derive(iter([begin, entry, pb.DeriveRequest(commit=pb.DeriveCommit(entries=2))]))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as caught:  # a SAME entry with bytes
        stub.Derive(iter([begin, pb.DeriveRequest(entry=entry.entry, chunk=b"xx"),
                          pb.DeriveRequest(commit=pb.DeriveCommit(entries=1))]))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as caught:  # no begin
        stub.Derive(iter([entry]))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert [a.name for a in stub.List(pb.ListRequest()).archives] == ["B", "T"]



def test_the_asyncio_client_derives(srv):
    import asyncio

    import tannery.aio

    base = {"w": torch.arange(100, dtype=torch.int64)}
    new = base["w"].clone()
    new[[5, 50]] = -1
    change = diff_entry("w", base["w"], new, limit=2.0)

    async def scenario():
        async with tannery.aio.Client(srv.target, retries=0) as client:
            await client.store("B", base)
            return await client.derive("T", "B", [(change.name, change.kind, change.digest, change.payloads)])

    assert asyncio.run(scenario()).entries == 1
    with _client(srv) as client:
        _assert_exact(_fetched(client, "T")["w"], new)
