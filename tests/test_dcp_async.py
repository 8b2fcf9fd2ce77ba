"""tannery.dcp with ``dcp.async_save``: the save runs in the background, on real gloo ranks
and a real server, and still stores what the state dict held at the call, whole or not at all."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import tannery
import tannery.dcp
from tests.server_harness import running_server
from tests.test_dcp import TIMEOUT, _free_port, _full, _init, _sharded


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("dcp-async")) as server:
        yield server


@pytest.fixture()
def client(server):
    with tannery.Client(server.target) as client:
        yield client


def _loaded(client: tannery.Client, archive: str) -> dict:
    """The checkpoint loaded into one process as plain tensors."""
    state = {"model": {name: torch.zeros_like(t) for name, t in _full().items()}, "step": 0}
    dcp.load(state, storage_reader=tannery.dcp.Reader(client, archive))
    return state


def _assert_is_full(state: dict, step: int) -> None:
    for name, expected in _full().items():
        assert torch.equal(state["model"][name], expected), name
    assert state["step"] == step


# -- one process ---------------------------------------------------------------------------


class _RacedWriter(tannery.dcp.Writer):
    """A Writer whose checkpoint another job creates while this one writes its parts."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.client.store(self.archive, {"other": torch.full((3,), 5.0)})
        return future


def test_the_future_raises_when_the_save_is_refused(client):
    dcp.save({"w": torch.ones(4)}, storage_writer=tannery.dcp.Writer(client, "ckpt/async-exists"))

    # Refused by the coordinator, before anything is written: the future raises, the call did not.
    future = dcp.async_save({"w": torch.zeros(4)}, storage_writer=tannery.dcp.Writer(client, "ckpt/async-exists"))
    with pytest.raises(BaseException, match=r"'ckpt/async-exists' exists \(replace=True to replace it\)"):
        future.result(timeout=TIMEOUT)
    got = {"w": torch.zeros(4)}
    dcp.load(got, storage_reader=tannery.dcp.Reader(client, "ckpt/async-exists"))
    assert torch.equal(got["w"], torch.ones(4))

    # Refused by the server at the final Union (the archive appeared meanwhile): the future
    # raises, the other archive stays as it was, this save's parts are left as garbage.
    future = dcp.async_save({"w": torch.zeros(4)}, storage_writer=_RacedWriter(client, "ckpt/async-raced"))
    with pytest.raises(BaseException, match="ckpt/async-raced"):
        future.result(timeout=TIMEOUT)
    assert client.archive("ckpt/async-raced").names() == ["other"]

    future = dcp.async_save({"w": torch.full((4,), 2.0)},
                            storage_writer=tannery.dcp.Writer(client, "ckpt/async-exists", replace=True))
    future.result(timeout=TIMEOUT)
    dcp.load(got, storage_reader=tannery.dcp.Reader(client, "ckpt/async-exists"))
    assert torch.equal(got["w"], torch.full((4,), 2.0))


def test_a_writer_made_from_a_target_pickles_and_opens_its_own_client(server, client):
    writer = tannery.dcp.Writer(server.target, "ckpt/pickled", replace=True)
    assert writer.client.list("ckpt/pickled") == []  # its client opened
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.archive, copy.replace, copy._client) == ("ckpt/pickled", True, None)
    dcp.save({"w": torch.arange(6)}, storage_writer=copy)
    assert torch.equal(client.archive("ckpt/pickled").rows("w", 0, 6), torch.arange(6))
    copy.close()

    with pytest.raises(TypeError, match=r"made with a tannery.Client cannot be pickled .* server's target"):
        pickle.dumps(tannery.dcp.Writer(client, "ckpt/pickled"))


# -- two ranks -----------------------------------------------------------------------------


class _GatedWriter(tannery.dcp.Writer):
    """A Writer whose ranks write their items only once ``gate`` is set (by the training loop,
    once it has changed its tensors)."""

    gate = threading.Event()

    def write_data(self, plan, planner):
        if not self.gate.wait(TIMEOUT):
            raise TimeoutError("the test never opened the gate")
        return super().write_data(plan, planner)


def _changed_after_call_worker(rank: int, world: int, port: int, target: str, archive: str, results) -> None:
    try:
        mesh = _init(rank, world, port)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
        state = {"model": _sharded(_full(), mesh), "step": 7}
        future = dcp.async_save(state, storage_writer=_GatedWriter(target, archive), process_group=group)
        pending = not future.done()
        # The training loop goes on: its tensors change (in place) before a byte is written.
        for tensor in state["model"].values():
            tensor.to_local().add_(1000.0)
        state["step"] = 8
        _GatedWriter.gate.set()
        future.result(timeout=TIMEOUT)
        results.put((rank, "ok", {"pending": pending}))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:500]))
    finally:
        _flush(results)  # what this rank said reaches the test even if destroying the group hangs
        if dist.is_initialized():
            dist.destroy_process_group()


