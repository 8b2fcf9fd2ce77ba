"""tannery.Client and tannery.aio.Client end to end against the real server on loopback.

Every scenario runs twice, through the synchronous client and through the asyncio one
(its coroutines awaited on an event loop in a background thread by :class:`Blocking`),
so the two stay at parity. Bytes transferred are counted with the ``progress`` hook.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import inspect
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

import tannery
import tannery.aio
from tannery_protocol import codec, wire
from tannery.dataplane import grpc_streams
from tannery.dataplane.readers import EntryReader
from tannery.remote import AsyncRemoteArchive
from tannery.torch import serialize
from tannery_protocol.v1 import archives_pb2

from .server_harness import running_server, wait_for

KiB = 1 << 10
SERVER_CHUNK = 4 * KiB
#: Odd on purpose: payloads and their prefixes split at every kind of place.
CLIENT_CHUNK = 1000


# -- the asyncio client, driven from synchronous tests ------------------------------------------


class LoopThread:
    """An event loop running in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-client-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _wrap(value: Any, loop: LoopThread) -> Any:
    if isinstance(value, AsyncRemoteArchive):
        return Blocking(value, loop)
    if isinstance(value, tannery.aio.AsyncSubscription):
        return BlockingSubscription(value, loop)
    return value


class Blocking:
    """An aio object used like its synchronous twin: each method's coroutine is awaited on the
    loop thread, and archives and subscriptions it returns are wrapped the same way."""

    def __init__(self, target: Any, loop: LoopThread) -> None:
        self._target = target
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            async def run() -> Any:
                result = value(*args, **kwargs)
                return await result if inspect.isawaitable(result) else result

            return _wrap(self._loop.run(run()), self._loop)

        return call

    def __len__(self) -> int:
        return len(self._target)

    def __contains__(self, name: object) -> bool:
        return name in self._target

    def __enter__(self) -> "Blocking":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BlockingSubscription:
    def __init__(self, subscription: tannery.aio.AsyncSubscription, loop: LoopThread) -> None:
        self._subscription = subscription
        self._loop = loop

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        try:
            return self._loop.run(self._subscription.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        async def close() -> None:
            self._subscription.close()

        self._loop.run(close())

    def __enter__(self) -> "BlockingSubscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture(autouse=True)
def no_client_environment(monkeypatch):
    """The clients' defaults come from TANNERY_* variables: none of the caller's apply here."""
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN", "TANNERY_TLS", "TANNERY_TLS_CA", "TANNERY_CLIENT_CERT",
                 "TANNERY_CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["sync", "aio"])
def connect(request):
    """``connect(target, **options)``: a client of the parametrized kind, closed at the end."""
    opened: list[Any] = []
    loop = LoopThread() if request.param == "aio" else None

    def make(target: str, **options: Any) -> Any:
        if loop is None:
            client = tannery.Client(target, **options)
        else:
            async def create() -> tannery.aio.Client:
                return tannery.aio.Client(target, **options)

            client = Blocking(loop.run(create()), loop)
        opened.append(client)
        return client

    make.kind = request.param
    yield make
    for client in opened:
        client.close()
    if loop is not None:
        loop.close()


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path, chunk_size=SERVER_CHUNK) as running:
        yield running


@pytest.fixture
def client(server, connect):
    return connect(server.target, chunk_size=CLIENT_CHUNK)


