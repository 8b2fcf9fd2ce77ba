"""Each whole weight version written once (issue 37): a Publish with ``store_as`` makes the
server store what the channel relays, so a publisher sends a version's bytes once for its
followers and its store. Against a real server on loopback, on every transport."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tannery
from tannery.weights import Follower, Publisher
from tannery_protocol.v1 import channels_pb2

from .server_harness import running_server
from .test_metrics import scrape, value
from .weights_worker import digests

TRANSPORTS = ["grpc", "local", "tcp"]


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=generator),
            "layers.0.weight": torch.randn(64, 64, generator=generator).to(torch.bfloat16),
            "layers.0.bias": torch.randn(64, generator=generator),
            "steps": torch.arange(7, dtype=torch.int64)}


def target() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(0).items()}


def stored(client: tannery.Client, archive: str) -> dict[str, torch.Tensor]:
    fetched = client.fetch(archive)
    return {name: fetched.find(name) for name in fetched.names()}


def run(steps):
    """A call core's steps (here a Publish with ``store_as``, which no public call takes), run."""
    from tannery.client import _run

    return _run(steps)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_whole_version_is_stored_from_what_the_channel_carried_with_no_store_call(tmp_path, transport):
    with running_server(tmp_path) as srv, tannery.Client(srv.target, transport=transport) as client:
        publisher = Publisher(client, "policy", delta=False)
        with Follower(client, "policy", target()) as follower:
            for version in range(3):
                pushed = publisher.push(state(version), version)
                assert pushed.streamed and not pushed.delta
                assert next(iter(follower)).version == version
        samples = scrape(srv.metrics_port)
        assert value(samples, "tannery_calls_total", method="Store", code="OK") is None
        assert value(samples, "tannery_calls_total", method="Publish", code="OK") == 3
        for version in range(3):
            assert digests(stored(client, f"policy/v{version}")) == digests(state(version))
        description = client.describe("policy/v2")
        assert description.metadata["tannery.weights.version"] == "2"
        assert client.resolve("policy") == "policy/v2"


def test_a_publish_with_store_as_stores_only_the_named_payloads_and_answers_the_archive(server):
    tensors = [torch.arange(5, dtype=torch.uint8), torch.ones(3, 4), torch.full((2,), 7, dtype=torch.int32)]
    store_as = channels_pb2.StoreAs(archive="kept", metadata={"why": "test"}, entries=["", "ones", "sevens"])
    with tannery.Client(server.target) as client, client.subscribe("ch") as subscription:
        published = run(client._publish("ch", tensors, None, store_as))
        got = [next(subscription) for _ in tensors]
        assert [t.tolist() for t in got] == [t.tolist() for t in tensors]
        assert published.stored is not None and published.store_error == ""
        assert (published.stored.name, published.stored.entries) == ("kept", 2)
        archive = stored(client, "kept")
        assert sorted(archive) == ["ones", "sevens"]
        assert torch.equal(archive["ones"], tensors[1]) and torch.equal(archive["sevens"], tensors[2])
        assert client.describe("kept").metadata == {"why": "test"}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_store_that_cannot_be_made_leaves_the_publish_whole_and_says_why(server, transport):
    """A name holding other content: the payloads reach the subscriber all the same; nothing is
    stored, and the answer names the archive and the difference."""
    with tannery.Client(server.target, transport=transport) as client:
        client.store("taken", {"x": torch.zeros(2)})
        store_as = channels_pb2.StoreAs(archive="taken", entries=["x"])
        with client.subscribe("ch") as subscription:
            published = run(client._publish("ch", [torch.ones(2)], None, store_as))
            assert torch.equal(next(subscription), torch.ones(2))
        assert published.stored is None
        assert "taken" in published.store_error and "exists" in published.store_error
        assert torch.equal(stored(client, "taken")["x"], torch.zeros(2))


def test_store_as_naming_a_payload_that_never_came_stores_nothing(server):
    with tannery.Client(server.target) as client:
        store_as = channels_pb2.StoreAs(archive="short", entries=["a", "b"])
        published = run(client._publish("ch", [torch.ones(2)], None, store_as))
        assert published.stored is None and "'b' never came" in published.store_error
        assert [info.name for info in client.list()] == []


