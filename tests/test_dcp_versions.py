"""tannery.dcp versioned saves: ``Writer(..., alias=, keep_last=)`` moves the alias once the
checkpoint is whole, then prunes; ``Reader(alias)`` resumes from it. Real gloo ranks, a real
server on both storage backends."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tannery
import tannery.dcp
from tannery.calls.retention import is_save_part
from tests.server_harness import running_server
from tests.test_dcp import TIMEOUT, _full, _init, _sharded
from tests.test_dcp_async import _run


def _state(step: int) -> dict[str, torch.Tensor]:
    """The model's tensors at ``step``: each save differs from the others."""
    return {name: tensor + step for name, tensor in _full().items()}


def _checkpoints(client: tannery.Client, prefix: str) -> list[str]:
    """The whole checkpoints under ``prefix`` (not the parts of failed saves), by name."""
    return sorted(info.name for info in client.list(prefix) if not is_save_part(info.name))


def _loaded(client: tannery.Client, name: str) -> dict:
    state = {"model": {name: torch.zeros_like(t) for name, t in _full().items()}, "step": 0}
    dcp.load(state, storage_reader=tannery.dcp.Reader(client, name))
    return state


def _assert_is(state: dict, step: int) -> None:
    for name, expected in _state(step).items():
        assert torch.equal(state["model"][name], expected), (name, step)
    assert state["step"] == step


@pytest.fixture()
def server(tmp_path, backend):
    with running_server(tmp_path, **backend) as server:
        yield server


@pytest.fixture()
def client(server):
    with tannery.Client(server.target) as client:
        yield client


# -- workers (spawned gloo ranks) ----------------------------------------------------------


def _three_saves_worker(rank: int, world: int, port: int, target: str, run: str, results) -> None:
    try:
        mesh = _init(rank, world, port)
        for step in (1, 2, 3):
            writer = tannery.dcp.Writer(target, f"{run}step-{step}", alias=f"{run}latest", keep_last=2)
            dcp.save({"model": _sharded(_state(step), mesh), "step": step}, storage_writer=writer)
            time.sleep(0.01)  # creation times apart
        # Resume: each rank loads its shards from the alias.
        state = {"model": _sharded({n: torch.zeros_like(t) for n, t in _full().items()}, mesh), "step": 0}
        dcp.load(state, storage_reader=tannery.dcp.Reader(target, f"{run}latest"))
        exact = all(torch.equal(state["model"][n].full_tensor(), t) for n, t in _state(3).items())
        results.put((rank, "ok", {"exact": exact, "step": state["step"]}))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:500]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _killed_async_worker(rank: int, world: int, port: int, target: str, run: str, results) -> None:
    try:
        mesh = _init(rank, world, port)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
        for step in (1, 2):
            writer = tannery.dcp.Writer(target, f"{run}step-{step}", alias=f"{run}latest", keep_last=2)
            state = {"model": _sharded(_state(step), mesh), "step": step}
            dcp.async_save(state, storage_writer=writer, process_group=group).result(TIMEOUT)
        told = []

        def progress(nbytes: int) -> None:  # the victim stalls mid-Store until the test kills it
            if rank == 1 and not told:
                told.append(nbytes)
                results.put((rank, "uploading", nbytes))
                time.sleep(TIMEOUT)

        writer = tannery.dcp.Writer(target, f"{run}step-3", alias=f"{run}latest", keep_last=2, progress=progress)
        future = dcp.async_save({"model": _sharded(_state(3), mesh), "step": 3}, storage_writer=writer,
                                process_group=group)
        results.put((rank, "returned", None))
        future.result(timeout=TIMEOUT)
        results.put((rank, "ok", None))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:500]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _MovedReader(tannery.dcp.Reader):
    """A Reader whose coordinator opens the alias, then moves it before rank 1 opens it."""

    group = None
    newer = ""

    def read_metadata(self, *args, **kwargs):
        if dist.get_rank() == 0:
            metadata = super().read_metadata(*args, **kwargs)
            self.client.tag(self.archive, self.newer)
            dist.barrier(group=self.group)
            return metadata
        dist.barrier(group=self.group)
        return super().read_metadata(*args, **kwargs)


