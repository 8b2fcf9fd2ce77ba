"""Streaming fetches (``Client.fetch_iter``, ``Client.fetch_pieces`` and their asyncio twins) and
``tannery pull`` writing while it receives: order, progress, early exits, failures midway, and
the puller's memory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import tannery
import tannery.aio
from tannery_protocol import wire
from tannery import load_tannic
from tannery.dataplane.readers import PieceReader
from tannery.cli import main
from tannery.cli.checkpoint_writer import CheckpointWriter
from tannery.cli.errors import CommandError

from tannery.torch import buffer_of, serialize

from .server_harness import running_server

MiB = 1 << 20
#: Entries of several dtypes and shapes (a boolean, a scalar, an empty tensor among them).
STATE = {
    "b.mask": torch.arange(101) % 3 == 1,  # 13 bytes bit-packed, split across pieces
    "a.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "a.bias": torch.arange(6, dtype=torch.float16),
    "c.ids": torch.arange(-5, 200_000, dtype=torch.int64),  # 1.6 MB: a blob of its own (the others share a pack)
    "c.scale": torch.tensor(2.5, dtype=torch.float64),
    "c.empty": torch.zeros(0, 3),
    "d.bytes": torch.arange(7, dtype=torch.uint8),
}


@pytest.fixture
def srv(tmp_path):
    with running_server(tmp_path, chunk_size=4096) as server:
        with tannery.Client(server.target) as client:
            client.store("m", STATE)
        yield server


@pytest.fixture
def one_message_batches(monkeypatch):
    """The server reads one message per trip to its worker threads, so that a failure on a
    later entry comes after the earlier ones were sent (not in the first batch)."""
    import tannery_server.dataplane.fetch

    monkeypatch.setattr(tannery_server.dataplane.fetch, "FETCH_BATCH_BYTES", 1)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def wait_unpinned(server, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while server.storage._pins and time.monotonic() < deadline:
        time.sleep(0.01)
    return not server.storage._pins


def blob_path(server, archive: str, entry: str) -> Path:
    return server.storage.blobs.path(server.storage.catalog.entries(archive, [entry])[entry].blob)


# -- Client.fetch_iter -----------------------------------------------------------------------


def test_fetch_iter_yields_entries_in_order_as_fetch_returns_them(srv):
    with tannery.Client(srv.target) as client:
        got = list(client.fetch_iter("m"))
        assert [name for name, _ in got] == sorted(STATE)
        assert all(same(tensor, STATE[name]) for name, tensor in got)
        asked = ["c.ids", "a.weight", "b.mask"]
        assert [name for name, _ in client.fetch_iter("m", names=asked)] == asked
        assert [name for name, _ in client.fetch_iter("m", prefix="c")] == ["c.empty", "c.ids", "c.scale"]
        seen: list[int] = []
        list(client.fetch_iter("m", progress=seen.append))
        assert sum(seen) == client.describe("m").info.payload_bytes


def test_fetch_iter_refuses_bad_arguments_at_once(srv):
    with tannery.Client(srv.target) as client:
        with pytest.raises(ValueError, match="names or a prefix, not both"):
            client.fetch_iter("m", names=["a.bias"], prefix="a")
        with pytest.raises(TypeError, match="not one str"):
            client.fetch_iter("m", names="a.bias")
        missing = client.fetch_iter("nope")
        with pytest.raises(tannery.NotFound, match="archive 'nope' not found"):
            next(missing)


def test_fetch_iter_hands_out_each_tensor_before_the_next_one_is_received(tmp_path):
    """The first entry is yielded while the server has not sent the second's last byte."""
    big = {"a": torch.ones(MiB), "b": torch.full((4 * MiB,), 2.0)}
    with running_server(tmp_path, chunk_size=64 << 10) as server, tannery.Client(server.target) as client:
        client.store("big", big)
        received: list[int] = []
        entries = client.fetch_iter("big", progress=received.append)
        name, tensor = next(entries)
        assert name == "a" and same(tensor, big["a"])
        assert sum(received) < client.describe("big").info.payload_bytes
        assert [(n, same(t, big[n])) for n, t in entries] == [("b", True)]


