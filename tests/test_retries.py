"""Both clients retry what is safe to retry: a server killed mid-call and restarted on the same
port does not fail the push or pull that was running.

A Store is sent again from its start (the server kept nothing of the cut call); a Fetch is
resumed after the entries that came whole, none fetched twice into the result. With retries
off the same calls fail with UNAVAILABLE naming the server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery.rpc.retries import RetryPolicy, resumed_request
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import ServerProcess, free_port

MiB = 1 << 20
#: 256 MiB in 8 entries: a pull cut midway has entries to resume after.
ENTRIES = 8
ENTRY_FLOATS = 32 * MiB // 4


def checkpoint() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.rand(ENTRY_FLOATS, generator=generator) for i in range(ENTRIES)}


class Restarter:
    """Kills the server (SIGKILL) once ``after`` bytes have moved, and starts it again on the
    same port ``downtime`` seconds later."""

    def __init__(self, server: ServerProcess, after: int, downtime: float = 1.0) -> None:
        self.server = server
        self.after = after
        self.downtime = downtime
        self.moved = 0
        self.killed = threading.Event()
        self.restarted = threading.Event()
        self._reached = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def progress(self, nbytes: int) -> None:
        """Count bytes moved; at the threshold, hold the call until the server is killed (so a
        call that would finish first is cut off all the same)."""
        self.moved += nbytes
        if self.moved >= self.after and not self._reached.is_set():
            self._reached.set()
            self.killed.wait(30)

    def _run(self) -> None:
        if not self._reached.wait(120):
            return
        self.server.kill()
        self.killed.set()
        time.sleep(self.downtime)
        self.server.start()
        self.restarted.set()

    def join(self) -> None:
        self._thread.join(120)


@pytest.fixture
def server(tmp_path):
    port = free_port()
    with ServerProcess(tmp_path / "data", port=port) as srv:
        srv.port = port
        yield srv


def same(a: dict[str, torch.Tensor], b) -> bool:
    return sorted(a) == sorted(b.names()) and all(torch.equal(a[n], b.find(n)) for n in a)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_a_push_survives_a_server_killed_midway(server, transport, caplog):
    caplog.set_level(logging.INFO, logger="tannery.client")
    tensors = checkpoint()
    restarter = Restarter(server, after=64 * MiB)
    with tannery.Client(server.target, retries=6, transport=transport) as client:
        info = client.store("ckpt", tensors, progress=restarter.progress)
        restarter.join()
        assert restarter.killed.is_set() and restarter.restarted.is_set()
        assert info.entries == ENTRIES
        assert same(tensors, client.fetch("ckpt"))
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retries and all(r.startswith("Store of 'ckpt'") for r in retries), retries


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_a_pull_survives_a_server_killed_midway(server, transport):
    tensors = checkpoint()
    with tannery.Client(server.target, transport="grpc") as client:
        client.store("ckpt", tensors)
    restarter = Restarter(server, after=100 * MiB)
    with tannery.Client(server.target, retries=6, transport=transport) as client:
        pulled = list(client.fetch_iter("ckpt", progress=restarter.progress))
    restarter.join()
    assert restarter.killed.is_set() and restarter.restarted.is_set()
    names = [name for name, _ in pulled]
    assert names == sorted(tensors), names  # each entry once, in order
    assert all(torch.equal(tensors[name], tensor) for name, tensor in pulled)


@pytest.mark.slow
def test_the_aio_client_pushes_and_pulls_through_a_restart(server):
    tensors = checkpoint()

    async def run() -> tuple[object, dict]:
        async with tannery.aio.Client(server.target, retries=6, transport="grpc") as client:
            pushing = Restarter(server, after=64 * MiB)
            info = await client.store("ckpt", tensors, progress=pushing.progress)
            await asyncio.to_thread(pushing.join)
            pulling = Restarter(server, after=100 * MiB)
            pulled = [item async for item in client.fetch_iter("ckpt", progress=pulling.progress)]
            await asyncio.to_thread(pulling.join)
            assert pushing.restarted.is_set() and pulling.restarted.is_set()
            return info, pulled

    info, pulled = asyncio.run(run())
    assert info.entries == ENTRIES
    assert [name for name, _ in pulled] == sorted(tensors)
    assert all(torch.equal(tensors[name], tensor) for name, tensor in pulled)


@pytest.mark.slow
def test_with_retries_off_a_killed_server_fails_the_calls_naming_it(server):
    tensors = checkpoint()
    with tannery.Client(server.target, retries=0, transport="grpc") as client:
        restarter = Restarter(server, after=64 * MiB)
        with pytest.raises(tannery.Unavailable, match=server.target):
            client.store("ckpt", tensors, progress=restarter.progress)
        restarter.join()
        client.store("ckpt", tensors)
        restarter = Restarter(server, after=100 * MiB)
        with pytest.raises(tannery.Unavailable, match=server.target):
            list(client.fetch_iter("ckpt", progress=restarter.progress))
        restarter.join()


class _Broken(grpc.RpcError):
    """What a unary call raises when its connection breaks: UNAVAILABLE, no trailers, and the
    initial metadata that had come before (none when the request never reached the server)."""

    def __init__(self, initial=()) -> None:
        self._initial = tuple(initial)

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"

    def trailing_metadata(self):
        return ()

    def initial_metadata(self):
        return self._initial


def test_a_delete_retried_after_a_lost_answer_reports_the_archive_gone(server, monkeypatch):
    with tannery.Client(server.target, retries=2, transport="grpc") as client:
        client.store("old", {"w": torch.ones(3)})
        real = client._methods.delete
        lost = []

        def answer_lost(request, **options):
            result, call = real.with_call(request, **options)
            if isinstance(request, pb.DeleteRequest) and not lost:
                lost.append(result)  # deleted, then the connection broke before the answer came
                raise _Broken(call.initial_metadata())
            return result

        monkeypatch.setattr(client._methods, "delete", answer_lost)
        deleted = client.delete("old")
        assert lost and deleted.already_gone and deleted.archive.name == "old"
        with pytest.raises(tannery.NotFound):
            client.delete("old")  # a first attempt that finds nothing is still NotFound


def test_a_delete_whose_first_attempt_never_reached_the_server_is_not_found_not_already_gone(server, monkeypatch):
    """The first attempt broke off before the server got it (no initial metadata came): the
    archive was never there, so the retry's NOT_FOUND is the answer, not ``already_gone``."""
    with tannery.Client(server.target, retries=2, transport="grpc") as client:
        real = client._methods.delete
        tries = []

        def never_sent(request, **options):
            tries.append(request.archive)
            if len(tries) == 1:
                raise _Broken()
            return real(request, **options)

        monkeypatch.setattr(client._methods, "delete", never_sent)
        with pytest.raises(tannery.NotFound, match="'never' not found.*no earlier attempt of this Delete was seen"):
            client.delete("never")
        assert tries == ["never", "never"]