def _moved_load_worker(rank: int, world: int, port: int, target: str, run: str, results) -> None:
    try:
        mesh = _init(rank, world, port)
        _MovedReader.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
        _MovedReader.newer = f"{run}step-2"
        reader = _MovedReader(target, f"{run}latest")
        state = {"model": _sharded({n: torch.zeros_like(t) for n, t in _full().items()}, mesh), "step": 0}
        dcp.load(state, storage_reader=reader)
        local = {n: t.to_local().clone() for n, t in state["model"].items()}
        full = {n: t.full_tensor() for n, t in state["model"].items()}
        steps = sorted({step for step in (1, 2) if all(torch.equal(full[n], t) for n, t in _state(step).items())})
        results.put((rank, "ok", {"steps": steps, "read": reader._archive().name, "local": len(local)}))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:500]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- tests ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_saves_keep_the_two_newest_and_resume_from_the_alias(server, client):
    said, exits = _run(_three_saves_worker, 2, server.target, "runs/7/")
    assert said == {r: [("ok", {"exact": True, "step": 3})] for r in (0, 1)}, (said, exits)
    assert client.resolve("runs/7/latest") == "runs/7/step-3"
    assert sorted(info.name for info in client.list("runs/7/")) == ["runs/7/step-2", "runs/7/step-3"]  # no parts either
    _assert_is(_loaded(client, "runs/7/latest"), step=3)  # resharded into one process, bit-exact


@pytest.mark.slow
def test_a_rank_killed_during_async_save_leaves_the_alias_on_the_last_whole_checkpoint(server, client):
    said, exits = _run(_killed_async_worker, 2, server.target, "runs/8/")
    statuses = {rank: [status for status, _ in answers] for rank, answers in said.items()}
    assert sorted(statuses[1]) == ["returned", "uploading"], (said, exits)
    # Rank 0's future never succeeds (it raises once gloo notices the dead peer; under load that
    # may come after the test has stopped waiting, so "ok" is what is ruled out).
    assert statuses[0][0] == "returned" and "ok" not in statuses[0], (said, exits)
    # The alias still names the last whole checkpoint; nothing newer or within keep_last was pruned.
    assert client.resolve("runs/8/latest") == "runs/8/step-2"
    assert _checkpoints(client, "runs/8/") == ["runs/8/step-1", "runs/8/step-2"]
    _assert_is(_loaded(client, "runs/8/latest"), step=2)

    # The next save counts whole checkpoints only: the killed save's parts do not push step-2 out.
    assert [info.name for info in client.list("runs/8/step-3")], "the killed save left no part to count"
    writer = tannery.dcp.Writer(client, "runs/8/step-4", alias="runs/8/latest", keep_last=2)
    dcp.save({"model": _state(4), "step": 4}, storage_writer=writer)
    assert client.resolve("runs/8/latest") == "runs/8/step-4"
    assert _checkpoints(client, "runs/8/") == ["runs/8/step-2", "runs/8/step-4"]
    assert [info.name for info in writer.pruned.deleted] == ["runs/8/step-1"]
    _assert_is(_loaded(client, "runs/8/latest"), step=4)

    # Once every checkpoint kept is newer than the killed save's parts, they go with step-2.
    parts = [info.name for info in client.list("runs/8/step-3")]
    writer = tannery.dcp.Writer(client, "runs/8/step-5", alias="runs/8/latest", keep_last=2)
    dcp.save({"model": _state(5), "step": 5}, storage_writer=writer)
    assert sorted(info.name for info in writer.pruned.deleted) == sorted(["runs/8/step-2", *parts])
    assert sorted(info.name for info in client.list("runs/8/")) == ["runs/8/step-4", "runs/8/step-5"]


@pytest.mark.slow
def test_every_rank_reads_the_archive_the_coordinator_resolved(server, client):
    for step in (1, 2):
        dcp.save({"model": _state(step), "step": step},
                 storage_writer=tannery.dcp.Writer(client, f"runs/9/step-{step}", alias="runs/9/latest"))
    client.tag("runs/9/latest", "runs/9/step-1")
    said, exits = _run(_moved_load_worker, 2, server.target, "runs/9/")
    # The alias moved to step-2 after the coordinator opened step-1: both ranks loaded step-1 whole.
    assert said == {r: [("ok", {"steps": [1], "read": "runs/9/step-1", "local": 4})] for r in (0, 1)}, (said, exits)
    assert client.resolve("runs/9/latest") == "runs/9/step-2"


def test_an_aliased_checkpoint_is_kept_whatever_its_age_and_keep_last_alone_prunes(client):
    for step in (1, 2, 3):
        dcp.save({"model": _state(step), "step": step},
                 storage_writer=tannery.dcp.Writer(client, f"runs/1/step-{step}", keep_last=1))
        if step == 1:
            client.tag("prod", "runs/1/step-1")
    assert _checkpoints(client, "runs/1/") == ["runs/1/step-1", "runs/1/step-3"]
    assert client.resolve("prod") == "runs/1/step-1"
    assert [a.alias for a in client.aliases()] == ["prod"]


class _RivalWriter(tannery.dcp.Writer):
    """A Writer during whose save another job moves the same alias."""

    def write_data(self, plan, planner):
        self.client.tag("runs/2/latest", "runs/2/step-1")
        return super().write_data(plan, planner)