def test_a_bad_archive_name_in_store_as_refuses_the_publish_before_any_payload(server):
    with tannery.Client(server.target) as client:
        store_as = channels_pb2.StoreAs(archive="bad\x00name", entries=["a"])
        with pytest.raises(tannery.ServiceError, match="archive name"):
            run(client._publish("ch", [torch.ones(2)], None, store_as))


def test_a_server_that_does_not_store_what_it_relays_gets_a_store_call(tmp_path, monkeypatch):
    """A server from before store_as ignores it: the publisher stores the version itself."""
    import tannery_server.channels

    async def not_storing(factory, first):
        return None

    monkeypatch.setattr(tannery_server.channels, "open_store", not_storing)
    with running_server(tmp_path) as srv, tannery.Client(srv.target) as client:
        Publisher(client, "policy", delta=False).push(state(1), 0)
        assert value(scrape(srv.metrics_port), "tannery_calls_total", method="Store", code="OK") == 1
        assert digests(stored(client, "policy/v0")) == digests(state(1))


PUBLISHER = """
import sys, torch, tannery
from tannery.weights import Publisher
big = {f"layer.{i}": torch.randn(1 << 20) for i in range(48)}  # 192 MiB, slow enough to be killed in
with tannery.Client(sys.argv[1], transport=sys.argv[2]) as client:
    print("pushing", flush=True)
    Publisher(client, "killed", delta=False).push(big, 0)
"""


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_publisher_killed_mid_version_stores_nothing(tmp_path, transport):
    with running_server(tmp_path) as srv, tannery.Client(srv.target) as client:
        with client.subscribe("killed") as subscription:
            child = subprocess.Popen([sys.executable, "-c", PUBLISHER, srv.target, transport],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            try:
                assert child.stdout.readline().strip() == "pushing"
                next(subscription)  # the manifest came: the version is on its way
                os.kill(child.pid, signal.SIGKILL)
            finally:
                child.wait(timeout=60)
        deadline = time.monotonic() + 20  # until the server has ended the cut-off Publish
        while time.monotonic() < deadline and not publishes_ended(srv):
            time.sleep(0.05)
        assert publishes_ended(srv)
        time.sleep(0.5)  # the removal runs after the call's end
        assert [info.name for info in client.list()] == []
        data = tmp_path / "data"
        assert sorted(p.name for p in (data / "tmp").iterdir()) == []
        assert [p.name for p in (data / "blobs").rglob("*") if p.is_file()] == []


def publishes_ended(srv) -> float:
    samples = scrape(srv.metrics_port)
    return sum(count for (name, labels), count in samples.items()
               if name == "tannery_calls_total" and ("method", "Publish") in labels)


def test_a_full_disk_stops_the_store_not_the_followers_and_the_push_names_the_disk(tmp_path):
    """On a 24 MiB tmpfs, a 32 MiB version reaches the follower on the channel; the server's
    store of it fails (no space), removes what it wrote, and the publisher's own Store meets the
    same refusal, which push raises: RESOURCE_EXHAUSTED naming the disk. Nothing partial stays."""
    from .server_harness import mounted_tmpfs
    from .test_full_disk import DISK, assert_names_the_disk

    big = {f"layer.{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB: more than the disk holds
    with mounted_tmpfs(tmp_path / "disk", str(DISK)) as disk, running_server(tmp_path, data_dir=disk / "data") as srv:
        with tannery.Client(srv.target) as client:
            held = {k: torch.zeros_like(v) for k, v in big.items()}
            with Follower(client, "policy", held) as follower:
                with pytest.raises(tannery.ResourceExhausted) as refused:
                    Publisher(client, "policy", delta=False).push(big, 0)
                applied = next(iter(follower))
                assert (applied.version, applied.via) == (0, "channel")
                assert digests(held) == digests(big)
            assert_names_the_disk(str(refused.value), srv.data_dir)
            assert client.list() == []
            assert list((srv.data_dir / "tmp").iterdir()) == []
            assert [p for p in (srv.data_dir / "blobs").rglob("*") if p.is_file()] == []