def test_a_delete_cut_off_by_a_kill_after_it_reached_the_server_reports_already_gone(server, tmp_path):
    """A real server killed (-9) while its Delete waits for the catalog's write lock: the client
    had the Delete's initial metadata, so when the retry finds the archive gone (deleted
    meanwhile, as a lost attempt that committed would have) it reports ``already_gone``."""
    import sqlite3

    from tannery.records import Deleted
    from tannery_server.storage.sqlite_catalog import SqliteCatalog

    with tannery.Client(server.target, transport="grpc") as client:
        client.store("old", {"w": torch.ones(3)})
    path = tmp_path / "data" / "catalog.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the server's Delete waits for this lock
    result: list[object] = []

    def delete() -> None:
        with tannery.Client(server.target, transport="grpc", retries=RetryPolicy(6, first_delay=0.5)) as client:
            try:
                result.append(client.delete("old"))
            except Exception as exc:  # noqa: BLE001: the test looks at it
                result.append(exc)

    thread = threading.Thread(target=delete)
    thread.start()
    time.sleep(1.5)  # the Delete is in, waiting for the lock
    server.kill()
    holder.execute("ROLLBACK")
    holder.close()
    catalog = SqliteCatalog(path)
    try:
        assert catalog.delete_archive("old")[0] is not None  # what the lost attempt might have done
    finally:
        catalog.close()
    server.start()
    thread.join(60)
    assert len(result) == 1 and isinstance(result[0], Deleted) and result[0].already_gone, result


def test_unreachable_retries_then_names_the_server_and_the_retries(caplog):
    caplog.set_level(logging.INFO, logger="tannery.client")
    target = f"127.0.0.1:{free_port()}"
    with tannery.Client(target, retries=2) as client:
        client._retries = RetryPolicy(2, first_delay=0.01, max_delay=0.02)
        with pytest.raises(tannery.Unavailable, match=rf"{target}.*gave up after 2 retries"):
            client.list()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("List: ") and "retry 1 of 2" in lines[0], lines


# The policy and the resumed request, alone ------------------------------------------------


def test_the_policy_comes_from_the_argument_then_the_environment():
    assert RetryPolicy.resolve(None, {}).retries == 5
    assert RetryPolicy.resolve(None, {"TANNERY_RETRIES": "0"}).retries == 0
    assert RetryPolicy.resolve(3, {"TANNERY_RETRIES": "0"}).retries == 3
    with pytest.raises(ValueError, match=r"TANNERY_RETRIES='many' is not a number of retries"):
        RetryPolicy.resolve(None, {"TANNERY_RETRIES": "many"})
    with pytest.raises(ValueError, match="retries -1"):
        RetryPolicy.resolve(-1)