def test_a_rival_move_of_the_alias_is_refused_and_nothing_is_pruned(client):
    dcp.save({"model": _state(1), "step": 1}, storage_writer=tannery.dcp.Writer(client, "runs/2/step-1"))
    with pytest.raises(BaseException) as refused:  # DCP's CheckpointException, naming the rank's error
        dcp.save({"model": _state(2), "step": 2},
                 storage_writer=_RivalWriter(client, "runs/2/step-2", alias="runs/2/latest", keep_last=1))
    for said in ("AliasError", "'runs/2/step-2' is saved, but alias 'runs/2/latest' was not moved to it and nothing "
                 "was pruned", "no longer points at nothing, as it did when this save began",
                 "Two jobs writing one alias is refused"):
        assert said in str(refused.value), str(refused.value)
    assert client.resolve("runs/2/latest") == "runs/2/step-1"
    assert _checkpoints(client, "runs/2/") == ["runs/2/step-1", "runs/2/step-2"]


def test_bad_versions_are_refused_clearly(client):
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"keep_last={bad} would delete the checkpoint just saved: give 1 or more"):
            tannery.dcp.Writer(client, "runs/3/step-1", alias="runs/3/latest", keep_last=bad)
    with pytest.raises(TypeError, match="keep_last is a whole number"):
        tannery.dcp.Writer(client, "runs/3/step-1", keep_last=True)
    with pytest.raises(ValueError, match=r"'flat', which has no '/': give prune_prefix="):
        tannery.dcp.Writer(client, "flat", keep_last=2)
    with pytest.raises(ValueError, match="alias is the name of an alias"):
        tannery.dcp.Writer(client, "runs/3/step-1", alias="")
    # An alias that is an archive's name: refused before anything is written.
    dcp.save({"w": torch.ones(2)}, storage_writer=tannery.dcp.Writer(client, "runs/3/base"))
    with pytest.raises(BaseException, match=r"'runs/3/base' is an archive, not an alias"):
        dcp.save({"w": torch.ones(2)}, storage_writer=tannery.dcp.Writer(client, "runs/3/step-1", alias="runs/3/base"))
    assert [info.name for info in client.list("runs/3/")] == ["runs/3/base"]
    # prune_prefix names the run when the checkpoint's name has no '/'.
    dcp.save({"w": torch.ones(2)}, storage_writer=tannery.dcp.Writer(client, "flat-1", keep_last=1, prune_prefix="flat-"))
    dcp.save({"w": torch.ones(2)}, storage_writer=tannery.dcp.Writer(client, "flat-2", keep_last=1, prune_prefix="flat-"))
    assert _checkpoints(client, "flat-") == ["flat-2"]


class _HeldWriter(tannery.dcp.Writer):
    """A Writer whose save stops once its part is stored, before its metadata and Union, until
    ``release`` is set (``reached`` says it got there)."""

    def __init__(self, *args, reached, release, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reached, self.release = reached, release

    def finish(self, metadata, results) -> None:
        self.reached.set()
        assert self.release.wait(TIMEOUT), "never released"
        super().finish(metadata, results)


def test_overlapping_async_saves_with_keep_last_1_both_land_whole(server, client):
    """Save 1 has stored its part when save 2 begins and ends, whose prune (keep_last=1) finds
    that part older than the one checkpoint it keeps: it is still running, so it is left alone,
    and save 1 lands whole after (then prunes save 2's checkpoint, being newer)."""
    import threading

    reached, release = threading.Event(), threading.Event()
    first = _HeldWriter(server.target, "runs/ov/step-1", keep_last=1, reached=reached, release=release)
    second = tannery.dcp.Writer(server.target, "runs/ov/step-2", keep_last=1)
    try:
        saving_1 = dcp.async_save({"model": _state(1), "step": 1}, storage_writer=first)
        assert reached.wait(TIMEOUT)
        parts = [info.name for info in client.list("runs/ov/") if is_save_part(info.name)]
        assert len(parts) == 1 and parts[0].startswith("runs/ov/step-1.rank-0."), parts
        dcp.async_save({"model": _state(2), "step": 2}, storage_writer=second).result(timeout=TIMEOUT)
        _assert_is(_loaded(client, "runs/ov/step-2"), 2)  # landed whole
        assert [info.name for info in second.pruned.deleted] == []  # save 1's part was left alone
        assert parts[0] in [info.name for info in client.list("runs/ov/")]
        release.set()
        saving_1.result(timeout=TIMEOUT)
    finally:
        release.set()
        first.close()
        second.close()
    _assert_is(_loaded(client, "runs/ov/step-1"), 1)  # landed whole too
    assert [info.name for info in first.pruned.deleted] == ["runs/ov/step-2"]  # the older of the two
    assert [info.name for info in client.list("runs/ov/")] == ["runs/ov/step-1"]  # no part left