class Counter:
    """A progress hook: the bytes of each message, added up."""

    def __init__(self) -> None:
        self.calls = 0
        self.total = 0

    def __call__(self, nbytes: int) -> None:
        self.calls += 1
        self.total += nbytes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and serialize(a) == serialize(b)


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (NaNs included for floats), valid booleans for bool."""
    rng = np.random.default_rng(seed)
    numel = int(np.prod(shape))
    if dtype == "bool":
        return torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_)).reshape(shape)
    target = tannery.torch.torch_dtype(dtype)
    itemsize = codec.DTYPES[dtype].itemsize
    raw = torch.from_numpy(rng.integers(0, 256, numel * itemsize, dtype=np.uint8))
    return raw.view(target).reshape(shape) if numel else torch.empty(shape, dtype=target)


def model_state() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": random_tensor("float32", (64, 32), 1),
        "blocks.0.w": random_tensor("bfloat16", (32, 32), 2),
        "blocks.0.b": random_tensor("float16", (32,), 3),
        "blocks.1.mask": random_tensor("bool", (5, 7), 4),
        "steps": torch.tensor(7, dtype=torch.int64),
    }


# -- store and fetch ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(codec.DTYPES))
def test_every_dtype_round_trips_bit_for_bit(client, dtype):
    tensors = {f"{dtype}.{i}": random_tensor(dtype, shape, i)
               for i, shape in enumerate([(), (0,), (3, 0, 2), (1,), (37, 29), (2, 3, 4, 5)])}
    info = client.store("dtypes", tensors)
    assert info.entries == len(tensors)
    fetched = client.fetch("dtypes")
    assert fetched.names() == sorted(tensors)
    for name, tensor in tensors.items():
        assert same_bits(fetched.find(name), tensor), name


def test_store_returns_the_archive_info(client):
    state = model_state()
    before = dt.datetime.now(dt.timezone.utc)
    info = client.store("model", state)
    assert isinstance(info, tannery.ArchiveInfo)
    assert (info.name, info.entries) == ("model", 5)
    assert info.nbytes == sum(t.numel() * t.element_size() for n, t in state.items() if t.dtype != torch.bool) + 5
    assert info.payload_bytes == sum(len(serialize(t)) for t in state.values())
    slack = dt.timedelta(seconds=5)
    assert before - slack <= info.created <= dt.datetime.now(dt.timezone.utc) + slack
    assert client.describe("model").info == info


def test_store_takes_archives_mappings_modules_and_nested_values(client, tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    client.store("module", module)
    assert client.describe("module").info.entries == 4
    assert [e.name for e in client.describe("module")] == ["0.bias", "0.weight", "2.bias", "2.weight"]

    nested = {"model": {"w": torch.ones(2)}, "optim": [torch.zeros(3), {"m": torch.arange(4)}], "epoch": 3}
    client.store("nested", nested, prefix="ckpt", skip_non_tensors=True)  # "epoch" left out, as asked
    assert [e.name for e in client.describe("nested")] == ["ckpt.model.w", "ckpt.optim.0", "ckpt.optim.1.m"]

    tannery.save_safetensors(tmp_path / "a.safetensors", tannery.Archive.of_list({"x": torch.arange(6.0)}))
    client.store("file", tannery.load_safetensors(tmp_path / "a.safetensors"), prefix="p")
    assert client.fetch("file").names() == ["p.x"]
    assert torch.equal(client.fetch("file").find("p.x"), torch.arange(6.0))

    numpy_value = {"a": np.arange(5, dtype=np.int16), "b": np.ones((2, 2), dtype=np.float64)[:, ::-1]}
    client.store("numpy", numpy_value)
    assert torch.equal(client.fetch("numpy").find("a"), torch.arange(5, dtype=torch.int16))


def test_non_contiguous_and_non_cpu_layouts_are_stored_as_their_values(client):
    base = torch.arange(24.0).reshape(4, 6)
    complex_values = torch.randn(3, dtype=torch.complex64)
    client.store("views", {"t": base.t(), "slice": base[:, 1::2], "neg": -base, "conj": complex_values.conj()})
    fetched = client.fetch("views")
    assert torch.equal(fetched.find("conj"), complex_values.conj().resolve_conj())
    assert torch.equal(fetched.find("t"), base.t())
    assert torch.equal(fetched.find("slice"), base[:, 1::2])
    assert torch.equal(fetched.find("neg"), -base)


def test_a_stored_name_is_refused_unless_replaced(client):
    client.store("a", {"w": torch.zeros(2)})
    with pytest.raises(tannery.AlreadyExists, match=r"archive 'a' already exists with other content: entry 'w' "
                                                    r"differs \(sha256 [0-9a-f]{16}\.\.\. there, [0-9a-f]{16}\.\.\. "
                                                    r"sent\) \(give replace=True to replace it\)"):
        client.store("a", {"w": torch.ones(2)})
    assert torch.equal(client.fetch("a").find("w"), torch.zeros(2))
    client.store("a", {"w": torch.ones(2)}, replace=True)
    assert torch.equal(client.fetch("a").find("w"), torch.ones(2))


def test_the_same_store_again_returns_the_archive_already_stored_and_stores_nothing(client, server):
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.float16)}
    first = client.store("ckpt", state, metadata={"format": "pt"})
    assert first.already_stored is False
    files = blob_files(server)
    again = client.store("ckpt", {"b": state["b"].clone(), "w": state["w"].clone()}, metadata={"format": "pt"})
    assert again.already_stored is True
    assert again == dataclasses.replace(first, already_stored=True)
    assert blob_files(server) == files
    assert list((server.data_dir / "tmp").iterdir()) == []
    fetched = client.fetch("ckpt")
    assert torch.equal(fetched.find("w"), state["w"]) and torch.equal(fetched.find("b"), state["b"])
    with pytest.raises(tannery.AlreadyExists, match=r"entry 'b' differs \(float16 \[3\] there, float32 \[3\] sent\)"):
        client.store("ckpt", {**state, "b": torch.ones(3)}, metadata={"format": "pt"})
    with pytest.raises(tannery.AlreadyExists, match=r"entry 'x' sent is not there \(it has 2 entries\)"):
        client.store("ckpt", {**state, "x": torch.ones(1)}, metadata={"format": "pt"})
    with pytest.raises(tannery.AlreadyExists, match=r"entry 'w' is missing \(2 entries there, 1 sent\)"):
        client.store("ckpt", {"b": state["b"]}, metadata={"format": "pt"})
    with pytest.raises(tannery.AlreadyExists, match=r"metadata key 'format' is missing \(1 key there, 0 sent\)"):
        client.store("ckpt", state)
    assert blob_files(server) == files
    assert list((server.data_dir / "tmp").iterdir()) == []
    assert client.store("ckpt", state, replace=True).already_stored is False


def test_store_refuses_values_that_are_not_tensors_before_calling(client, server):
    with pytest.raises(TypeError, match="a int is not something to store"):
        client.store("x", 3)
    with pytest.raises(TypeError, match="c: torch.float8_e4m3fnuz has no tannic dcode"):
        client.store("x", {"w": torch.ones(1), "c": torch.zeros(2, dtype=torch.float8_e4m3fnuz)})
    with pytest.raises(ValueError, match="a leaf at the root has no name"):
        client.store("x", torch.ones(2))
    with pytest.raises(tannery.InvalidArgument, match="Client.store: the archive's name is a non-empty str, not ''"):
        client.store("", {"w": torch.ones(1)})
    assert client.list() == []


def test_store_keeps_plain_values_and_refuses_any_other_leaf_naming_its_path(client):
    """Nothing vanishes: plain values (a step, None, a str) are kept beside the tensors; any
    other leaf is refused before the call, named by its path, and skip_non_tensors=True stores
    the tensors alone."""
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2), "step": 5}}}}
    with pytest.raises(TypeError) as e:
        client.store("x1", {**state, "hook": print})
    assert str(e.value).startswith("Client.store('x1'): hook is a builtin_function_or_method, neither a tensor "
                                   "nor a plain value ")
    assert "skip_non_tensors=True" in str(e.value)
    with pytest.raises(TypeError, match=r"^Client.store\('x2'\): ckpt.m.1: a key \(1, 2\) of type tuple; "):
        client.store("x2", {"m": [torch.ones(1), {(1, 2): 3}]}, prefix="ckpt")
    assert client.list() == []
    assert client.store("x1", state, skip_non_tensors=True).entries == 1
    assert client.fetch("x1").names() == ["optimizer.state.0.exp_avg"]
    back = client.archive("x1").to_value()  # tensors alone keep no structure: the entries by name
    assert list(back) == ["optimizer.state.0.exp_avg"] and torch.equal(back["optimizer.state.0.exp_avg"], torch.ones(2))
    assert client.store("x3", {"m": [torch.ones(1), None], "a": "text"}, prefix="ckpt").entries == 2  # and @values
    assert client.fetch("x3").names() == ["ckpt.m.0"]
    assert client.fetch("x3").to_value(prefix="ckpt")["a"] == "text"  # a fetch keeps the plain values too
    back = client.archive("x3").to_value(prefix="ckpt")
    assert back["a"] == "text" and back["m"][1] is None and torch.equal(back["m"][0], torch.ones(1))


def test_store_refuses_an_empty_archive_unless_allowed(client):
    for value in ({}, [], {"a": []}, tannery.Archive.of_list([])):
        with pytest.raises(tannery.ArchiveError) as e:
            client.store("x3", value)
        assert str(e.value) == ("Client.store('x3'): the value holds no tensors, so the archive would be empty; "
                                "give allow_empty=True to store an empty archive")
    with pytest.raises(tannery.ArchiveError, match="would be empty"):
        client.store("x3", {"a": "notatensor"}, skip_non_tensors=True)
    assert client.list() == []
    assert client.store("x3", {}, allow_empty=True).entries == 0
    assert client.fetch("x3").names() == []


def test_progress_counts_every_byte_sent_and_received(client):
    state = model_state()
    sent, received = Counter(), Counter()
    info = client.store("model", state, progress=sent)
    assert sent.total == info.payload_bytes
    assert sent.calls >= info.payload_bytes // CLIENT_CHUNK
    client.fetch("model", progress=received)
    assert received.total == info.payload_bytes


def test_fetch_by_names_by_prefix_or_all(client):
    state = model_state()
    client.store("model", state)
    picked = client.fetch("model", names=["steps", "blocks.0.w"])
    assert picked.names() == ["blocks.0.w", "steps"]
    assert same_bits(picked.find("blocks.0.w"), state["blocks.0.w"])
    assert client.fetch("model", prefix="blocks.0").names() == ["blocks.0.b", "blocks.0.w"]
    assert client.fetch("model").names() == sorted(state)
    with pytest.raises(tannery.NotFound, match="nope: no entry in the archive"):
        client.fetch("model", names=["steps", "nope"])
    with pytest.raises(tannery.NotFound, match="no entry under prefix 'blocks.9'"):
        client.fetch("model", prefix="blocks.9")
    with pytest.raises(ValueError, match="names or a prefix, not both"):
        client.fetch("model", names=["steps"], prefix="blocks")


# -- RemoteArchive ------------------------------------------------------------------------------


def test_remote_archive_reads_like_a_local_one(client):
    state = model_state()
    client.store("model", state)
    remote = client.archive("model")
    local = tannery.Archive.of_list(state)
    assert remote.names() == local.names() and len(remote) == 5 and "steps" in remote and "nope" not in remote
    for name in state:
        # As stored: booleans are bit-packed in payloads (one byte each in memory).
        assert (remote.info(name).dtype, remote.info(name).shape) == (local.info(name).dtype, local.info(name).shape)
        assert remote.info(name).nbytes == codec.DTYPES[local.info(name).dtype].buffer_nbytes(state[name].numel())
        assert same_bits(remote.find(name), state[name])
        assert same_bits(remote.tensor(name, state[name].shape, state[name].dtype), state[name])
    assert remote.find("nope") is None
    assert remote.entry("steps").digest == hashlib.sha256(serialize(state["steps"])).hexdigest()


def test_remote_float_casts_on_the_server_like_torch(client):
    values = torch.tensor([1.0, -2.5, 3.14159265358979, 1e-8, 1e30, float("inf"), float("nan")], dtype=torch.float64)
    client.store("f", {"x": values})
    remote = client.archive("f")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        received = Counter()
        remote = client.archive("f", progress=received)
        cast = remote.float("x", [7], dtype)
        assert same_bits(cast, values.to(dtype)), dtype
        # Cast on the server: the smaller dtype travels, not the float64 entry.
        assert received.total == len(serialize(values.to(dtype)))
    assert same_bits(remote.float("x", [7], torch.float64), values)


def test_remote_rows_transfer_only_those_rows(client):
    table = random_tensor("float32", (100, 16), 5)
    flags = random_tensor("bool", (50, 3), 6)
    client.store("t", {"table": table, "flags": flags})
    received = Counter()
    remote = client.archive("t", progress=received)
    assert same_bits(remote.rows("table", 10, 13), table[10:13])
    assert received.total == len(serialize(table[10:13]))
    assert same_bits(remote.rows("flags", 7, 20), flags[7:20])
    assert remote.rows("table", 5, 5).shape == (0, 16)
    with pytest.raises(tannery.ArchiveError, match=r"Archive.rows: table: rows \[90, 101\) asked for, 100 rows"):
        remote.rows("table", 90, 101)
    with pytest.raises(ValueError, match=r"rows \[5, 4\) is not a range"):
        remote.rows("table", 5, 4)
    with pytest.raises(tannery.ArchiveError, match="Archive.rows: nope: no entry in the archive"):
        remote.rows("nope", 0, 1)


def test_remote_to_value_transfers_only_the_asked_entries_in_one_call(client, server):
    state = model_state()
    state["big.unused"] = torch.zeros(100_000)
    client.store("model", state)
    received = Counter()
    remote = client.archive("model", progress=received)
    like = {"w": torch.empty(32, 32, dtype=torch.bfloat16), "b": torch.empty(32, dtype=torch.float16)}
    value = remote.to_value(like, prefix="blocks.0")
    assert same_bits(value["w"], state["blocks.0.w"]) and same_bits(value["b"], state["blocks.0.b"])
    described = {e.name: e for e in remote.description}
    assert received.total == described["blocks.0.w"].payload_bytes + described["blocks.0.b"].payload_bytes
    # Structure, non-tensor leaves and the meta device are kept, as locally.
    value = remote.to_value({"unused": torch.empty(100_000, device="meta"), "note": "x"}, prefix="big")
    assert value["note"] == "x" and torch.equal(value["unused"], torch.zeros(100_000))


def test_remote_errors_are_the_local_messages_and_nothing_is_transferred(client):
    client.store("m", {"w": torch.zeros(2, 3), "i": torch.arange(3)})
    received = Counter()
    remote = client.archive("m", progress=received)
    with pytest.raises(tannery.ArchiveError) as caught:
        remote.tensor("w", [3, 2], torch.float32)
    assert str(caught.value) == "Archive.tensor: w: shape [2, 3] in the archive, [3, 2] asked for"
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.tensor: w: float32 in the archive, float16 asked for$"):
        remote.tensor("w", [2, 3], torch.float16)
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.tensor: x: no entry in the archive$"):
        remote.tensor("x", [1], torch.float32)
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.float: i: int64 in the archive, not float16"):
        remote.float("i", [3], torch.float32)
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.to_value: i: an entry in the archive, no leaf"):
        remote.to_value({"w": torch.empty(2, 3)})
    with pytest.raises(tannery.ArchiveError, match=r"^Archive.to_value: w: shape \[2, 3\] in the archive, \[2\] in"):
        remote.to_value({"w": torch.empty(2), "i": torch.empty(3, dtype=torch.int64)})
    assert received.total == 0
    local = tannery.Archive.of_list({"w": torch.zeros(2, 3)})
    with pytest.raises(tannery.ArchiveError) as local_caught:
        local.tensor("w", [3, 2], torch.float32)
    assert str(local_caught.value) == str(caught.value)


def test_a_remote_archive_replaced_after_it_was_opened_is_refused_not_misread(client):
    client.store("m", {"w": torch.zeros(2, 3)})
    remote = client.archive("m")
    client.store("m", {"w": torch.zeros(3, 2)}, replace=True)
    with pytest.raises(tannery.ArchiveError, match=r"w: shape \[3, 2\] in the archive, \[2, 3\] asked for"):
        remote.tensor("w", [2, 3], torch.float32)
    client.delete("m")
    with pytest.raises(tannery.NotFound, match="archive 'm' not found"):
        remote.find("w")


def test_the_call_table_has_every_rpc_of_both_services_and_the_hand_written_codecs():
    from tannery.rpc.requests import Methods
    from tannery_protocol.v1 import channels_pb2

    class Recording:
        def __getattr__(self, kind):
            return lambda path, **options: (kind, path, options)

    methods = vars(Methods(Recording()))
    expected = {}
    for module, service in ((archives_pb2, "Archives"), (channels_pb2, "Channels")):
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            snake = "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(method.name))
            expected[snake] = f"/tannery.v1.{service}/{method.name}"
    assert {name: path for name, (_, path, _) in methods.items()} == expected
    assert methods["store"][0] == methods["publish"][0] == "stream_unary"
    assert methods["fetch"][0] == methods["subscribe"][0] == "unary_stream"
    assert methods["fetch"][2]["response_deserializer"] is wire.parse_fetch_response
    assert methods["subscribe"][2]["response_deserializer"] is wire.parse_subscribe_response
    assert methods["store"][2]["request_serializer"](b"as encoded") == b"as encoded"
    assert methods["describe"][2]["response_deserializer"] == archives_pb2.ArchiveDescription.FromString


# -- catalog calls ------------------------------------------------------------------------------


def test_describe_gives_every_entry(client):
    state = model_state()
    client.store("model", state)
    description = client.describe("model")
    assert [e.name for e in description] == sorted(state) and len(description) == 5
    for entry in description:
        tensor = state[entry.name]
        assert (entry.dtype, entry.shape) == (tannery.torch.short_name(tensor.dtype), tuple(tensor.shape))
        assert entry.payload_bytes == len(serialize(tensor))
        assert entry.digest == hashlib.sha256(serialize(tensor)).hexdigest()
    assert description.entries[0].info == tannery.TensorInfo("float16", (32,), 64)


def blob_files(server) -> dict[str, tuple[int, int, int]]:
    """Every file under the server's ``blobs/`` and ``tmp/``: its path and (inode, size, mtime)."""
    files = {}
    for top in ("blobs", "tmp"):
        for path in (server.data_dir / top).rglob("*"):
            if path.is_file():
                stat = path.stat()
                files[str(path.relative_to(server.data_dir))] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return files


