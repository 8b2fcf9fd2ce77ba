"""Streaming fetches (``Client.fetch_iter`` and its asyncio twin) and ``tannery pull`` writing
while it receives: order, progress, early exits, failures midway, and the puller's memory."""

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
from tannery import load_tannic
from tannery.cli import main
from tannery.cli.checkpoint_writer import CheckpointWriter
from tannery.cli.errors import CommandError

from .server_harness import running_server

MiB = 1 << 20
#: Entries of several dtypes and shapes (a boolean, a scalar, an empty tensor among them).
STATE = {
    "b.mask": torch.tensor([True, False, True, True, False, False, True, False, True]),
    "a.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "a.bias": torch.arange(6, dtype=torch.float16),
    "c.ids": torch.arange(-5, 5, dtype=torch.int64),
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
    import tannery_server.archives

    monkeypatch.setattr(tannery_server.archives, "FETCH_BATCH_BYTES", 1)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def wait_unpinned(server, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while server.storage._pins and time.monotonic() < deadline:
        time.sleep(0.01)
    return not server.storage._pins


def blob_path(server, archive: str, entry: str) -> Path:
    return server.storage.blobs.path(server.storage.catalog.entries(archive, [entry])[entry].digest)


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


# -- the checkpoint writer -------------------------------------------------------------------


def described(state: dict[str, torch.Tensor], order=None):
    from tannery.calls import EntryDescription
    from tannery.torch import buffer_of, short_name

    names = order or sorted(state)
    return [EntryDescription(n, short_name(state[n].dtype), tuple(state[n].shape), buffer_of(state[n]).nbytes, 0, "")
            for n in names]


@pytest.mark.parametrize("suffix", [".safetensors", ".tannic"])
def test_the_writer_takes_entries_in_any_order(tmp_path, suffix):
    path = tmp_path / f"out{suffix}"
    with CheckpointWriter(path, described(STATE)) as writer:
        for name in reversed(list(STATE)):
            writer.write(name, STATE[name])
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
            for name, tensor in state.items():
                writer.write(name, tensor)
            writer.finish()
        safetensors.torch.save_file(state, tmp_path / "theirs.safetensors")
        assert path.read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_the_writer_refuses_an_entry_that_is_not_the_one_described(tmp_path):
    path = tmp_path / "out.safetensors"
    with CheckpointWriter(path, described(STATE)) as writer:
        with pytest.raises(CommandError, match=r"a.weight: received float32 \[6, 4\], described as float32 \[4, 6\] "
                                               r"\(was the archive replaced during the pull\?\)"):
            writer.write("a.weight", STATE["a.weight"].reshape(6, 4))
        with pytest.raises(CommandError, match="zzz: received an entry the archive's description did not have"):
            writer.write("zzz", STATE["a.bias"])
        writer.write("a.bias", STATE["a.bias"])
        with pytest.raises(CommandError, match="a.bias: received twice"):
            writer.write("a.bias", STATE["a.bias"])
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
    monkeypatch.setattr(CheckpointWriter, "write", lambda self, name, t: (written.append(name), write(self, name, t)))
    code, err = pull(srv.target, "m", "-o", str(out), capsys=capsys)
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
def test_pull_holds_one_entry_not_the_archive(tmp_path):
    """A 512 MiB archive (16 entries of 32 MiB) pulled in a subprocess: its peak RSS grows by
    about one entry over a pull of a 4 KiB archive, not by the archive."""
    entries = 16
    with running_server(tmp_path) as server, tannery.Client(server.target) as client:
        client.store("small", {"x": torch.ones(1024)})
        state = {f"layer{i:02d}": torch.full((8 * MiB,), float(i)) for i in range(entries)}
        client.store("large", state)
        del state
        small = pull_peak_rss(server.target, "small", tmp_path / "small.safetensors")
        large = pull_peak_rss(server.target, "large", tmp_path / "large.safetensors")
    growth = large - small
    assert growth < 128 * MiB, f"peak RSS {large / MiB:.0f} MiB, {growth / MiB:.0f} MiB over a 4 KiB pull"
    with safetensors.safe_open(tmp_path / "large.safetensors", "np") as f:
        assert sorted(f.keys()) == [f"layer{i:02d}" for i in range(entries)]
        for i in range(entries):
            array = f.get_tensor(f"layer{i:02d}")
            assert array.shape == (8 * MiB,) and np.all(array == i)
