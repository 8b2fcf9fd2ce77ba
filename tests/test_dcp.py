"""tannery.dcp: torch.distributed.checkpoint's save and load through a real server."""

from __future__ import annotations

import os
import signal
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import tannery
import tannery.dcp
from tests.server_harness import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("dcp")) as server:
        yield server


@pytest.fixture()
def client(server):
    with tannery.Client(server.target) as client:
        yield client


# -- one process ---------------------------------------------------------------------------


def test_save_load_plain_nested_and_bytes(client):
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int64),
                  "blocks": {"0": {"h": torch.randn(2, 2, dtype=torch.float64)}}},
        "scalar": torch.tensor(3.5),
        "step": 12,
        "extra": {"name": "run-1", "lrs": [0.1, 0.01]},
    }
    dcp.save(state, storage_writer=tannery.dcp.Writer(client, "ckpt/one"))

    names = client.archive("ckpt/one").names()
    assert "model.w" in names and "model.blocks.0.h" in names and tannery.dcp.METADATA_ENTRY in names
    assert not [info.name for info in client.list("ckpt/one.")]  # the parts are gone

    target = {
        "model": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64),
                  "blocks": {"0": {"h": torch.zeros(2, 2, dtype=torch.float64)}}},
        "scalar": torch.tensor(0.0),
        "step": 0,
        "extra": {"name": "", "lrs": []},
    }
    dcp.load(target, storage_reader=tannery.dcp.Reader(client, "ckpt/one"))
    for key in ("w", "b"):
        assert torch.equal(target["model"][key], state["model"][key])
    assert torch.equal(target["model"]["blocks"]["0"]["h"], state["model"]["blocks"]["0"]["h"])
    assert torch.equal(target["scalar"], state["scalar"])
    assert target["step"] == 12
    assert target["extra"] == {"name": "run-1", "lrs": [0.1, 0.01]}

    # An ordinary archive: its entries read as they were saved.
    assert torch.equal(client.archive("ckpt/one").rows("model.w", 0, 5), state["model"]["w"])


def test_save_refuses_an_existing_archive_unless_replace(client):
    dcp.save({"w": torch.ones(2)}, storage_writer=tannery.dcp.Writer(client, "ckpt/again"))
    with pytest.raises(BaseException, match="exists"):  # DCP raises CheckpointException, a BaseException
        dcp.save({"w": torch.zeros(2)}, storage_writer=tannery.dcp.Writer(client, "ckpt/again"))
    dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=tannery.dcp.Writer(client, "ckpt/again", replace=True))
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=tannery.dcp.Reader(client.target, "ckpt/again"))
    assert torch.equal(got["w"], torch.full((2,), 2.0))


# -- several processes (gloo on the CPU, DTensors sharded on dim 0) ------------------------

SHAPES = {"layer1.weight": (96, 64), "layer1.bias": (96,), "layer2.weight": (48, 96), "emb.weight": (120, 64)}
TIMEOUT = 60


def _full() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(17)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init(rank: int, world: int, port: int):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    return init_device_mesh("cpu", (world,))


