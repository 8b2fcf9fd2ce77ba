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
