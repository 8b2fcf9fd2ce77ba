"""Small entries travel whole, several to a gRPC message, both ways (``StoreRequest.entries``,
``FetchResponse.entries``), against the real server on loopback.

The messages are counted where gRPC hands them over: the server's Store deserializer and
Fetch serializer (each message also decoded by the generated classes, so the hand-written
framing is checked against protobuf's), or the client's Fetch deserializer for a server in
a subprocess. A server started with ``batched_entries`` off stands in for one from before
the field: it says so in DataPaths, refuses the field and sends one entry per message.
"""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery.rpc import requests as client_requests
from tannery.torch import buffer_of, serialize
from tannery_protocol import errors, wire
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import ServerProcess, collect_fetch, commit_request, free_port, running_server, store_requests

KiB = 1 << 10
CHUNK = 64 * KiB


def small_tensors(count: int, prefix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` small tensors of several dtypes and shapes (an empty one and a scalar among them)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        if i % 11 == 3:
            tensor = torch.rand(5, generator=generator) > 0.5
        elif i % 7 == 2:
            tensor = torch.randint(-1000, 1000, (2, 3), generator=generator, dtype=torch.int64)
        elif i % 13 == 5:
            tensor = torch.rand((), generator=generator).to(torch.bfloat16)
        elif i == 1:
            tensor = torch.empty(0, 4)
        else:
            tensor = torch.rand(16, generator=generator)
        out[f"{prefix}.{i:05d}"] = tensor
    return out


def mixed(count: int) -> dict[str, torch.Tensor]:
    """Small entries on both sides of large ones in name order: one over the chunk size, one
    over the small threshold but under the chunk size."""
    generator = torch.Generator().manual_seed(1)
    large = {"m.big": torch.rand(300_000, generator=generator), "m.mid": torch.rand(20_000, generator=generator)}
    return {**small_tensors(count // 2, "a"), **large, **small_tensors(count - count // 2, "z", seed=2)}


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def as_dict(archive) -> dict[str, torch.Tensor]:
    return {name: archive.find(name) for name in archive.names()}


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(len(serialize(t)) for t in tensors.values())


@dataclass
class Wire:
    """What the server received and sent: per message, the entry it starts and its whole entries."""

    stored: list[pb.StoreRequest] = field(default_factory=list)
    fetched: list[pb.FetchResponse] = field(default_factory=list)

    def whole(self, messages: list) -> int:
        return sum(len(m.entries) for m in messages)


@contextmanager
def counted_server(tmp_path, monkeypatch, **config) -> Iterator[tuple[object, Wire]]:
    """An in-process server whose Store and Fetch messages are recorded, decoded by the generated classes."""
    from tannery_server import archives

    seen = Wire()

    def store_request(data: bytes) -> wire.StoreMessage:
        seen.stored.append(pb.StoreRequest.FromString(data))
        return wire.parse_store_request(data)

    def fetch_response(message: bytes) -> bytes:
        data = wire.serialize_response(message)
        seen.fetched.append(pb.FetchResponse.FromString(data))
        return data

    monkeypatch.setitem(archives._HAND_WRITTEN, "Store", {"request_deserializer": store_request})
    monkeypatch.setitem(archives._HAND_WRITTEN, "Fetch", {"response_serializer": fetch_response})
    with running_server(tmp_path, chunk_size=CHUNK, **config) as server:
        yield server, seen


@pytest.fixture
def counted(tmp_path, monkeypatch):
    with counted_server(tmp_path, monkeypatch) as pair:
        yield pair


def test_wire_reads_whole_entries_as_views_of_the_message():
    batch = wire.EntryBatch(wire.STORE_ENTRIES, CHUNK)
    payloads = {f"w{i}": serialize(torch.arange(i + 1, dtype=torch.float32)) for i in range(3)}
    for name, payload in payloads.items():
        batch.add(name.encode(), [payload[:7], memoryview(payload)[7:]], len(payload), hashlib.sha256(payload).digest())
    data = batch.take()
    assert batch.count == 0 and batch.size == 0
    parsed = wire.parse_store_request(data)
    generated = pb.StoreRequest.FromString(data)
    assert [(w.name, bytes(w.payload)) for w in parsed.entries] == list(payloads.items())
    assert [(w.name, w.payload) for w in generated.entries] == list(payloads.items())
    assert all(w.payload.obj is data for w in parsed.entries)  # views of the received bytes: no copy
    assert [w.sha256 for w in parsed.entries] == [hashlib.sha256(p).digest() for p in payloads.values()]
    cost = sum(wire.EntryBatch.cost(n.encode(), len(p), b"x" * 32) for n, p in payloads.items())
    assert cost == len(data)


def test_thousands_of_small_entries_round_trip_in_few_messages(counted):
    server, seen = counted
    tensors = mixed(3000)
    with tannery.Client(server.target, chunk_size=CHUNK) as client:
        info = client.store("many", tensors)
        assert (info.entries, info.payload_bytes) == (len(tensors), payload_bytes(tensors))
        # begin, a few batches, the large entries' chunks (300,000 floats in 19), commit: not 3,002
        assert seen.whole(seen.stored) == len(tensors) - 2
        assert [m.entry for m in seen.stored if m.entry] == ["m.big", "m.mid"]
        assert len(seen.stored) < 40, len(seen.stored)

        assert_same(tensors, as_dict(client.fetch("many")))
        assert seen.whole(seen.fetched) == len(tensors) - 2 and len(seen.fetched) < 40, len(seen.fetched)

        assert_same(tensors, dict(client.fetch_iter("many")))
        pieces: dict[str, bytearray] = {}
        for piece in client.fetch_pieces("many"):
            assert piece.offset == len(pieces.setdefault(piece.name, bytearray()))
            pieces[piece.name] += piece.data
        assert list(pieces) == sorted(tensors)
        assert all(bytes(pieces[n]) == bytes(buffer_of(t)) for n, t in tensors.items())

        remote = client.archive("many")
        owned = {name: t for name, t in tensors.items() if name.startswith("a.")}  # one Fetch of them all
        got = remote.to_value({name[2:]: torch.empty_like(t) for name, t in owned.items()}, "a")
        assert_same(owned, {f"a.{name}": t for name, t in got.items()})
        assert torch.equal(remote.float("a.00000", (16,), "float64"), tensors["a.00000"].double())
    fetches = [m for m in seen.fetched if m.entries]
    assert all(len(m.SerializeToString()) <= CHUNK for m in fetches)


def test_the_aio_client_batches_both_ways(counted):
    server, seen = counted
    tensors = mixed(1000)

    async def run() -> tuple:
        async with tannery.aio.Client(server.target, chunk_size=CHUNK) as client:
            await client.store("aio", tensors)
            stored = len(seen.stored)
            fetched = as_dict(await client.fetch("aio"))
            iterated = dict([item async for item in client.fetch_iter("aio")])
            pieces = [piece async for piece in client.fetch_pieces("aio")]
            return stored, fetched, iterated, pieces

    stored, fetched, iterated, pieces = asyncio.run(run())
    assert stored < 30 and seen.whole(seen.stored) == len(tensors) - 2
    assert_same(tensors, fetched)
    assert_same(tensors, iterated)
    assert [p.name for p in pieces if p.last] == sorted(tensors)


def test_a_server_with_batched_entries_off_gets_and_sends_one_entry_per_message(tmp_path, monkeypatch):
    """What a new client does with a server from before the field: it asks DataPaths, and sends
    each entry in messages of its own (the old server would ignore StoreRequest.entries)."""
    tensors = small_tensors(300, "s")
    with counted_server(tmp_path, monkeypatch, batched_entries=False) as (server, seen):
        assert not server.archives().DataPaths(pb.DataPathsRequest()).batched_entries
        with tannery.Client(server.target, chunk_size=CHUNK) as client:
            client.store("old", tensors)
            assert seen.whole(seen.stored) == 0 and len(seen.stored) == len(tensors) + 2
            assert_same(tensors, as_dict(client.fetch("old")))
            assert seen.whole(seen.fetched) == 0 and len(seen.fetched) == len(tensors)
        # The field itself is refused there, naming the setting: never stored without those entries.
        payload = serialize(torch.ones(4))
        with pytest.raises(grpc.RpcError) as refused:
            server.archives().Store(iter([pb.StoreRequest(begin=pb.StoreBegin(archive="x")),
                                          pb.StoreRequest(entries=[pb.WholeEntry(name="w", payload=payload)]),
                                          commit_request(1, len(payload))]))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "batched entries off" in refused.value.details() and "'w'" in refused.value.details()
        assert server.storage.catalog.archive("x") is None


def test_an_old_client_gets_one_entry_per_message_and_a_new_one_few(counted):
    server, seen = counted
    stub = server.archives()
    payloads = {f"e{i:04d}": serialize(torch.full((16,), float(i))) for i in range(500)}
    assert stub.DataPaths(pb.DataPathsRequest()).batched_entries
    stub.Store(store_requests("raw", payloads))  # an old client's Store: one entry per message
    old = list(stub.Fetch(pb.FetchRequest(archive="raw")))
    assert len(old) == len(payloads) and not any(m.entries for m in old)
    assert collect_fetch(old) == payloads
    new = list(stub.Fetch(pb.FetchRequest(archive="raw", batched_entries=True)))
    assert len(new) < 5 and {w.name: w.payload for m in new for w in m.entries} == payloads


def _store(stub, *messages: pb.StoreRequest, archive: str = "bad") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Store(iter([pb.StoreRequest(begin=pb.StoreBegin(archive=archive)), *messages]))
    return refused.value


GOOD = serialize(torch.arange(16, dtype=torch.float32))


def _whole(name: str, payload: bytes, sha256: bytes = b"") -> pb.WholeEntry:
    return pb.WholeEntry(name=name, payload=payload, sha256=sha256)


@pytest.mark.parametrize("case, expected", [
    ("bad magic", "bad magic"),
    ("truncated", "starts before the payload of entry 'bad' ended"),
    ("trailing bytes", "more bytes after its payload"),
    ("truncated last", "ended inside a payload"),
    ("continued", "more bytes after it came whole"),
    ("empty", "without a payload"),
])
def test_a_bad_payload_inside_a_batch_is_refused_naming_it(counted, case, expected):
    server, _ = counted
    bad = {"bad magic": b"XXXX" + GOOD[4:], "truncated": GOOD[:-4], "trailing bytes": GOOD + b"\0" * 8,
           "truncated last": GOOD[:-4], "continued": GOOD, "empty": b""}[case]
    batch = [_whole("a", GOOD), _whole("bad", bad)] + ([] if case in ("truncated last", "continued") else
                                                       [_whole("c", GOOD)])
    after = [pb.StoreRequest(chunk=b"\0" * 8)] if case == "continued" else []
    error = _store(server.archives(), pb.StoreRequest(entries=batch), *after,
                   commit_request(len(batch), sum(len(w.payload) for w in batch)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert "'bad'" in error.details() and expected in error.details(), error.details()
    assert server.storage.catalog.archive("bad") is None


def test_digests_sent_ahead_are_checked_per_batched_entry(counted, monkeypatch):
    server, seen = counted
    stub = server.archives()
    other = serialize(torch.zeros(16))
    wrong = [_whole("a", GOOD, hashlib.sha256(GOOD).digest()), _whole("b", other, hashlib.sha256(GOOD).digest())]
    error = _store(stub, pb.StoreRequest(entries=wrong), commit_request(2, len(GOOD) + len(other)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "entry 'b'" in error.details(), error.details()
    short = [_whole("a", GOOD, b"\1" * 31)]
    error = _store(stub, pb.StoreRequest(entries=short), commit_request(1, len(GOOD)))
    assert "entry 'a'" in error.details() and "31 bytes" in error.details(), error.details()
    assert server.storage.catalog.archive("bad") is None

    # The client sends each batched entry's digest when the server wants them.
    monkeypatch.setattr(tannery.Client, "_wants_digests", lambda self: True)
    tensors = small_tensors(200, "d")
    seen.stored.clear()
    with tannery.Client(server.target, chunk_size=CHUNK) as client:
        client.store("digested", tensors)
        assert_same(tensors, as_dict(client.fetch("digested")))
    sent = [w for m in seen.stored for w in m.entries]
    assert len(sent) == len(tensors)
    assert all(w.sha256 == hashlib.sha256(w.payload).digest() for w in sent)


@pytest.mark.parametrize("entries, extra", [(2, 0), (4, 0), (3, -1), (3, 1)])
def test_commit_counts_that_disagree_with_batched_entries_are_refused(counted, entries, extra):
    server, _ = counted
    batch = [_whole(name, GOOD) for name in "abc"]
    error = _store(server.archives(), pb.StoreRequest(entries=batch), commit_request(entries, 3 * len(GOOD) + extra))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"commit says {entries} entries of {3 * len(GOOD) + extra}" in error.details(), error.details()
    assert f"3 entries of {3 * len(GOOD)} bytes arrived" in error.details(), error.details()
    assert server.storage.catalog.archive("bad") is None


def test_a_store_again_compares_batched_entries_with_the_archive_there(counted):
    server, _ = counted
    tensors = small_tensors(400, "s")
    with tannery.Client(server.target, chunk_size=CHUNK) as client:
        assert not client.store("same", tensors).already_stored
        assert client.store("same", tensors).already_stored
        changed = {**tensors, "s.00200": tensors["s.00200"] + 1}
        with pytest.raises(errors.AlreadyExists, match="s.00200"):
            client.store("same", changed)
        assert_same(tensors, as_dict(client.fetch("same")))


def test_a_damaged_small_entry_is_data_loss_after_the_entries_before_it(counted):
    from tannery_server.storage.packs import PACK_BLOCK_SIZE

    server, _ = counted
    tensors = small_tensors(2000, "s")  # over 64 KiB: the Store's pack has several checksum blocks
    with tannery.Client(server.target, chunk_size=CHUNK) as client:
        client.store("damaged", tensors)
        entries = sorted(server.storage.catalog.entries_under("damaged", ""), key=lambda e: e.name)
        # The first entry with a byte in the pack's second block: a byte of it there is damaged.
        victim = next(e for e in entries if e.blob_offset + e.payload_bytes > PACK_BLOCK_SIZE)
        path = server.storage.blobs.path(victim.blob)
        data = bytearray(path.read_bytes())
        data[victim.blob_offset + victim.payload_bytes - 1] ^= 0xFF
        path.write_bytes(bytes(data))
        got = []
        with pytest.raises(errors.DataLoss, match=victim.name):
            for name, tensor in client.fetch_iter("damaged"):
                got.append(name)
        assert got == [e.name for e in entries[: entries.index(victim)]]  # every entry before it, none after
        assert len(got) > 100


def test_pull_to_a_file_reads_batched_entries(counted, tmp_path, capsys):
    from safetensors.torch import load_file

    from tannery.cli import main

    server, seen = counted
    tensors = mixed(600)
    with tannery.Client(server.target) as client:
        client.store("pulled", tensors)
    seen.fetched.clear()
    output = tmp_path / "out.safetensors"
    assert main(["--target", server.target, "pull", "pulled", "-o", str(output)]) == 0, capsys.readouterr()
    assert seen.whole(seen.fetched) == len(tensors) - 2
    assert_same(tensors, dict(sorted(load_file(str(output)).items())))


@pytest.mark.slow
def test_a_fetch_resumed_after_a_restart_still_batches(tmp_path, monkeypatch):
    """A Fetch cut off inside a large entry resumes after the entries that came whole, and the
    resumed call still asks for (and gets) small entries several to a message."""
    from .test_retries import Restarter

    received: list[tuple[str, int]] = []

    def counting(data: bytes) -> wire.FetchMessage:
        message = wire.parse_fetch_response(data)
        received.append((message.entry, len(message.entries)))
        return message

    monkeypatch.setitem(client_requests._HAND_WRITTEN, "Fetch", {"response_deserializer": counting})
    generator = torch.Generator().manual_seed(3)
    large = {f"m.{i}": torch.rand(2 << 20, generator=generator) for i in range(4)}  # 8 MiB each
    tensors = {**small_tensors(2000, "a"), **large, **small_tensors(2000, "z", seed=4)}
    port = free_port()
    with ServerProcess(tmp_path / "data", port=port) as server:
        with tannery.Client(server.target) as client:
            client.store("ckpt", tensors)
        restarter = Restarter(server, after=20 << 20)  # inside the third large entry
        with tannery.Client(server.target, retries=6) as client:
            pulled = list(client.fetch_iter("ckpt", progress=restarter.progress))
        restarter.join()
    assert restarter.killed.is_set() and restarter.restarted.is_set()
    assert [name for name, _ in pulled] == sorted(tensors)  # each entry once, in order
    assert all(torch.equal(tensors[name], tensor) for name, tensor in pulled)
    restart = max(i for i, (entry, _) in enumerate(received) if entry == "m.2")  # m.2 sent again whole
    after = received[restart:]
    assert sum(whole for _, whole in after) == 2000 and sum(1 for _, whole in after if whole) < 10, after[-10:]