def test_leaving_fetch_iter_early_cancels_the_call(tmp_path):
    with running_server(tmp_path, chunk_size=64 << 10) as server, tannery.Client(server.target) as client:
        client.store("big", {f"e{i}": torch.full((2 * MiB,), float(i)) for i in range(6)})
        for name, _ in client.fetch_iter("big"):
            break
        assert name == "e0"
        assert wait_unpinned(server)  # the server ended the call and released its blobs
        assert client.delete("big").blobs_removed == 6


def test_a_failure_midway_comes_after_the_entries_that_came_whole(srv, one_message_batches):
    blob_path(srv, "m", "c.ids").unlink()
    with tannery.Client(srv.target) as client:
        got = []
        with pytest.raises(tannery.DataLoss, match="missing"):
            for name, tensor in client.fetch_iter("m"):
                got.append(name)
        assert got == ["a.bias", "a.weight", "b.mask", "c.empty"]


def test_aio_fetch_iter_at_parity(srv):
    async def run():
        async with tannery.aio.Client(srv.target) as client:
            got = [(name, tensor) async for name, tensor in client.fetch_iter("m", names=["d.bytes", "a.bias"])]
            assert [(n, same(t, STATE[n])) for n, t in got] == [("d.bytes", True), ("a.bias", True)]
            assert [name async for name, _ in client.fetch_iter("m", prefix="a")] == ["a.bias", "a.weight"]
            with pytest.raises(ValueError, match="not both"):
                client.fetch_iter("m", names=["a.bias"], prefix="a")
            entries = client.fetch_iter("m")
            async for name, _ in entries:
                break
            await entries.aclose()
            assert name == "a.bias"
            with pytest.raises(tannery.NotFound, match="archive 'nope' not found"):
                async for _ in client.fetch_iter("nope"):
                    pass

    asyncio.run(run())
    assert wait_unpinned(srv)


# -- Client.fetch_pieces ---------------------------------------------------------------------


def joined(pieces) -> dict[str, bytes]:
    """Each entry's tensor bytes from its pieces, checking that they come in order, whole."""
    out: dict[str, bytearray] = {}
    for piece in pieces:
        if piece.first:
            assert piece.name not in out and piece.offset == 0
            out[piece.name] = bytearray()
        assert piece.offset == len(out[piece.name]) and piece.info.nbytes >= piece.offset + piece.data.nbytes
        out[piece.name] += piece.data
        assert piece.last == (len(out[piece.name]) == piece.info.nbytes)
    return {name: bytes(data) for name, data in out.items()}


def test_fetch_pieces_bring_each_entrys_tensor_bytes_in_order(srv):
    with tannery.Client(srv.target) as client:
        pieces = list(client.fetch_pieces("m"))
        assert [p.name for p in pieces if p.first] == sorted(STATE)
        assert joined(pieces) == {name: bytes(buffer_of(STATE[name])) for name in sorted(STATE)}
        assert {(p.name, p.info.dtype.name, p.info.shape) for p in pieces} == {
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in STATE.items()}
        asked = ["c.empty", "a.weight"]
        assert list(joined(client.fetch_pieces("m", names=asked))) == asked
        seen: list[int] = []
        list(client.fetch_pieces("m", prefix="c", progress=seen.append))
        assert sum(seen) == sum(e.payload_bytes for e in client.describe("m") if e.name.startswith("c."))


def test_aio_fetch_pieces_at_parity(srv):
    async def run():
        async with tannery.aio.Client(srv.target) as client:
            return [piece async for piece in client.fetch_pieces("m", names=["b.mask", "d.bytes"])]

    assert joined(asyncio.run(run())) == {n: bytes(buffer_of(STATE[n])) for n in ("b.mask", "d.bytes")}