def test_pauses_are_bounded_and_jittered():
    policy = RetryPolicy()
    assert all(0.25 <= policy.delay(0) < 0.5 for _ in range(50))
    assert all(policy.delay(n) < 5.0 for n in range(30))
    totals = [sum(policy.delay(n) for n in range(policy.retries)) for _ in range(50)]
    assert all(6.25 <= total < 12.5 for total in totals)  # the default 5 retries: 6.25 to 12.5 s
    assert len({round(t, 6) for t in totals}) > 40  # jittered: no two clients alike


def test_a_fetch_by_name_resumes_with_the_asks_not_yet_whole():
    asks = [pb.EntryAsk(name=n, dtype="float32") for n in ("c", "a", "b")]
    request = pb.FetchRequest(archive="x", entries=asks)
    rest = resumed_request(request, ["c"], None)
    assert [a.name for a in rest.entries] == ["a", "b"] and rest.entries[0].dtype == "float32"
    assert resumed_request(request, ["c", "a", "b"], None) is None


def test_a_fetch_by_prefix_resumes_by_name_after_those_done():
    request = pb.FetchRequest(archive="x", prefix="body")
    listed = ["body.0.w", "body.1.w", "bodyguard", "head.w", "body"]
    rest = resumed_request(request, ["body", "body.0.w"], listed)
    assert [a.name for a in rest.entries] == ["body.1.w"]


# The command line inherits the retries ----------------------------------------------------


@pytest.mark.slow
def test_a_push_waits_for_a_server_that_is_starting(tmp_path):
    """`tannery push` started while its server is down notes each retry and pushes once it is up."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0)}, str(tmp_path / "model.safetensors"))
    port = free_port()
    command = [sys.executable, "-m", "tannery.cli", "push", str(tmp_path / "model.safetensors"), "--as", "m",
               "--target", f"127.0.0.1:{port}", "--transport", "grpc", "--retries", "8"]
    push = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    with ServerProcess(tmp_path / "data", port=port) as srv:
        out, err = push.communicate(timeout=60)
        assert push.returncode == 0, err
        assert "pushed" in out and "m" in out
        assert f"Store of 'm': cannot reach the server at 127.0.0.1:{port}" in err and "retry 1 of 8" in err, err
        with tannery.Client(srv.target, transport="grpc") as client:
            assert client.fetch("m").find("w").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.slow
def test_a_pull_to_a_file_survives_a_server_killed_inside_an_entry(server, tmp_path):
    """`tannery pull`'s path: pieces written to a safetensors file as they come; the entry cut
    off comes again from its first piece after the retry, and the file is whole and exact."""
    from safetensors.torch import load_file

    from tannery.cli.checkpoint_writer import CheckpointWriter

    tensors = checkpoint()
    with tannery.Client(server.target, transport="grpc") as client:
        client.store("ckpt", tensors)
    restarter = Restarter(server, after=100 * MiB)  # inside the fourth entry of 32 MiB
    output = tmp_path / "pulled.safetensors"
    with tannery.Client(server.target, retries=6, transport="grpc") as client:
        described = client.describe("ckpt")
        with CheckpointWriter(output, list(described.entries)) as writer:
            firsts = []
            for piece in client.fetch_pieces("ckpt", progress=restarter.progress):
                firsts += [piece.name] if piece.first else []
                writer.write(piece)
            writer.finish()
    restarter.join()
    assert restarter.killed.is_set() and restarter.restarted.is_set()
    assert len(firsts) > len(tensors)  # an entry was cut off and came again from its start
    pulled = load_file(str(output))
    assert sorted(pulled) == sorted(tensors) and all(torch.equal(pulled[n], tensors[n]) for n in tensors)


@pytest.mark.slow
def test_a_fetch_of_an_alias_cut_off_midway_is_not_resumed_from_what_it_may_point_at_now(server):
    """The alias may have moved while the server was down: the rest could come from another
    version, so the Fetch stops with the reason and the remedy (the archive's own name resumes)."""
    tensors = checkpoint()
    with tannery.Client(server.target, transport="grpc") as client:
        client.store("ckpt", tensors)
        client.tag("prod", "ckpt")
    restarter = Restarter(server, after=100 * MiB)
    got = []
    with tannery.Client(server.target, retries=6, transport="grpc") as client:
        with pytest.raises(tannery.AliasError, match=r"'prod' is an alias \(of 'ckpt' now\).*fetch again"):
            for name, _ in client.fetch_iter("prod", progress=restarter.progress):
                got.append(name)
        restarter.join()
        assert restarter.killed.is_set() and got and len(got) < len(tensors)
        assert same(tensors, client.fetch("ckpt"))  # by its own name it resumes, as before