def _flush(results) -> None:
    """Hand what this process put on ``results`` to the pipe now: a queue's feeder thread needs the
    GIL, which ``destroy_process_group`` may hold while it waits for a peer that was killed."""
    results.close()
    results.join_thread()


def _killed_worker(rank: int, world: int, port: int, target: str, archive: str, earlier: str, results) -> None:
    try:
        mesh = _init(rank, world, port)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
        state = {"model": _sharded(_full(), mesh), "step": 7}
        dcp.async_save(state, storage_writer=tannery.dcp.Writer(target, earlier), process_group=group).result(TIMEOUT)
        told = []

        def progress(nbytes: int) -> None:  # the victim stalls mid-Store until the test kills it
            if rank == 1 and not told:
                told.append(nbytes)
                results.put((rank, "uploading", nbytes))
                time.sleep(TIMEOUT)

        future = dcp.async_save(state, storage_writer=tannery.dcp.Writer(target, archive, progress=progress),
                                process_group=group)
        results.put((rank, "returned", None))
        future.result(timeout=TIMEOUT)
        results.put((rank, "ok", None))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:500]))
    finally:
        _flush(results)  # what this rank said reaches the test even if destroying the group hangs
        if dist.is_initialized():
            dist.destroy_process_group()


#: What a worker says last: its save ended, or failed.
FINAL = ("ok", "failed")


def _run(worker, world: int, *args) -> tuple[dict[int, list[tuple[str, object]]], list[int | None]]:
    """``worker(rank, world, port, *args, results)`` in ``world`` spawned processes: what each
    rank put, in order, and how each process ended (its exit code; negative: the signal). A
    rank that says "uploading" is killed (SIGKILL) at once."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, results), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    said: dict[int, list[tuple[str, object]]] = {rank: [] for rank in range(world)}
    # Each rank waits at most TIMEOUT for each of its two saves: the deadline leaves them that,
    # after a start (spawn, torch, the process group) that takes long on a loaded machine.
    deadline = time.monotonic() + 3 * TIMEOUT

    def waiting(rank: int) -> bool:
        """Whether rank ``rank`` may still say something: alive, its last word not yet said (a
        rank that said it may hang destroying its group when a peer was killed)."""
        return procs[rank].is_alive() and not (said[rank] and said[rank][-1][0] in FINAL)

    try:
        while time.monotonic() < deadline and any(waiting(rank) for rank in range(world)):
            try:
                rank, status, answer = results.get(timeout=0.5)
            except queue.Empty:
                continue
            said[rank].append((status, answer))
            if status == "uploading":
                os.kill(procs[rank].pid, signal.SIGKILL)
        while True:  # what was put just before the processes ended
            try:
                rank, status, answer = results.get(timeout=0.5)
            except queue.Empty:
                break
            said[rank].append((status, answer))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    return said, [proc.exitcode for proc in procs]


@pytest.mark.slow
def test_async_save_stores_the_state_at_the_call_not_later_changes(server, client):
    said, exits = _run(_changed_after_call_worker, 2, server.target, "ckpt/async")
    assert said == {0: [("ok", {"pending": True})], 1: [("ok", {"pending": True})]}, (said, exits)
    assert not [info.name for info in client.list("ckpt/async.")]  # the parts are gone
    _assert_is_full(_loaded(client, "ckpt/async"), step=7)  # bit-exact, without the +1000


@pytest.mark.slow
def test_a_rank_killed_during_an_async_save_leaves_no_checkpoint(server, client):
    archive, earlier = "ckpt/async-killed", "ckpt/async-earlier"
    said, exits = _run(_killed_worker, 2, server.target, archive, earlier)
    statuses = {rank: [status for status, _ in answers] for rank, answers in said.items()}
    assert statuses[1] == ["returned", "uploading"] or statuses[1] == ["uploading", "returned"], (said, exits)
    # Rank 0's future never succeeds: it raises once gloo notices the dead peer, which on a loaded
    # machine may come after the test stopped waiting or with the process torn down (as in
    # tests/test_dcp_versions.py's killed-rank test): "ok" is what is ruled out.
    assert statuses[0][0] == "returned" and "ok" not in statuses[0], (said, exits)
    assert archive not in [info.name for info in client.list(archive)]
    # The victim's Store was cut off midway: no part of it was stored.
    assert not [info.name for info in client.list(archive + ".rank-1.")]
    _assert_is_full(_loaded(client, earlier), step=7)