def test_a_piece_stream_that_breaks_a_payload_is_a_format_error():
    payload = serialize(torch.arange(10))
    reader = PieceReader()
    reader.feed(wire.FetchMessage("a", memoryview(payload[:50])))
    with pytest.raises(tannery.FormatError, match=r"entry 'a': stream ended inside a payload: 50 of 121 bytes"):
        reader.feed(wire.FetchMessage("b", memoryview(payload)))
    reader = PieceReader()
    reader.feed(wire.FetchMessage("a", memoryview(payload)))
    with pytest.raises(tannery.FormatError, match="entry 'a': a second payload"):
        reader.feed(wire.FetchMessage("", memoryview(payload)))
    with pytest.raises(tannery.FormatError, match="payload bytes before any entry name"):
        PieceReader().feed(wire.FetchMessage("", memoryview(payload)))
    reader = PieceReader()
    reader.feed(wire.FetchMessage("a", memoryview(b"")))
    with pytest.raises(tannery.FormatError, match="entry 'a' came without a payload"):
        reader.close()


# -- the checkpoint writer -------------------------------------------------------------------


def described(state: dict[str, torch.Tensor], order=None):
    from tannery.records import EntryDescription
    from tannery.torch import buffer_of, short_name

    names = order or sorted(state)
    return [EntryDescription(n, short_name(state[n].dtype), tuple(state[n].shape), buffer_of(state[n]).nbytes, 0, "")
            for n in names]


def pieces_of(state: dict[str, torch.Tensor], names, chunk: int = 7) -> list:
    """The pieces a Fetch of ``names`` brings in messages of ``chunk`` bytes (through the real reader)."""
    reader = PieceReader()
    pieces = []
    for name in names:
        payload = serialize(state[name])
        for start in range(0, len(payload), chunk):
            pieces += reader.feed(wire.FetchMessage(name if start == 0 else "", memoryview(payload)[start : start + chunk]))
    reader.close()
    return pieces


@pytest.mark.parametrize("suffix", [".safetensors", ".tannic"])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_the_writer_takes_entries_in_any_order(tmp_path, suffix, chunk):
    path = tmp_path / f"out{suffix}"
    with CheckpointWriter(path, described(STATE)) as writer:
        for piece in pieces_of(STATE, reversed(list(STATE)), chunk):
            writer.write(piece)
        paths = writer.finish()
    assert all(p.exists() for p in paths) and sorted(tmp_path.iterdir()) == sorted(paths)
    if suffix == ".safetensors":
        back = safetensors.torch.load_file(path)
    else:
        back = load_tannic(path, like=STATE).to_value({n: STATE[n] for n in STATE})
    assert back.keys() == STATE.keys() and all(same(back[n], STATE[n]) for n in STATE)


def test_safetensors_files_come_out_as_the_library_writes_them(tmp_path):
    from tannery.torch import _TORCH

    every_dtype = {f"{'z' if i % 2 else 'a'}.{name}": torch.arange(5).to(dtype)
                   for i, (name, dtype) in enumerate(_TORCH.items()) if name != "complex128"}
    for state in (STATE, every_dtype):
        path = tmp_path / "mine.safetensors"
        with CheckpointWriter(path, described(state)) as writer:
            for piece in pieces_of(state, state, 13):
                writer.write(piece)
            writer.finish()
        safetensors.torch.save_file(state, tmp_path / "theirs.safetensors")
        assert path.read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_the_writer_refuses_an_entry_that_is_not_the_one_described(tmp_path):
    path = tmp_path / "out.safetensors"
    other = {"a.weight": STATE["a.weight"].reshape(6, 4), "zzz": STATE["a.bias"]}
    with CheckpointWriter(path, described(STATE)) as writer:
        with pytest.raises(CommandError, match=r"a.weight: received float32 \[6, 4\], described as float32 \[4, 6\] "
                                               r"\(was the archive replaced during the pull\?\)"):
            writer.write(pieces_of(other, ["a.weight"])[0])
        with pytest.raises(CommandError, match="zzz: received an entry the archive's description did not have"):
            writer.write(pieces_of(other, ["zzz"])[0])
        for piece in pieces_of(STATE, ["a.bias"]):
            writer.write(piece)
        with pytest.raises(CommandError, match="a.bias: received twice"):
            writer.write(pieces_of(STATE, ["a.bias"])[0])
        with pytest.raises(CommandError, match=r"the server sent no 'a.weight', 'b.mask', 'c.empty', 'c.ids', "
                                               r"'c.scale', \.\.\. \(6 in all\)"):
            writer.finish()
    assert list(tmp_path.iterdir()) == []