def test_union_of_a_mapping_or_a_list_copies_no_bytes(client, server, caplog):
    caplog.set_level(logging.INFO, logger="tannery_server.calls")
    payload = 64 * KiB  # each payload is far larger than a Union's messages
    client.store("model", {"w": torch.ones(payload // 4)})
    client.store("optim", {"m": torch.zeros(payload // 4)})
    stored = blob_files(server)
    assert len(stored) == 2 and all(size > payload for _, size, _ in stored.values())
    totals = server.storage.catalog.totals()
    caplog.clear()
    info = client.union("ckpt", {"model": "model", "optim": "optim"})
    assert (info.name, info.entries) == ("ckpt", 2)
    assert client.fetch("ckpt").names() == ["model.w", "optim.m"]
    assert client.union("flat", ["model", "optim"]).entries == 2
    assert client.fetch("flat").names() == ["m", "w"]
    with pytest.raises(tannery.AlreadyExists, match="entry 'm' is missing"):
        client.union("flat", ["model"])
    again = client.union("flat", ["optim", "model"])
    assert again.already_stored and again.entries == 2 and not info.already_stored
    assert client.union("flat", ["model"], replace=True).entries == 1
    with pytest.raises(tannery.NotFound, match="nope"):
        client.union("x", ["model", "nope"])
    with pytest.raises(tannery.InvalidArgument, match="'w' is in two"):
        client.union("x", ["model", "model"])
    # No payload byte was copied: the blobs are the very files the stores wrote, untouched,
    # and nothing was written beside them; the new archives only refer to them.
    assert blob_files(server) == stored
    after = server.storage.catalog.totals()
    assert (after.blobs, after.blob_bytes) == (totals.blobs, totals.blob_bytes)
    digests = {e.name: e.digest for name in ("model", "optim") for e in client.describe(name)}
    assert {e.name: e.digest for e in client.describe("ckpt")} == {"model.w": digests["w"], "optim.m": digests["m"]}
    # Nor sent: the unions' messages are small, and no Store or Fetch carried a payload for them.
    calls = [r.fields for r in caplog.records if r.name == "tannery_server.calls"]
    unions = [c for c in calls if c["method"] == "Union"]
    assert len(unions) == 7 and all(c["bytes"] < 1 * KiB for c in unions), unions
    assert [c for c in calls if c["method"] not in ("Union", "Fetch", "Describe")] == []  # no Store


def test_list_follows_every_page(client):
    client.store("base", {"w": torch.ones(1)})
    names = ["base"] + [f"run-{i:03d}" for i in range(120)]  # the server's pages hold 100
    for name in names[1:]:
        client.union(name, ["base"])
    listed = client.list()
    assert [info.name for info in listed] == names
    assert all(isinstance(info, tannery.ArchiveInfo) and info.entries == 1 for info in listed)
    assert [info.name for info in client.list("run-11")] == [f"run-11{i}" for i in range(10)]
    assert client.list("zzz") == []


def test_delete_removes_the_archive_and_says_what_it_freed(client):
    large = torch.ones(300_000)  # over 1 MiB: a blob of its own, stored once for both (docs/packs.md)
    client.store("a", {"w": large})
    client.store("b", {"w": large, "v": torch.zeros(10)})
    deleted = client.delete("a")
    assert deleted.archive.name == "a" and deleted.blobs_removed == 0  # "w" is still b's
    deleted = client.delete("b")
    assert deleted.blobs_removed == 2
    assert deleted.bytes_freed == len(serialize(large)) + len(serialize(torch.zeros(10)))
    with pytest.raises(tannery.NotFound, match="archive 'a' not found"):
        client.delete("a")
    assert client.list() == []


# -- load_state_dict ----------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(16, 2)


def test_load_state_dict_fills_a_module_under_a_prefix(client):
    source = Net()
    with torch.no_grad():
        source.norm.running_mean.uniform_()
    client.store("ckpt", {"model": source.state_dict(), "optim": {"lr": torch.tensor(0.1)}})
    target = Net()
    received = Counter()
    result = client.load_state_dict(target, "ckpt", prefix="model", progress=received)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, tensor in source.state_dict().items():
        assert same_bits(target.state_dict()[name], tensor), name
    described = client.describe("ckpt")
    assert received.total == sum(e.payload_bytes for e in described if e.name.startswith("model."))


def test_load_state_dict_is_strict_like_torch_and_checks_before_fetching(client):
    source = Net()
    state = {k: v for k, v in source.state_dict().items() if k != "head.bias"}
    state["extra"] = torch.zeros(1)
    client.store("ckpt", state)
    target = Net()
    received = Counter()
    message = r"no entries for the module's keys 'head.bias'; entries the module has no key for: 'extra'"
    with pytest.raises(tannery.ArchiveError, match=message):
        client.load_state_dict(target, "ckpt", progress=received)
    assert received.total == 0
    result = client.load_state_dict(target, "ckpt", strict=False, progress=received)
    assert result.missing_keys == ["head.bias"] and result.unexpected_keys == ["extra"]
    assert torch.equal(target.head.weight, source.head.weight)
    client.store("bad", {**source.state_dict(), "head.weight": torch.zeros(3, 16)})
    message = r"head.weight: shape \[3, 16\] in the archive, \[2, 16\] in the module"
    with pytest.raises(tannery.ArchiveError, match=message):
        client.load_state_dict(Net(), "bad", strict=False)
    with pytest.raises(tannery.NotFound):
        client.load_state_dict(Net(), "nope")


# -- channels -----------------------------------------------------------------------------------


def test_publish_and_subscribe_relay_tensors_in_order_bit_for_bit(client):
    tensors = [random_tensor(dtype, shape, i) for i, (dtype, shape) in enumerate(
        [("float32", (3,)), ("bool", (9, 9)), ("bfloat16", (300, 7)), ("int64", ()), ("complex128", (0, 4))])]
    tensors.append(np.arange(12, dtype=np.uint16).reshape(3, 4))
    with client.subscribe("frames") as frames:  # registered once it returns
        published = client.publish("frames", iter(tensors))
        received = [next(frames) for _ in tensors]
    assert published.payloads == len(tensors) and published.dropped_subscribers == 0
    assert published.nbytes == sum(len(serialize(tannery.archive.as_tensor(t, "", ""))) for t in tensors)
    for got, sent in zip(received, tensors):
        assert same_bits(got, tannery.archive.as_tensor(sent, "", ""))


def test_closing_a_subscription_ends_it(client, server):
    frames = client.subscribe("c")
    assert server.hub.subscribers == 1  # registered once subscribe returns
    client.publish("c", [torch.ones(2)])
    assert torch.equal(next(frames), torch.ones(2))
    frames.close()
    assert list(frames) == []
    # Ended on the server too: its call is over and the hub holds no subscription for it.
    assert wait_for(lambda: server.hub.subscribers == 0), f"{server.hub.subscribers} subscription left on the server"
    assert "c" not in server.hub.channels
    published = client.publish("c", [torch.ones(2)])
    assert published.payloads == 1 and published.dropped_subscribers == 0
    assert server.hub.dropped_subscribers == 0  # it left; it was not dropped for falling behind


def test_publish_progress_and_an_empty_publish(client):
    sent = Counter()
    with client.subscribe("c") as frames:
        result = client.publish("c", [torch.zeros(1000)], progress=sent)
        assert sent.total == result.nbytes == len(serialize(torch.zeros(1000)))
        assert torch.equal(next(frames), torch.zeros(1000))
    assert client.publish("c", []).payloads == 0


def test_a_bad_tensor_in_a_publish_raises_its_own_error(client):
    with pytest.raises(TypeError, match=r"for one tensor t, give \[t\]"):
        client.publish("c", torch.ones(3))  # not three payloads of its rows
    with client.subscribe("c") as frames:
        with pytest.raises(TypeError, match="Client.publish: tensor 1: str is not a tensor"):
            client.publish("c", [torch.ones(1), "nope"])
        client.publish("c", [torch.full((2,), 5.0)])
        got = next(frames)
        if torch.equal(got, torch.ones(1)):  # sent whole before the call was cancelled: relayed
            got = next(frames)
    assert torch.equal(got, torch.full((2,), 5.0))


def test_bad_channel_names_are_refused_when_subscribing(client):
    with pytest.raises(tannery.InvalidArgument, match="channel name is empty"):
        client.subscribe("")
    with pytest.raises(tannery.InvalidArgument, match="control character"):
        client.publish("a\nb", [torch.ones(1)])


# -- error mapping ------------------------------------------------------------------------------


def test_a_missing_archive_is_not_found_and_a_lookup_error(client):
    for call in (lambda: client.archive("nope"), lambda: client.describe("nope"), lambda: client.fetch("nope"),
                 lambda: client.delete("nope")):
        with pytest.raises(tannery.NotFound, match="archive 'nope' not found") as caught:
            call()
        assert isinstance(caught.value, LookupError) and not isinstance(caught.value, grpc.RpcError)
        assert caught.value.code == "NOT_FOUND"


def test_bad_names_are_invalid_arguments(client):
    # An empty name is refused by the client itself (the request could not carry it), a name
    # with a control character or a '..' segment by the server: the same exception either way.
    for name in ("", "bad\x01name", "a/../b"):
        with pytest.raises(tannery.InvalidArgument) as caught:
            client.store(name, {"w": torch.ones(1)})
        assert isinstance(caught.value, ValueError) and "name" in str(caught.value)
    assert client.list() == []


def test_a_payload_over_the_servers_limit_is_resource_exhausted(tmp_path, connect):
    with running_server(tmp_path, max_payload_bytes=1000) as small:
        client = connect(small.target)
        with pytest.raises(tannery.ResourceExhausted, match="over the limit of 1000 bytes"):
            client.store("big", {"w": torch.zeros(1000)})
        assert client.list() == []


def test_a_corrupted_blob_is_data_loss(client, server):
    client.store("m", {"w": torch.arange(10_000.0)})
    digest = client.describe("m").entries[0].digest
    path = server.data_dir / "blobs" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(tannery.DataLoss, match="w"):
        client.fetch("m")


def test_an_unreachable_server_is_unavailable(connect):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = connect(f"127.0.0.1:{port}", timeout=10)
    with pytest.raises(tannery.Unavailable, match=f"127.0.0.1:{port}"):
        client.list()


def test_a_malformed_payload_is_a_format_error(client, server):
    """The server's refusal of a malformed payload, through the client's own Store plumbing
    (the public API cannot produce one)."""
    bad = bytearray(serialize(torch.ones(4)))
    bad[0] ^= 0xFF  # the magic
    messages = [wire.encode_store_request(begin=archives_pb2.StoreBegin(archive="x").SerializeToString()),
                wire.encode_store_request(entry="w", parts=[bytes(bad)])]
    target = client._target if isinstance(client, Blocking) else client
    with pytest.raises(tannery.FormatError, match="entry 'w': bad magic") as caught:
        if isinstance(target, tannery.aio.Client):
            client._loop.run(grpc_streams.aio_send(target._methods.store, messages, {}, target.target))
        else:
            grpc_streams.send(target._methods.store, messages, {}, target.target)
    assert caught.value.code == "INVALID_ARGUMENT"


def test_a_fetch_stream_that_breaks_a_payload_is_a_format_error():
    """What the client does with a stream it cannot read (the server never sends one)."""
    payload = serialize(torch.arange(10))
    reader = EntryReader()
    reader.feed(wire.FetchMessage("a", memoryview(payload[:50])))
    with pytest.raises(tannery.FormatError, match=r"entry 'a': stream ended inside a payload: 50 of 121 bytes"):
        reader.feed(wire.FetchMessage("b", memoryview(payload)))
    reader = EntryReader()
    with pytest.raises(tannery.FormatError, match="entry 'a': bad magic"):
        reader.feed(wire.FetchMessage("a", memoryview(b"\0" * 40)))
    reader = EntryReader()
    reader.feed(wire.FetchMessage("a", memoryview(payload)))
    with pytest.raises(tannery.FormatError, match="entry 'a': a second payload"):
        reader.feed(wire.FetchMessage("", memoryview(payload)))


def test_tokens_are_sent_and_refusals_mapped(tmp_path, connect):
    with running_server(tmp_path, tokens="writer-token:write,reader-token:read") as secured:
        with pytest.raises(tannery.Unauthenticated):
            connect(secured.target).list()
        writer = connect(secured.target, token="writer-token")
        writer.store("m", {"w": torch.ones(2)})
        reader = connect(secured.target, token="reader-token")
        assert torch.equal(reader.archive("m").tensor("w", [2], torch.float32), torch.ones(2))
        with pytest.raises(tannery.PermissionDenied):
            reader.store("n", {"w": torch.ones(2)})
        with pytest.raises(tannery.PermissionDenied):
            reader.delete("m")
        with pytest.raises(tannery.Unauthenticated):
            connect(secured.target, token="wrong").describe("m")


def test_a_failing_source_raises_its_own_error_and_stores_nothing(client):
    class Failing(tannery.archive.MemoryArchive):
        def _fetch(self, names):
            if names == ["b"]:
                raise RuntimeError("the disk went away while reading b")
            return super()._fetch(names)

    source = Failing({"a": torch.zeros(5000), "b": torch.ones(5000)})
    with pytest.raises(RuntimeError, match="the disk went away while reading b"):
        client.store("m", source)
    assert client.list() == []


# -- TLS ------------------------------------------------------------------------------------------

from .test_security import pki  # noqa: E402,F401  (the test CA, server and client certificates)


def test_tls_and_mutual_tls(tmp_path, connect, pki, monkeypatch):
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tls_client_ca=pki["ca"]) as secured:
        mutual = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
        client = connect(secured.target, tls=mutual)
        client.store("m", {"w": torch.arange(3.0)})
        assert torch.equal(client.archive("m").tensor("w", [3], torch.float32), torch.arange(3.0))
        named = tannery.TLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"], server_name="store.test")
        assert [i.name for i in connect(f"127.0.0.1:{secured.port}", tls=named).list()] == ["m"]
        for refused in (tannery.TLS(ca=pki["ca"]),  # no client certificate
                        tannery.TLS(ca=pki["stranger_ca"], cert=pki["client_cert"], key=pki["client_key"]),
                        False):  # plaintext
            with pytest.raises(tannery.Unavailable):
                connect(secured.target, tls=refused, timeout=10).list()
        # TANNERY_TLS_* are the defaults, and tls=False overrides them.
        monkeypatch.setenv("TANNERY_TLS_CA", str(pki["ca"]))
        monkeypatch.setenv("TANNERY_CLIENT_CERT", str(pki["client_cert"]))
        monkeypatch.setenv("TANNERY_CLIENT_KEY", str(pki["client_key"]))
        assert len(connect(secured.target).list()) == 1
        with pytest.raises(tannery.Unavailable):
            connect(secured.target, tls=False, timeout=10).list()
        monkeypatch.setenv("TANNERY_TARGET", secured.target)
        assert len(connect(None).list()) == 1


def test_bad_tls_settings_are_named(tmp_path, connect):
    with pytest.raises(ValueError, match="a client certificate needs its key"):
        tannery.TLS(cert=tmp_path / "c.pem")
    with pytest.raises(OSError, match="TLS ca file '.*missing.pem'"):
        connect("127.0.0.1:1", tls=tannery.TLS(ca=tmp_path / "missing.pem"))
    with pytest.raises(TypeError, match="tls is None, a bool or a tannery.TLS"):
        connect("127.0.0.1:1", tls="yes")
    with pytest.raises(ValueError, match="chunk_size 0 is not in"):
        connect("127.0.0.1:1", chunk_size=0)


def test_the_servers_certificate_variables_do_not_become_the_clients():
    """The server reads TANNERY_TLS_CERT/KEY as its own certificate; a client in the same
    shell must not present it (the client's are TANNERY_CLIENT_CERT/KEY)."""
    from tannery.rpc.connection import Connection

    server_env = {"TANNERY_TLS_CERT": "server.pem", "TANNERY_TLS_KEY": "server.key"}
    assert Connection(env=server_env).tls is None
    client_env = {"TANNERY_TLS_CA": "ca.pem", "TANNERY_CLIENT_CERT": "c.pem", "TANNERY_CLIENT_KEY": "c.key"}
    tls = Connection(env={**server_env, **client_env}).tls
    assert (tls.ca, tls.cert, tls.key) == ("ca.pem", "c.pem", "c.key")


def test_a_dns_target_spreads_calls_over_every_address_round_robin():
    from tannery.rpc.connection import Connection

    assert ("grpc.lb_policy_name", "round_robin") in Connection("dns:///tannery.internal:50051").options()
    assert not any(key == "grpc.lb_policy_name" for key, _ in Connection("127.0.0.1:50051").options())


def test_store_entries_give_each_payloads_sha256_when_asked():
    from tannery.dataplane.messages import store_entries, store_messages

    tensors = {"b": torch.arange(10, dtype=torch.int16), "a": torch.randn(3, 4), "c": torch.tensor(True)}
    archive = tannery.Archive.of_value(tensors)
    hashed = list(store_entries(archive, "p", digests=True))
    assert [name for name, _, _ in hashed] == ["p.a", "p.b", "p.c"]
    for name, parts, sha256 in hashed:
        assert sha256 == hashlib.sha256(serialize(tensors[name[2:]])).digest()
    assert all(sha256 == b"" for _, _, sha256 in store_entries(archive, "p"))
    messages = [wire.parse_store_request(m) for m in store_messages("x", archive, "", False, 16, digests=True)]
    firsts = [m for m in messages if m.entry]
    assert [m.sha256 for m in firsts] == [hashlib.sha256(serialize(tensors[m.entry])).digest() for m in firsts]
    assert all(not m.sha256 for m in messages if not m.entry)  # only with the entry's name