def _sharded(tensors: dict[str, torch.Tensor], mesh, dim: int = 0) -> dict[str, torch.Tensor]:
    """Each tensor sharded on ``dim`` (on dim 0 when it has fewer dims)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {name: distribute_tensor(tensor, mesh, [Shard(min(dim, tensor.dim() - 1))])
            for name, tensor in tensors.items()}


class _KillingWriter(tannery.dcp.Writer):
    """A Writer whose rank ``victim`` is killed (SIGKILL) once it has stored its part."""

    def __init__(self, *args, victim: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim = victim

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if self.rank == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def _save_worker(rank: int, world: int, port: int, target: str, archive: str, victim: int | None, results) -> None:
    try:
        mesh = _init(rank, world, port)
        state = {"model": _sharded(_full(), mesh), "step": 7}
        if victim is None:
            writer = tannery.dcp.Writer(target, archive)
        else:
            writer = _KillingWriter(target, archive, victim=victim)
        dcp.save(state, storage_writer=writer)
        results.put((rank, "ok", None))
    except BaseException as exc:  # CheckpointException is a BaseException
        results.put((rank, "failed", repr(exc)[:300]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, target: str, archive: str, dim: int, results) -> None:
    try:
        mesh = _init(rank, world, port)
        full = _full()
        state = {"model": _sharded({name: torch.zeros_like(t) for name, t in full.items()}, mesh, dim), "step": 0}
        fetched = [0]

        def progress(nbytes: int) -> None:
            fetched[0] += nbytes

        dcp.load(state, storage_reader=tannery.dcp.Reader(target, archive, progress=progress))
        wrong = []
        for name, expected in full.items():
            got = state["model"][name]
            if not torch.equal(got.full_tensor(), expected):
                wrong.append(name)
        results.put((rank, "ok", {"fetched": fetched[0], "wrong": wrong, "step": state["step"]}))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)[:300]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(worker, world: int, *args) -> dict[int, tuple[str, object]]:
    """``worker(rank, world, port, *args, results)`` in ``world`` spawned processes: each
    rank's (status, answer); a rank that put nothing (killed) is absent. Run again on another
    port when the free port picked for the process group was taken meanwhile."""
    for _ in range(3):
        answers = _run_once(worker, world, *args)
        if not any(status == "failed" and "address already in use" in str(answer).lower()
                   for status, answer in answers.values()):
            break
    return answers


def _run_once(worker, world: int, *args) -> dict[int, tuple[str, object]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, results), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    answers: dict[int, tuple[str, object]] = {}
    try:
        for proc in procs:
            proc.join(TIMEOUT)
        while len(answers) < world:
            try:
                rank, status, answer = results.get(timeout=1)
            except Exception:
                break
            answers[rank] = (status, answer)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return answers


@pytest.mark.slow
def test_sharded_save_on_two_ranks_loads_into_three_and_into_one(server, client):
    archive = "ckpt/sharded"
    saved = _run(_save_worker, 2, server.target, archive, None)
    assert saved == {0: ("ok", None), 1: ("ok", None)}

    names = client.archive(archive).names()
    assert "layer1.weight" not in names and "model.layer1.weight[0:48,0:64]" in names
    assert "model.layer1.weight[48:96,0:64]" in names and "step" in names
    assert not [info.name for info in client.list(archive + ".")]  # the ranks' parts are gone

    loaded = _run(_load_worker, 3, server.target, archive, 0)
    assert sorted(loaded) == [0, 1, 2], loaded
    for rank, (status, answer) in loaded.items():
        assert status == "ok", (rank, answer)
        assert answer["wrong"] == [] and answer["step"] == 7, (rank, answer)

    # Each rank fetched its third of the tensors (plus the metadata, the bytes items and each
    # payload's header, some 50 bytes), not all of them.
    total = sum(t.numel() * t.element_size() for t in _full().values())
    extra = client.describe(archive)
    small = sum(e.nbytes for e in extra.entries if e.name in (tannery.dcp.METADATA_ENTRY, "step"))
    for rank, (_, answer) in loaded.items():
        assert total / 3 <= answer["fetched"] <= total / 3 + small + 1024, (rank, answer["fetched"], total, small)
        assert answer["fetched"] < total / 2

    # Into 2 ranks sharded on dim 1: no request covers whole rows, so entries are fetched
    # whole and narrowed.
    loaded = _run(_load_worker, 2, server.target, archive, 1)
    assert sorted(loaded) == [0, 1], loaded
    for rank, (status, answer) in loaded.items():
        assert status == "ok", (rank, answer)
        assert answer["wrong"] == [] and answer["step"] == 7, (rank, answer)

    # Into one process, as plain tensors.
    full = _full()
    state = {"model": {name: torch.zeros_like(t) for name, t in full.items()}, "step": 0}
    dcp.load(state, storage_reader=tannery.dcp.Reader(client, archive))
    for name, expected in full.items():
        assert torch.equal(state["model"][name], expected), name
    assert state["step"] == 7


@pytest.mark.slow
def test_a_rank_killed_during_save_leaves_no_checkpoint(server, client):
    archive = "ckpt/killed"
    answers = _run(_save_worker, 2, server.target, archive, 1)
    assert 1 not in answers  # killed
    assert answers.get(0, ("failed",))[0] == "failed", answers
    assert not [info.name for info in client.list(archive) if info.name == archive]
    # The victim had stored its part before it died: only the final archive is missing.
    assert [info.name for info in client.list(archive + ".rank-1.")]