# -- tannery pull ------------------------------------------------------------------------------


def pull(target: str, *argv: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--target", target, "pull", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".safetensors", ".tannic"])
def test_a_pull_failing_midway_leaves_no_file_and_an_old_one_as_it_was(srv, tmp_path, capsys, suffix,
                                                                       one_message_batches, monkeypatch):
    out = tmp_path / "out" / f"model{suffix}"
    out.parent.mkdir()
    assert pull(srv.target, "m", "-o", str(out), capsys=capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    blob_path(srv, "m", "c.ids").unlink()  # the server fails when it gets to this entry
    written: list[str] = []
    write = CheckpointWriter.write
    monkeypatch.setattr(CheckpointWriter, "write",
                        lambda self, piece: (written.append(piece.name) if piece.last else None, write(self, piece)))
    code, err = pull(srv.target, "m", "-o", str(out), "--force", capsys=capsys)
    assert written == ["a.bias", "a.weight", "b.mask", "c.empty"]  # written into the file before the failure
    assert code == 1 and "tannery pull: error:" in err and "is missing" in err
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before  # no temporary file either
    fresh = tmp_path / "out" / f"fresh{suffix}"
    assert pull(srv.target, "m", "-o", str(fresh), capsys=capsys)[0] == 1
    assert {p.name for p in out.parent.iterdir()} == set(before)


_PEAK_RSS = """
import sys
from tannery.cli import main
status = main(sys.argv[1:])
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print("peak", int(line.split()[1]) * 1024, file=sys.stderr)
sys.exit(status)
"""


def pull_peak_rss(target: str, archive: str, path: Path) -> int:
    """Pull in a fresh process; that process's peak RSS (VmHWM, its own since exec)."""
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS, "--target", target, "pull", archive, "-o", str(path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return int(result.stderr.strip().splitlines()[-1].split()[1])


@pytest.mark.slow
def test_pull_holds_a_few_messages_not_the_archive_nor_an_entry(tmp_path):
    """A 512 MiB archive (one entry of 384 MiB, four of 32 MiB) pulled in a subprocess, as
    .safetensors and as .tannic: its peak RSS grows by far less than its largest entry over
    a pull of a 4 KiB archive (what grows is gRPC's buffering of messages not yet read:
    ~25-40 MiB measured)."""
    sizes = {"embed": 96 * MiB, **{f"layer{i}": 8 * MiB for i in range(4)}}  # float32 elements
    with running_server(tmp_path) as server, tannery.Client(server.target) as client:
        client.store("small", {"x": torch.ones(1024)})
        client.store("large", {name: torch.full((n,), float(i)) for i, (name, n) in enumerate(sizes.items())})
        small = pull_peak_rss(server.target, "small", tmp_path / "small.safetensors")
        for out in (tmp_path / "large.safetensors", tmp_path / "large.tannic"):
            large = pull_peak_rss(server.target, "large", out)
            assert large - small < 64 * MiB, f"{out.name}: peak RSS {large / MiB:.0f} MiB, {small / MiB:.0f} for 4 KiB"
    with safetensors.safe_open(tmp_path / "large.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted(sizes)
        for i, (name, n) in enumerate(sizes.items()):
            array = f.get_tensor(name)
            assert array.shape == (n,) and np.all(array == i)
    pair = load_tannic(tmp_path / "large.tannic")
    for i, (name, n) in enumerate(sizes.items()):
        assert np.all(pair.find(name).numpy() == i)
