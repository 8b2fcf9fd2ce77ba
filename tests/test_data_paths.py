"""The data paths beside gRPC (a same-host Unix socket, a TCP data port) on the real server.

Every test runs the clients with an explicit ``transport=``: ``grpc``, ``local`` (the
server's socket: blob files passed and mapped), ``tcp`` (its data port) and ``auto``
(local here). A call that should have moved its bytes on a data path is checked to have
done so in the server's call log (its ``transport`` field, and no tensor bytes in its gRPC
messages), so a silent fall back to gRPC fails the tests.

Both clients run them, ``tannery.Client`` and ``tannery.aio.Client`` (driven from these
synchronous tests on a loop thread). Raw tickets, killed clients and killed servers are in
tests/test_data_path_failures.py.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import tannery
import tannery.aio
from tannery_protocol import codec
from tannery.torch import buffer_of, serialize
from tannery_server.cli import build_parser
from tannery_server.config import Config

from .conftest import FIXTURES
from .server_harness import CallLog, ServerProcess, free_port, running_server, wait_for
from .test_client import Blocking, LoopThread, random_tensor
from .test_security import pki  # noqa: F401  (the test CA, server and client certificates)

TRANSPORTS = ["grpc", "local", "tcp", "auto"]
#: The path each ``transport=`` takes to a server offering both data paths on this host.
TAKEN = {"grpc": "grpc", "local": "local", "tcp": "tcp", "auto": "local"}
MiB = 1 << 20

_names = itertools.count()
_seeds = itertools.count(1000, 10)


def fresh(stem: str = "a") -> str:
    """An archive name no other test of this module uses."""
    return f"{stem}{next(_names)}"


def seed() -> int:
    """Random bits no other test of this module stores (blobs are shared by digest: a test
    that corrupts one must not meet another's); each seed leaves room for ten more."""
    return next(_seeds)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and buffer bytes (NaNs and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and bytes(buffer_of(a)) == bytes(buffer_of(b))


def payload_data(tensor: torch.Tensor) -> bytes:
    """The tensor bytes of a tensor's payload (booleans bit-packed), as pieces carry them."""
    payload = serialize(tensor)
    return payload[codec.parse(payload).data_offset :]


def unique_state(base: int) -> dict[str, torch.Tensor]:
    """A small model of random bits: its blobs are this archive's alone (for corrupting them)."""
    return {
        "embed.weight": random_tensor("float32", (64, 32), base),
        "blocks.0.w": random_tensor("bfloat16", (32, 32), base + 1),
        "blocks.0.b": random_tensor("float16", (32,), base + 2),
        "blocks.1.mask": random_tensor("bool", (5, 7), base + 3),
        "steps": torch.tensor(base, dtype=torch.int64),
    }


#: The caller's TANNERY_* client variables do not apply (conftest.no_client_environment).
pytestmark = pytest.mark.usefixtures("no_client_environment")


# -- the server's call log: which path a call took ----------------------------------------------


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


def assert_took(calls: CallLog, transport: str, method: str, archive: str) -> None:
    """The last ``method`` call on ``archive`` moved its bytes the way ``transport`` should
    have: on the data path (noted, and almost nothing in the gRPC messages), or on gRPC."""
    record = calls.last(method, archive)
    expected = TAKEN[transport]
    assert record["status"] == "OK", record
    if expected == "grpc":
        assert "transport" not in record, record
    else:
        assert record.get("transport") == expected, record
        assert record["bytes"] < 512, f"tensor bytes went over gRPC: {record}"


# -- servers and clients ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[Any]:
    """One server for the tests that need no settings of their own: every test stores its own
    archive names (:func:`fresh`), and random bits where it corrupts a blob."""
    with running_server(tmp_path_factory.mktemp("shared")) as server:
        yield server


class AioBlocking(Blocking):
    """A ``tannery.aio.Client`` used like a ``tannery.Client`` (async iterators included)."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name == "transport":  # a coroutine method of the aio client, a property of the other
            return self._loop.run(value())
        if name not in ("fetch_iter", "fetch_pieces"):
            return super().__getattr__(name)

        def iterate(*args: Any, **kwargs: Any) -> Iterator[Any]:
            entries = value(*args, **kwargs)
            try:
                while True:
                    try:
                        yield self._loop.run(entries.__anext__())
                    except StopAsyncIteration:
                        return
            finally:
                self._loop.run(entries.aclose())

        return iterate


def _connector(kind: str, transport: str | None) -> Iterator[Any]:
    """``make(target, **options)``: clients of ``kind`` ("sync" or "aio"), of ``transport``
    unless ``options`` say otherwise, closed at the end."""
    opened: list[Any] = []
    loop = LoopThread() if kind == "aio" else None

    def make(target: str, **options: Any) -> Any:
        if transport is not None:
            options.setdefault("transport", transport)
        if loop is None:
            client = tannery.Client(target, **options)
        else:
            async def create() -> tannery.aio.Client:
                return tannery.aio.Client(target, **options)

            client = AioBlocking(loop.run(create()), loop)
        opened.append(client)
        return client

    make.kind, make.transport = kind, transport
    yield make
    for client in opened:
        client.close()
    if loop is not None:
        loop.close()


@pytest.fixture(params=[pytest.param(("sync", t), id=f"sync-{t}") for t in TRANSPORTS]
                + [pytest.param(("aio", t), id=f"aio-{t}") for t in TRANSPORTS])
def connect(request):
    """``connect(target, **options)``: a client of the parametrized kind and transport (its
    ``.transport`` is the one asked for), closed at the end."""
    yield from _connector(*request.param)


@pytest.fixture(params=["sync", "aio"])
def open_client(request):
    """``open_client(target, transport=..., **options)``: a client of the parametrized kind."""
    yield from _connector(request.param, None)


@pytest.fixture
def client(shared, connect):
    return connect(shared.target)


def blob_path(server: Any, digest: str) -> Path:
    return server.data_dir / "blobs" / digest[:2] / digest


def flip_bit(path: Path, offset: int) -> None:
    """Change one bit of a stored blob file, in place."""
    path.chmod(0o644)
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x10]))


def mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files this process maps where ``tensor``'s bytes lie (from /proc/self/maps)."""
    start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) == 6 and low <= start and stop <= high:
            found.add(fields[5])
    return found


# -- round trips ----------------------------------------------------------------------------------


def test_every_dtype_scalars_and_empty_tensors_round_trip_bit_for_bit(client, connect, calls, shared):
    shapes = [(), (0,), (3, 0, 2), (1,), (37, 29), (2, 3, 4, 5)]
    tensors = {f"{dtype}.{i}": random_tensor(dtype, shape, i) for dtype in codec.DTYPES
               for i, shape in enumerate(shapes)}
    name = fresh()
    info = client.store(name, tensors)
    assert info.entries == len(tensors)
    assert_took(calls, connect.transport, "Store", name)
    fetched = client.fetch(name)
    assert_took(calls, connect.transport, "Fetch", name)
    assert fetched.names() == sorted(tensors)
    for entry, tensor in tensors.items():
        assert same_bits(fetched.find(entry), tensor), entry
    assert client.transport == TAKEN[connect.transport]
    if TAKEN[connect.transport] == "local":
        # Small tensors are copied out of the file the server passed (each live map would hold a
        # descriptor: a pack's thousands of entries would run out of them), large ones are views
        # of the stored blob file itself (mapped, not copied).
        large = random_tensor("float32", (300, 1000), seed())
        big = fresh()
        client.store(big, {"w": large})
        [blob] = [e.blob for e in shared.storage.catalog.entries_under(big, "")]
        assert mapped_files(client.fetch(big).find("w")) == {str(blob_path(shared, blob))}
        for entry in fetched.names():
            tensor = fetched.find(entry)
            assert not any(path.startswith(str(shared.data_dir)) for path in mapped_files(tensor)), entry


def test_writing_a_fetched_tensor_changes_neither_the_stored_blob_nor_the_next_fetch(client, shared):
    """A local fetch maps the blob file privately: writes to the tensor stay in this process."""
    original = random_tensor("float32", (300, 1000), seed())
    name = fresh()
    client.store(name, {"w": original})
    digest = client.describe(name).entries[0].digest
    fetched = client.fetch(name).find("w")
    fetched.fill_(1.0)
    rows = client.archive(name).rows("w", 10, 20)
    rows.zero_()
    assert same_bits(client.fetch(name).find("w"), original)
    assert hashlib.sha256(blob_path(shared, digest).read_bytes()).hexdigest() == digest


@functools.lru_cache(maxsize=1)
def random_64_mib() -> torch.Tensor:
    """64 MiB of random float32 bits (NaNs included), made once for the module."""
    raw = np.random.default_rng(64).integers(0, 256, 64 * MiB, dtype=np.uint8)
    return torch.from_numpy(raw).view(torch.float32).reshape(4096, -1)


def test_a_64_mib_tensor_round_trips_and_progress_counts_every_byte(client, connect, calls):
    big = random_64_mib()
    name = fresh()
    sent: list[int] = []
    info = client.store(name, {"big": big, "small": torch.arange(5)}, progress=sent.append)
    assert sum(sent) == info.payload_bytes
    assert_took(calls, connect.transport, "Store", name)
    received: list[int] = []
    fetched = client.fetch(name, progress=received.append)
    assert_took(calls, connect.transport, "Fetch", name)
    assert sum(received) == info.payload_bytes
    assert same_bits(fetched.find("big"), big) and same_bits(fetched.find("small"), torch.arange(5))
    # Rows of it across block boundaries (1 MiB blocks), at an offset no page starts at.
    rows = client.archive(name).rows("big", 1000, 3001)
    assert same_bits(rows, big[1000:3001])


def test_the_real_fixture_checkpoints_round_trip_and_load_into_their_models(client, connect, calls):
    if not FIXTURES.is_dir():
        pytest.skip(f"{FIXTURES} is absent")
    from .test_archive_files import CNN, MLP

    for stem, module in (("MLP", MLP), ("CNN", CNN)):
        like = module().state_dict()
        local = tannery.load_tannic(FIXTURES / stem, like=like)
        name = fresh(stem)
        client.store(name, local)
        assert_took(calls, connect.transport, "Store", name)
        model = module()
        client.load_state_dict(model, name)
        assert_took(calls, connect.transport, "Fetch", name)
        for entry, tensor in model.state_dict().items():
            assert same_bits(tensor, local.find(entry)), (stem, entry)
    flat = tannery.load_tannic(FIXTURES / "dev-embd.metadata.tannic")
    name = fresh("embd")
    client.store(name, flat)
    assert same_bits(client.fetch(name).find("weight"), flat.find("weight"))


# -- what a Fetch may ask for --------------------------------------------------------------------


def test_fetch_by_names_by_prefix_or_all_and_fetch_iter_in_order(client, connect, calls):
    state = unique_state(seed())
    name = fresh()
    client.store(name, state)
    picked = client.fetch(name, names=["steps", "blocks.0.w"])
    assert_took(calls, connect.transport, "Fetch", name)
    assert picked.names() == ["blocks.0.w", "steps"]
    assert same_bits(picked.find("blocks.0.w"), state["blocks.0.w"])
    assert client.fetch(name, prefix="blocks.0").names() == ["blocks.0.b", "blocks.0.w"]
    everything = client.fetch(name)
    assert everything.names() == sorted(state)
    assert all(same_bits(everything.find(k), v) for k, v in state.items())
    under = fresh()
    client.store(under, state, prefix="model")  # entries named under a prefix
    assert client.fetch(under, prefix="model.blocks.0").names() == ["model.blocks.0.b", "model.blocks.0.w"]
    asked = ["steps", "blocks.1.mask", "embed.weight"]
    iterated = list(client.fetch_iter(name, names=asked))
    assert [entry for entry, _ in iterated] == asked
    assert all(same_bits(tensor, state[entry]) for entry, tensor in iterated)
    assert [entry for entry, _ in client.fetch_iter(name, prefix="blocks")] == ["blocks.0.b", "blocks.0.w",
                                                                               "blocks.1.mask"]
    # Leaving early ends the call; the client goes on working.
    for _ in client.fetch_iter(name):
        break
    assert same_bits(client.fetch(name, names=["steps"]).find("steps"), state["steps"])


def test_fetch_pieces_concatenate_to_the_tensor_bytes(client, connect):
    state = unique_state(seed())
    state["large"] = random_tensor("float32", (9 * MiB // 4,), 201)  # several pieces on tcp
    state["empty"] = torch.empty(0, 3)
    name = fresh()
    client.store(name, state)
    received: list[int] = []
    gathered: dict[str, bytearray] = {}
    for piece in client.fetch_pieces(name, progress=received.append):
        data = gathered.setdefault(piece.name, bytearray())
        assert piece.offset == len(data) and piece.first == (piece.offset == 0), piece.name
        data += piece.data
        assert piece.last == (len(data) == piece.info.nbytes), piece.name
        assert (piece.info.dtype.name, piece.info.shape) == (tannery.torch.short_name(state[piece.name].dtype),
                                                            tuple(state[piece.name].shape))
    assert list(gathered) == sorted(state)
    for entry, tensor in state.items():
        assert bytes(gathered[entry]) == payload_data(tensor), entry
    assert sum(received) == sum(len(serialize(t)) for t in state.values())  # payload bytes, as for fetch


def test_rows_casts_and_load_state_dict_of_a_remote_archive(client, connect, calls):
    table = random_tensor("float32", (640, 1024), 300)  # 4 KiB rows, 2.5 MiB: rows cross blocks
    flags = random_tensor("bool", (50, 3), 301)
    values = torch.tensor([1.0, -2.5, 3.14159265358979, 1e-8, 1e30, float("inf"), float("nan")], dtype=torch.float64)
    name = fresh()
    client.store(name, {"table": table, "flags": flags, "values": values})
    received: list[int] = []
    remote = client.archive(name, progress=received.append)
    assert same_bits(remote.rows("table", 10, 13), table[10:13])
    assert_took(calls, connect.transport, "Fetch", name)
    assert sum(received) == len(serialize(table[10:13]))  # only those rows travelled
    assert same_bits(remote.rows("table", 200, 300), table[200:300])  # across the 1 MiB block boundary
    assert same_bits(remote.rows("table", 639, 640), table[639:])
    # Bool rows are bit-packed: rows 7.. start at bit 21, inside a byte.
    assert same_bits(remote.rows("flags", 7, 20), flags[7:20])
    assert same_bits(remote.rows("flags", 8, 16), flags[8:16])  # 24 bits: starts on a byte
    assert same_bits(remote.rows("flags", 0, 50), flags)
    for entry, tensor in (("table", table), ("flags", flags)):
        for start in (0, 5, 50, len(tensor)):  # empty ranges, the last one at the very end
            empty = remote.rows(entry, start, start)
            assert empty.shape == (0, *tensor.shape[1:]) and empty.dtype == tensor.dtype, (entry, start)
    assert same_bits(remote.tensor("table", [640, 1024], torch.float32), table)
    # Casts are made on the server; a cast to the stored dtype is the entry itself.
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert same_bits(remote.float("values", [7], dtype), values.to(dtype)), dtype
    assert_took(calls, connect.transport, "Fetch", name)
    module = torch.nn.Linear(1024, 3)
    model_name = fresh()
    weights = {"layer.weight": random_tensor("float32", (3, 1024), 302),
               "layer.bias": random_tensor("float32", (3,), 303)}
    client.store(model_name, weights)
    client.load_state_dict(module, model_name, prefix="layer")
    assert_took(calls, connect.transport, "Fetch", model_name)
    assert same_bits(module.weight.detach(), weights["layer.weight"])
    assert same_bits(module.bias.detach(), weights["layer.bias"])


def test_one_client_serves_concurrent_calls_from_many_threads(client, connect):
    name = fresh()
    state = {f"w{i}": torch.full((1000,), float(i)) for i in range(20)}
    client.store(name, state)
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for round in range(3):
                fetched = client.fetch(name)
                assert all(same_bits(fetched.find(k), v) for k, v in state.items())
                client.store(f"{name}.{worker}.{round}", {"x": torch.full((10,), float(worker))})
        except BaseException as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert len(client.list(prefix=f"{name}.")) == 18


def test_the_clients_timeout_ends_a_transfer_that_outlasts_it_and_nothing_is_stored(shared, connect):
    big = {"x": random_tensor("float32", (4 * MiB // 4,), seed()), "y": random_tensor("float32", (4 * MiB // 4,),
                                                                                      seed())}
    name = fresh()
    timeout = 0.5
    client = connect(shared.target, timeout=timeout)
    for _ in range(50):  # the path is chosen first (its DataPaths call may outlast the timeout on a busy host)
        try:
            client.transport
            break
        except tannery.ServiceError:
            pass
    stalled: list[float] = []

    def stall(sent: int) -> None:
        """The transfer stops at its first bytes until the call's deadline is certainly past: it
        was set when the call began, before any bytes went (then it goes on, if it can)."""
        if not stalled:
            stalled.append(time.monotonic())
            time.sleep(timeout + 0.2)

    with pytest.raises(tannery.ServiceError, match="DEADLINE_EXCEEDED") as caught:
        client.store(name, big, progress=stall)
    assert stalled, "the transfer never began"
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert wait_for(lambda: list((shared.data_dir / "tmp").iterdir()) == [])
    assert name not in [info.name for info in connect(shared.target).list()]


# -- errors name the entry on every transport -----------------------------------------------------


def test_missing_archives_and_entries_are_not_found(client):
    name = fresh()
    client.store(name, {"w": torch.zeros(2, 3), "i": torch.arange(3)})
    for call in (lambda: client.fetch("nope"), lambda: list(client.fetch_iter("nope")),
                 lambda: list(client.fetch_pieces("nope")), lambda: client.archive("nope")):
        with pytest.raises(tannery.NotFound, match="archive 'nope' not found"):
            call()
    with pytest.raises(tannery.NotFound, match="nope: no entry in the archive"):
        client.fetch(name, names=["w", "nope"])
    with pytest.raises(tannery.NotFound, match="no entry under prefix 'x'"):
        list(client.fetch_iter(name, prefix="x"))
    assert client.fetch(name).names() == ["i", "w"]  # the client goes on working


def test_an_entry_that_changed_since_it_was_described_is_refused_by_the_server_naming_it(client):
    """A RemoteArchive checks asks against its description; after a replace, the server's
    check (before any byte moves) is what refuses them. Described whole when opened
    (``lazy=False``), so every entry is checked against the archive as it was then (a lazy
    one describes each entry when first read: tests/test_lazy_archive.py)."""
    name = fresh()
    client.store(name, {"w": torch.zeros(2, 3), "d": torch.zeros(4), "gone": torch.ones(1)})
    remote = client.archive(name, lazy=False)
    client.store(name, {"w": torch.zeros(3, 2), "d": torch.zeros(4, dtype=torch.float16)}, replace=True)
    with pytest.raises(tannery.ArchiveError, match=r"w: shape \[3, 2\] in the archive, \[2, 3\] asked for"):
        remote.tensor("w", [2, 3], torch.float32)
    with pytest.raises(tannery.ArchiveError, match=r"d: float16 in the archive, float32 asked for"):
        remote.tensor("d", [4], torch.float32)
    with pytest.raises(tannery.NotFound, match=r"gone: no entry in the archive"):
        remote.find("gone")
    with pytest.raises(tannery.ArchiveError, match=r"w: shape \[3, 2\] in the archive, \[2, 3\] asked for"):
        remote.rows("w", 0, 1)


def test_a_stored_name_is_refused_unless_replaced_and_nothing_is_stored(client, connect, shared, calls):
    name = fresh()
    first = {"w": random_tensor("float32", (1000,), 400)}
    stored = client.store(name, first)
    blobs = sorted(p.name for p in (shared.data_dir / "blobs").rglob("*") if p.is_file())
    again = client.store(name, {"w": first["w"].clone()})  # the same content: stored nothing, said so
    assert again.already_stored and again.created == stored.created and not stored.already_stored
    assert sorted(p.name for p in (shared.data_dir / "blobs").rglob("*") if p.is_file()) == blobs
    assert list((shared.data_dir / "tmp").iterdir()) == []
    second = {"w": random_tensor("float32", (1000,), 401), "x": random_tensor("int8", (7,), 402)}
    with pytest.raises(tannery.AlreadyExists, match=f"{name!r} already exists with other content: entry 'w' differs"):
        client.store(name, second)
    assert sorted(p.name for p in (shared.data_dir / "blobs").rglob("*") if p.is_file()) == blobs
    assert list((shared.data_dir / "tmp").iterdir()) == []
    assert same_bits(client.fetch(name).find("w"), first["w"]) and client.fetch(name).names() == ["w"]
    info = client.store(name, second, replace=True)
    assert_took(calls, connect.transport, "Store", name)
    assert info.entries == 2
    fetched = client.fetch(name)
    assert same_bits(fetched.find("w"), second["w"]) and same_bits(fetched.find("x"), second["x"])


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[Any]:
    """A server that takes payloads of 100000 bytes at most."""
    with running_server(tmp_path_factory.mktemp("limited"), max_payload_bytes=100_000) as server:
        yield server


def stored_blobs(server: Any) -> set[str]:
    return {path.name for path in (server.data_dir / "blobs").rglob("*") if path.is_file()}


def test_an_entry_over_the_servers_limit_is_refused_naming_it_and_nothing_is_stored(limited, connect):
    client = connect(limited.target)
    name, base = fresh(), seed()
    before = stored_blobs(limited)
    value = {"a": random_tensor("float32", (10,), base), "big": torch.zeros(30_000),
             "c": random_tensor("float32", (3,), base + 1)}
    with pytest.raises(tannery.ResourceExhausted, match="big.*over the limit of 100000 bytes"):
        client.store(name, value)
    assert name not in [info.name for info in client.list()]
    assert wait_for(lambda: list((limited.data_dir / "tmp").iterdir()) == [])
    assert wait_for(lambda: stored_blobs(limited) == before)  # entry "a" came whole: collected
    client.store(name, {"a": value["a"]})  # the client and the server go on working
    assert same_bits(client.fetch(name).find("a"), value["a"])


# -- a stored blob that changed -------------------------------------------------------------------


def test_a_flipped_bit_in_a_blob_is_data_loss_for_whole_entries_and_rows_and_no_tensor_is_returned(
        client, shared):
    # 3 MiB: blocks 0, 1, 2 of 1 MiB (and a bit of block 3). The bit flipped is in block 1.
    base = seed()
    w = random_tensor("float32", (768, 1024), base)
    other = random_tensor("int16", (100,), base + 1)
    name = fresh()
    client.store(name, {"w": w, "other": other})
    digest = {e.name: e.digest for e in client.describe(name).entries}["w"]
    flip_bit(blob_path(shared, digest), int(1.5 * MiB))
    remote = client.archive(name)
    reads = {"fetch": lambda: client.fetch(name), "fetch w": lambda: client.fetch(name, names=["w"]),
             "tensor": lambda: remote.tensor("w", [768, 1024], torch.float32),
             "rows": lambda: remote.rows("w", 300, 500),
             "cast": lambda: remote.float("w", [768, 1024], torch.float16)}
    for how, read in reads.items():
        with pytest.raises(tannery.DataLoss, match=f"entry 'w'.*{digest}") as caught:
            read()
            pytest.fail(f"{how}: no DataLoss")
        assert caught.value.code == "DATA_LOSS"
    got = []
    with pytest.raises(tannery.DataLoss, match="entry 'w'"):
        for entry, tensor in client.fetch_iter(name, names=["other", "w"]):
            got.append(entry)
    assert got == ["other"]
    # What the flipped block does not cover is served, checked.
    assert same_bits(remote.rows("w", 0, 200), w[:200])
    assert same_bits(remote.rows("w", 600, 768), w[600:])
    assert same_bits(client.fetch(name, names=["other"]).find("other"), other)


# -- tokens and TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Any]:
    """A server with a write token and a read token."""
    with running_server(tmp_path_factory.mktemp("secured"), tokens="writer-token:write,reader-token:read") as server:
        yield server


def test_a_read_token_fetches_on_the_data_paths_but_may_not_store(secured, connect, calls):
    writer = connect(secured.target, token="writer-token")
    name, refused = fresh(), fresh()
    state = unique_state(seed())
    writer.store(name, state)
    assert_took(calls, connect.transport, "Store", name)
    reader = connect(secured.target, token="reader-token")
    fetched = reader.fetch(name)
    assert_took(calls, connect.transport, "Fetch", name)
    assert all(same_bits(fetched.find(k), v) for k, v in state.items())
    assert same_bits(reader.archive(name).rows("embed.weight", 3, 9), state["embed.weight"][3:9])
    with pytest.raises(tannery.PermissionDenied):
        reader.store(refused, {"w": torch.ones(2)})
    with pytest.raises(tannery.PermissionDenied):
        reader.store(name, {"w": torch.ones(2)}, replace=True)
    assert writer.fetch(name).names() == sorted(state)
    for token in (None, "wrong"):
        stranger = connect(secured.target, token=token)
        with pytest.raises(tannery.Unauthenticated):
            stranger.fetch(name)
        with pytest.raises(tannery.Unauthenticated):
            stranger.store(refused, {"w": torch.ones(2)})
    assert refused not in [info.name for info in writer.list()]


def _raw_tls(port: int, context: ssl.SSLContext) -> bytes:
    """What a TLS connection to the data port gets first: the welcome frame, or b"" / an SSL error."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            return tls.recv(4096)


@pytest.fixture(scope="module")
def mutual_tls(tmp_path_factory, pki) -> Iterator[Any]:
    """A server with TLS whose clients must present a certificate of the test CA."""
    with running_server(tmp_path_factory.mktemp("tls"), tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as server:
        yield server


def test_tls_and_mutual_tls_on_the_data_port(mutual_tls, connect, pki, calls):
    mutual = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
    client = connect(mutual_tls.target, tls=mutual)
    name, state = fresh(), unique_state(seed())
    client.store(name, state)
    assert_took(calls, connect.transport, "Store", name)
    fetched = client.fetch(name)
    assert_took(calls, connect.transport, "Fetch", name)
    assert all(same_bits(fetched.find(k), v) for k, v in state.items())
    named = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"], server_name="store.test")
    assert connect(mutual_tls.target, tls=named).fetch(name).names() == sorted(state)
    with pytest.raises(tannery.Unavailable):  # gRPC refuses it first
        connect(mutual_tls.target, tls=tannery.TLS(ca=pki["ca"]), timeout=10).fetch(name)
    # The data port itself refuses a connection without the client's certificate, with a
    # stranger's, or in plaintext: no welcome, so no ticket can be presented.
    port = mutual_tls.data_paths.data_port
    without = ssl.create_default_context(cafile=str(pki["ca"]))
    stranger = ssl.create_default_context(cafile=str(pki["ca"]))
    stranger.load_cert_chain(str(pki["stranger_cert"]), str(pki["stranger_key"]))
    for context in (without, stranger):
        try:
            assert _raw_tls(port, context) == b""
        except (ssl.SSLError, ConnectionError):
            pass
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"\x02\x00\x00\x00\x12\x00")  # a hello frame, in plaintext
        try:
            answer = plain.recv(4096)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or answer[0] == 0x15, answer  # closed, or a TLS alert
    good = ssl.create_default_context(cafile=str(pki["ca"]))
    good.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    assert len(_raw_tls(port, good)) > 4  # the welcome


def test_a_tls_store_refused_while_its_bytes_still_arrive_gets_its_reason_and_the_port_keeps_working(
        mutual_tls, pki, monkeypatch):
    """The server refuses a payload's bytes while its receiving thread still reads the TLS
    connection: the thread is stopped before the failure frame is written, so the client
    reads the reason intact, and the next Store on the port works."""
    from tannery.dataplane import transports
    from tannery_protocol.datalink import expect, frame
    from tannery_protocol.v1.data_pb2 import EntryBytes

    big = serialize(torch.arange(3 << 20, dtype=torch.float32))  # 12 MiB: three receive windows

    def junk_after_a_big_payload(link, entries, progress=None, inline=False):
        link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(big) + (8 << 20))))
        link.send_bytes(big)
        link.send_bytes(bytes(8 << 20))  # read as a second payload's header: bad magic
        expect(link.receive()[0], "end")  # the server's failure frame: PeerFailed with its reason
        raise AssertionError("the server took the junk")

    mutual = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
    with tannery.Client(mutual_tls.target, tls=mutual, transport="tcp", timeout=30) as client:
        with monkeypatch.context() as patch:
            patch.setattr(transports, "send_store", junk_after_a_big_payload)
            with pytest.raises(codec.FormatError, match="entry .w.: bad magic"):
                client.store("junk", {"w": torch.ones(1)})
        state = {"w": torch.arange(3 << 20, dtype=torch.float32)}
        client.store("after-junk", state)
        assert torch.equal(client.fetch("after-junk").find("w"), state["w"])
        assert "junk" not in [info.name for info in client.list()]
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == "tannery-store-receive"])


# -- which path "auto" takes ----------------------------------------------------------------------


def offered(client: Any) -> Any:
    """What the server's DataPaths answers (through the client's own channel)."""
    from tannery_protocol.v1 import archives_pb2

    target = client._target if isinstance(client, Blocking) else client
    if isinstance(target, tannery.aio.Client):
        async def ask() -> Any:
            return await target._methods.data_paths(archives_pb2.DataPathsRequest())

        return client._loop.run(ask())
    return target._methods.data_paths(archives_pb2.DataPathsRequest())


def round_trip(client: Any, calls: CallLog, taken: str) -> None:
    """Store and fetch a small archive, checking the path they took (``taken``)."""
    name = fresh()
    state = unique_state(seed())
    client.store(name, state)
    fetched = client.fetch(name)
    assert all(same_bits(fetched.find(k), v) for k, v in state.items())
    for method in ("Store", "Fetch"):
        record = calls.last(method, name)
        assert record.get("transport", "grpc") == taken, record


def test_with_the_socket_off_auto_takes_the_data_port_and_local_is_unavailable(tmp_path, open_client, calls):
    with running_server(tmp_path, socket="off") as server:
        auto = open_client(server.target, transport="auto")
        assert auto.transport == "tcp"
        round_trip(auto, calls, "tcp")
        assert offered(auto).socket_path == "" and not (server.data_dir / "tannery.sock").exists()
        with pytest.raises(tannery.Unavailable, match=r"'local' is not available: .*--socket is off.*"
                                                      r"transport='auto'") as caught:
            open_client(server.target, transport="local").fetch("anything")
        assert caught.value.code == "UNAVAILABLE"
        round_trip(open_client(server.target, transport="tcp"), calls, "tcp")


def test_with_no_data_path_auto_takes_grpc_and_the_others_are_unavailable(tmp_path, open_client, calls):
    with running_server(tmp_path, socket="off", data_port="off") as server:
        auto = open_client(server.target, transport="auto")
        assert auto.transport == "grpc"
        round_trip(auto, calls, "grpc")
        with pytest.raises(tannery.Unavailable, match=r"'tcp' is not available: .*--data-port is off"):
            open_client(server.target, transport="tcp").store("x", {"w": torch.ones(1)})
        with pytest.raises(tannery.Unavailable, match=r"'local' is not available"):
            open_client(server.target, transport="local").store("x", {"w": torch.ones(1)})
        assert [info.name for info in auto.list()] != ["x"]


def test_a_socket_that_went_away_makes_auto_fall_back_to_the_data_port(tmp_path, open_client, calls):
    with running_server(tmp_path) as server:
        socket_path = server.data_dir / "tannery.sock"
        assert socket_path.is_socket()
        socket_path.unlink()
        auto = open_client(server.target, transport="auto")
        assert auto.transport == "tcp"
        round_trip(auto, calls, "tcp")
        with pytest.raises(tannery.Unavailable, match=f"socket {socket_path} does not answer as this server"):
            open_client(server.target, transport="local").fetch("anything")


#: Run in another mount namespace: stores and fetches through ``tannery.Client(target)`` (the
#: default, ``auto``), then asks for ``local``; prints what it saw as JSON.
_NAMESPACED_CLIENT = """
import json, os, sys
import torch, tannery
target, data_dir = sys.argv[1], sys.argv[2]
seen = {"socket_visible": os.path.exists(os.path.join(data_dir, "tannery.sock"))}
weights = torch.arange(4096, dtype=torch.float32)
with tannery.Client(target) as client:
    client.store("namespaced", {"w": weights})
    seen["transport"] = client.transport
    seen["same"] = bool(torch.equal(client.fetch("namespaced").find("w"), weights))
try:
    with tannery.Client(target, transport="local") as client:
        client.fetch("namespaced")
    seen["local"] = "taken"
except tannery.Unavailable as exc:
    seen["local"] = str(exc)
print(json.dumps(seen))
"""


@functools.cache
def _private_mounts() -> str:
    """Why this process cannot give a child a mount namespace of its own ('' when it can)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as where:
            done = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs",
                                   "tmpfs", where], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare: {exc}"
    return "" if done.returncode == 0 else f"unshare --mount: {done.stderr.strip()}"


def test_a_client_in_another_mount_namespace_takes_the_data_port(tmp_path, calls):
    """A client on the server's host whose mounts differ (a container's): the socket's path
    names nothing there (a tmpfs over the data directory, in a namespace of its own), so
    ``auto`` takes the data port, and ``local`` is refused naming the socket."""
    if _private_mounts():
        pytest.skip(_private_mounts())
    with running_server(tmp_path) as server:
        assert (server.data_dir / "tannery.sock").is_socket()
        run = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs tmpfs "$1" && exec "$2" -c "$3" "$4" "$1"', "sh",
             str(server.data_dir), sys.executable, _NAMESPACED_CLIENT, server.target],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        seen = json.loads(run.stdout)
        assert seen["socket_visible"] is False
        assert seen["transport"] == "tcp" and seen["same"] is True
        assert "'local' is not available" in seen["local"] and "tannery.sock" in seen["local"], seen
        for method in ("Store", "Fetch"):
            assert calls.last(method, "namespaced").get("transport") == "tcp"
        assert (server.data_dir / "tannery.sock").is_socket()  # the server's own mounts are untouched


def test_a_socket_that_went_away_after_it_was_chosen_fails_the_next_calls_at_once(tmp_path, open_client):
    """The path is settled at the first call; one that no longer answers fails the call (the
    server's wait for the connection is cancelled), without waiting for the server."""
    with running_server(tmp_path) as server:
        client = open_client(server.target, transport="auto")
        client.store("m", {"w": torch.ones(3)})
        assert client.transport == "local"
        (server.data_dir / "tannery.sock").unlink()
        for call in (lambda: client.fetch("m"), lambda: client.store("n", {"w": torch.ones(3)})):
            started = time.monotonic()
            with pytest.raises(tannery.Unavailable, match="socket .*tannery.sock"):
                call()
            assert time.monotonic() - started < 3
        assert wait_for(lambda: not server.data_paths._tickets and not server.storage._pins, timeout=3)
        assert [info.name for info in client.list()] == ["m"]


def test_a_socket_that_leads_to_another_server_is_not_taken(tmp_path, open_client, calls):
    """The server's welcome names it: a socket path that reaches another server (another
    host's, a container's, a stale one) is refused before any call uses it."""
    with running_server(tmp_path / "a", socket=str(tmp_path / "a.sock")) as first, \
            running_server(tmp_path / "b", socket=str(tmp_path / "b.sock")) as second:
        (tmp_path / "a.sock").unlink()
        (tmp_path / "a.sock").symlink_to(tmp_path / "b.sock")
        auto = open_client(first.target, transport="auto")
        assert auto.transport == "tcp"
        round_trip(auto, calls, "tcp")
        assert open_client(second.target, transport="auto").transport == "local"
        with pytest.raises(tannery.Unavailable, match="another server answers on the socket"):
            open_client(first.target, transport="local").fetch("anything")


def test_a_socket_path_longer_than_sun_path_works(tmp_path, open_client, calls):
    deep = tmp_path.joinpath(*["d" * 30] * 4)
    path = deep / "tannery-data-path.sock"
    assert len(str(path)) > 108
    with running_server(tmp_path, socket=str(path)) as server:
        assert path.is_socket()
        client = open_client(server.target, transport="local")
        assert offered(client).socket_path == str(path)
        round_trip(client, calls, "local")
    assert not path.exists()  # removed when the server stops


def test_the_socket_path_offered_is_absolute_when_the_server_was_given_a_relative_one(tmp_path, monkeypatch,
                                                                                      open_client, calls):
    """A client in another directory than the server's reaches the socket of a server started
    with a relative --socket or --data-dir (the default, ./tannery-data)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    with running_server(tmp_path, socket="relative.sock") as server:
        monkeypatch.chdir(tmp_path / "elsewhere")
        client = open_client(server.target, transport="local")
        assert offered(client).socket_path == str(tmp_path / "relative.sock")
        round_trip(client, calls, "local")
    monkeypatch.chdir(tmp_path)
    with ServerProcess(Path("relative-data")) as process:  # started here, in tmp_path
        monkeypatch.chdir(tmp_path / "elsewhere")
        client = open_client(process.target, transport="local")
        assert offered(client).socket_path == str(tmp_path / "relative-data" / "tannery.sock")
        client.store("m", {"w": torch.arange(4)})
        assert same_bits(client.fetch("m").find("w"), torch.arange(4))


# -- the server's settings ------------------------------------------------------------------------


def test_socket_and_data_port_settings_come_from_flags_and_the_environment():
    env = {"TANNERY_SOCKET": "off", "TANNERY_DATA_PORT": "6001"}
    config = Config.from_env(env)
    assert (config.socket, config.data_port) == ("off", 6001)
    assert Config.from_env({}).data_port == 0 and Config.from_env({}).socket == ""  # a free port, the socket
    args = build_parser().parse_args(["serve", "--socket", "/run/t.sock", "--data-port", "0"])
    assert Config.from_env(env, socket=args.socket, data_port=args.data_port).socket == "/run/t.sock"
    assert Config.from_env(env, data_port=args.data_port).data_port == 0
    # A free port is auto or 0, none is off or empty: from the flag, the environment or Config alike.
    for text, port in (("auto", 0), ("AUTO", 0), ("0", 0), ("6002", 6002), ("off", None), ("", None)):
        args = build_parser().parse_args(["serve", "--data-port", text])
        assert Config.from_env(env, data_port=args.data_port).data_port == port, text
        assert Config.from_env({"TANNERY_DATA_PORT": text}).data_port == port, text
        assert Config(data_port=text).data_port == port, text
    with pytest.raises(ValueError, match="data_port 70000 is not in 0..65535"):
        Config(data_port=70000)
    with pytest.raises(ValueError, match="TANNERY_DATA_PORT: 'abc' is not a port 1..65535, auto .*, or off"):
        Config.from_env({"TANNERY_DATA_PORT": "abc"})
    with pytest.raises(ValueError, match="data_port 7000 is the gRPC port too"):
        Config(port=7000, data_port=7000)


def read_welcome(link: Any) -> Any:
    from tannery_protocol.datalink import expect

    received, _ = link.receive()
    expect(received, "welcome")
    return received.welcome


def test_the_server_process_listens_where_its_flags_and_environment_say(tmp_path, calls):
    from tannery_protocol.datalink import Link, connect_unix

    for how in ("flags", "env"):
        path, port = tmp_path / f"{how}.sock", free_port()
        settings = {"socket": str(path), "data_port": port}
        if how == "flags":
            process = ServerProcess(tmp_path / how, **settings)
        else:
            process = ServerProcess(tmp_path / how, env={"TANNERY_SOCKET": str(path), "TANNERY_DATA_PORT": str(port)})
        with process:
            with connect_unix(path) as link:
                ids = {read_welcome(link).server_id}
            with Link(socket.create_connection(("127.0.0.1", port), timeout=10), local=False) as link:
                ids.add(read_welcome(link).server_id)
            assert len(ids) == 1, how  # the same server on both
            for transport in ("local", "tcp"):
                with tannery.Client(process.target, transport=transport) as client:
                    client.store(transport, {"w": torch.arange(10)})
                    assert torch.equal(client.fetch(transport).find("w"), torch.arange(10))
                    assert client.transport == transport
            assert process.stop() == 0
        assert not path.exists(), how  # removed by a graceful stop
    # One killed leaves its socket file behind; the next start on that path replaces it.
    with ServerProcess(tmp_path / "flags", socket=str(path)) as process:
        process.kill()
        assert path.is_socket()
        process.start()
        with tannery.Client(process.target, transport="local") as client:
            assert torch.equal(client.fetch("local").find("w"), torch.arange(10))


def test_a_busy_data_port_or_socket_stops_the_start_naming_the_setting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = ServerProcess(tmp_path / "data", data_port=port).command()
        ended = subprocess.run(command, capture_output=True, text=True, timeout=60,
                               env={**os.environ, "TANNERY_METRICS_PORT": "0"})
        assert ended.returncode == 1, ended
        assert f"cannot listen for data connections on 127.0.0.1:{port}" in ended.stderr, ended.stderr
        assert "--data-port" in ended.stderr, ended.stderr
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*--data-port"):
            with running_server(tmp_path / "b", data_port=port):
                pass
    with running_server(tmp_path / "c", socket=str(tmp_path / "c.sock")):
        with pytest.raises(OSError, match="another server answers there.*--socket"):
            with running_server(tmp_path / "d", socket=str(tmp_path / "c.sock")):
                pass
        assert (tmp_path / "c.sock").is_socket()  # the first server's, still there
