"""Channel traffic in the metrics, scraped from the real server while the subscriptions are open.

``tannery_channel_payloads_total`` and ``tannery_channel_payload_bytes_total`` count each whole
payload as it moves: in from a publisher (by its transport) or from another replica (nats),
out to each subscriber (by the subscriber's transport: gRPC, the TCP data port, or the
same-host path, where a memory file's size is counted though no byte crosses the socket).
A Subscribe's received and sent bytes show before it ends.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch

import tannery
from tannery.torch import serialize
from tannery_server.metrics import CHANNEL_TRAFFIC

from .server_harness import running_server, wait_for
from .test_metrics import scrape, value

MiB = 1 << 20
TRANSPORTS = ("grpc", "tcp", "local")
#: Subscribers on each transport.
K = 2

pytestmark = pytest.mark.usefixtures("no_client_environment")


def published() -> list[torch.Tensor]:
    """Payloads of several sizes, one over the server's 3 MiB gRPC chunk (several pieces)."""
    return [torch.arange(1000, dtype=torch.float32), torch.ones(5 * MiB // 4), torch.tensor([True, False, True]),
            torch.arange(77, dtype=torch.int64)]


def receive(subscription, count: int, into: list) -> threading.Thread:
    def take() -> None:
        for _, tensor in zip(range(count), subscription):
            into.append(tensor)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def traffic(samples) -> dict[tuple[str, str], tuple[float | None, float | None]]:
    """(payloads, bytes) by (direction, transport)."""
    return {(d, t): (value(samples, "tannery_channel_payloads_total", direction=d, transport=t),
                     value(samples, "tannery_channel_payload_bytes_total", direction=d, transport=t))
            for d, t in CHANNEL_TRAFFIC}


@pytest.mark.parametrize("publisher", TRANSPORTS)
def test_channel_payloads_are_counted_in_and_out_on_every_transport_while_subscribed(tmp_path, publisher):
    sent = published()
    total = sum(len(serialize(t)) for t in sent)
    with running_server(tmp_path) as server, ExitStack() as stack:
        port = server.metrics_port
        subscriptions = []
        for transport in TRANSPORTS:
            for _ in range(K):
                client = stack.enter_context(tannery.Client(server.target, transport=transport))
                assert client.transport == transport
                subscriptions.append(stack.enter_context(client.subscribe("weights")))
        got: list[list[torch.Tensor]] = [[] for _ in subscriptions]
        threads = [receive(s, len(sent), into) for s, into in zip(subscriptions, got)]
        with tannery.Client(server.target, transport=publisher) as writer:
            assert writer.transport == publisher
            result = writer.publish("weights", sent)
        for thread in threads:
            thread.join(30)
        assert (result.payloads, result.nbytes) == (len(sent), total)
        for tensors in got:
            assert len(tensors) == len(sent) and all(torch.equal(a, b) for a, b in zip(tensors, sent))

        expected = {(d, t): (0, 0) for d, t in CHANNEL_TRAFFIC}
        expected["in", publisher] = (len(sent), total)
        for transport in TRANSPORTS:
            expected["out", transport] = (K * len(sent), K * total)
        # A subscriber may hold its last payload a moment before its sender counts it: wait, then exactly.
        wait_for(lambda: traffic(scrape(port)) == expected)
        open_samples = scrape(port)
        assert traffic(open_samples) == expected

        # The Subscribe calls are still running; the gRPC ones' messages are in the sent bytes already.
        open_sent = value(open_samples, "tannery_sent_bytes_total", method="Subscribe")
        assert open_sent is not None and open_sent >= K * total
        assert value(open_samples, "tannery_received_bytes_total", method="Subscribe") > 0
        assert value(open_samples, "tannery_calls_total", method="Subscribe", code="CANCELLED") is None

        stack.close()  # the subscriptions end: their bytes are not counted twice
        assert wait_for(lambda: value(scrape(port), "tannery_calls_total", method="Subscribe",
                                      code="CANCELLED") == len(subscriptions))
        closed = scrape(port)
        assert value(closed, "tannery_sent_bytes_total", method="Subscribe") == open_sent
        assert value(closed, "tannery_received_bytes_total", method="Subscribe") == value(
            open_samples, "tannery_received_bytes_total", method="Subscribe")
        assert traffic(closed) == expected


def test_a_payload_cut_off_by_its_publisher_is_not_counted(tmp_path):
    from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc

    whole = serialize(torch.arange(100, dtype=torch.int32))
    with running_server(tmp_path) as server:
        stub = channels_pb2_grpc.ChannelsStub(server.channel())
        subscription = stub.Subscribe(channels_pb2.SubscribeRequest(channel="cut"))
        subscription.initial_metadata()
        requests = [channels_pb2.PublishRequest(channel="cut", chunk=whole),
                    channels_pb2.PublishRequest(chunk=whole[:40])]  # the second payload ends early
        with pytest.raises(Exception):
            stub.Publish(iter(requests), timeout=30)
        assert wait_for(lambda: traffic(scrape(server.metrics_port))["out", "grpc"] == (1, len(whole)))
        samples = traffic(scrape(server.metrics_port))
        assert samples["in", "grpc"] == (1, len(whole)) and samples["out", "grpc"] == (1, len(whole))
        subscription.cancel()


def test_payloads_from_another_replica_are_counted_in_as_nats_and_out_by_transport(tmp_path, nats_url):
    sent = published()
    total = sum(len(serialize(t)) for t in sent)
    with (running_server(tmp_path / "a", nats=nats_url) as a, running_server(tmp_path / "b", nats=nats_url) as b,
          ExitStack() as stack):
        subscriptions = [stack.enter_context(stack.enter_context(tannery.Client(a.target, transport="grpc")).subscribe("mesh"))]
        for transport in TRANSPORTS:
            for _ in range(K):
                client = stack.enter_context(tannery.Client(b.target, transport=transport))
                subscriptions.append(stack.enter_context(client.subscribe("mesh")))
        got: list[list[torch.Tensor]] = [[] for _ in subscriptions]
        threads = [receive(s, len(sent), into) for s, into in zip(subscriptions, got)]
        with tannery.Client(a.target, transport="grpc") as writer:
            assert writer.publish("mesh", sent).nbytes == total
        for thread in threads:
            thread.join(30)
        assert [len(tensors) for tensors in got] == [len(sent)] * len(subscriptions)

        on_a = {(d, t): (0, 0) for d, t in CHANNEL_TRAFFIC}
        on_a["in", "grpc"] = on_a["out", "grpc"] = (len(sent), total)  # sent to b: tannery_nats_*{out}, not here
        on_b = {(d, t): (0, 0) for d, t in CHANNEL_TRAFFIC}
        on_b["in", "nats"] = (len(sent), total)
        for transport in TRANSPORTS:
            on_b["out", transport] = (K * len(sent), K * total)
        wait_for(lambda: traffic(scrape(a.metrics_port)) == on_a and traffic(scrape(b.metrics_port)) == on_b)
        samples_a, samples_b = scrape(a.metrics_port), scrape(b.metrics_port)
        assert (traffic(samples_a), traffic(samples_b)) == (on_a, on_b)
        assert value(samples_b, "tannery_nats_bytes_total", direction="in") == total
        assert value(samples_a, "tannery_nats_bytes_total", direction="out") == total


def test_a_publish_still_running_shows_its_received_bytes(tmp_path):
    import queue

    from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc

    payload = serialize(torch.arange(4096, dtype=torch.int64))
    with running_server(tmp_path) as server:
        port = server.metrics_port
        stub = channels_pb2_grpc.ChannelsStub(server.channel())
        outbox: queue.Queue = queue.Queue()
        call = stub.Publish.future(iter(outbox.get, None), timeout=60)
        outbox.put(channels_pb2.PublishRequest(channel="long", chunk=payload))
        outbox.put(channels_pb2.PublishRequest(chunk=payload))
        assert wait_for(lambda: traffic(scrape(port))["in", "grpc"] == (2, 2 * len(payload)))
        running = value(scrape(port), "tannery_received_bytes_total", method="Publish")
        assert running is not None and running >= 2 * len(payload)
        assert value(scrape(port), "tannery_calls_total", method="Publish", code="OK") is None
        outbox.put(None)
        assert call.result().payloads == 2
        assert wait_for(lambda: value(scrape(port), "tannery_calls_total", method="Publish", code="OK") == 1)
        assert value(scrape(port), "tannery_received_bytes_total", method="Publish") == running
