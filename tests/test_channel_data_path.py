"""Channels on the same-host data path: payloads passed as sealed memory files, on the real server.

A same-host publisher passes each tensor as one sealed memory file; a same-host subscriber
maps it. Either side may be on gRPC instead, and the promises of channels hold across the
mix: every payload published after a subscription reaches it whole, in order; a subscriber
that stops reading is dropped visibly (RESOURCE_EXHAUSTED) while the others keep up; a
payload that is not a sealed memory file is refused.
"""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch

import tannery
import tannery.aio
from tannery.torch import serialize
from tannery_protocol.datalink import TICKET_KEY, TRANSPORT_KEY, connect_unix, expect, frame
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc
from tannery_protocol.v1.data_pb2 import Hello, SealedPiece

from .server_harness import running_server, wait_for

MiB = 1 << 20
PAIRS = [("local", "local"), ("local", "grpc"), ("grpc", "local")]


#: The caller's TANNERY_* client variables do not apply (conftest.no_client_environment).
pytestmark = pytest.mark.usefixtures("no_client_environment")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("channels"), data_port="off") as running:
        yield running


def tensors() -> list[torch.Tensor]:
    """Payloads of several dtypes and sizes, one over the server's 3 MiB gRPC chunk."""
    generator = torch.Generator().manual_seed(7)
    return [torch.arange(10, dtype=torch.int64), torch.tensor([True, False, True]),
            torch.randn(3, 4, dtype=torch.float64, generator=generator), torch.tensor(2.5),
            torch.randn(5 * MiB // 4, generator=generator), torch.zeros(0, 3)]


def receive(subscription, count: int, into: list) -> threading.Thread:
    def take() -> None:
        for _, tensor in zip(range(count), subscription):
            into.append(tensor)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("publisher, subscriber", PAIRS, ids=[f"{p}-to-{s}" for p, s in PAIRS])
def test_payloads_reach_subscribers_whole_and_in_order_across_paths(server, publisher, subscriber):
    sent = tensors() * 2
    with (tannery.Client(server.target, transport=subscriber) as reader,
          tannery.Client(server.target, transport=publisher) as writer):
        assert (reader.transport, writer.transport) == (subscriber, publisher)
        channel = f"mix-{publisher}-{subscriber}"
        with reader.subscribe(channel) as subscription:
            got: list[torch.Tensor] = []
            thread = receive(subscription, len(sent), got)
            published = writer.publish(channel, sent)
            thread.join(30)
    assert published.payloads == len(sent)
    assert len(got) == len(sent)
    for a, b in zip(got, sent):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_mapped_payload_is_the_publishers_memory_file_not_a_copy(server):
    """The subscriber's tensor is a map of a memory file (/proc/self/maps names it), and
    writing to it does not change what a second subscriber got."""
    with tannery.Client(server.target, transport="local") as client:
        with client.subscribe("shared") as one, client.subscribe("shared") as two:
            got_one: list = []
            got_two: list = []
            threads = [receive(one, 1, got_one), receive(two, 1, got_two)]
            client.publish("shared", [torch.ones(MiB // 4)])
            for thread in threads:
                thread.join(30)
    for tensor in (got_one[0], got_two[0]):
        assert "memfd:tannery-store-publish" in mapping_of(tensor.data_ptr())
    assert got_one[0].data_ptr() != got_two[0].data_ptr()  # two private maps of one file
    got_one[0].fill_(5.0)
    assert torch.equal(got_two[0], torch.ones(MiB // 4))


def mapping_of(address: int) -> str:
    """The line of /proc/self/maps whose range holds ``address`` ('' when none)."""
    for line in open("/proc/self/maps"):
        span = line.split()[0]
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            return line
    return ""


def test_the_aio_client_publishes_and_subscribes_on_the_same_host(server):
    import asyncio

    async def main() -> list[torch.Tensor]:
        async with (tannery.aio.Client(server.target, transport="local") as reader,
                    tannery.aio.Client(server.target, transport="local") as writer):
            assert await reader.transport() == "local"
            subscription = await reader.subscribe("aio")
            sent = tensors()

            async def take() -> list[torch.Tensor]:
                return [await subscription.__anext__() for _ in sent]

            task = asyncio.create_task(take())
            await writer.publish("aio", sent)
            got = await asyncio.wait_for(task, 30)
            subscription.close()
            return got

    got = asyncio.run(main())
    assert all(torch.equal(a, b) for a, b in zip(got, tensors()))


def test_a_same_host_subscriber_that_stops_reading_is_dropped_visibly_while_another_keeps_up(tmp_path):
    with running_server(tmp_path, data_port="off", channel_buffer_bytes=2 * MiB, channel_timeout_seconds=0.5) as server:
        with (tannery.Client(server.target, transport="local") as slow_client,
              tannery.Client(server.target, transport="local") as fast_client):
            slow = slow_client.subscribe("busy")
            with fast_client.subscribe("busy") as fast:
                got: list = []
                sent = [torch.full((MiB // 4,), float(i)) for i in range(12)]
                thread = receive(fast, len(sent), got)
                published = fast_client.publish("busy", sent)
                thread.join(30)
            assert published.dropped_subscribers == 1
            assert [int(t[0]) for t in got] == list(range(12))
            with pytest.raises(tannery.ResourceExhausted, match="fell behind|read nothing"):
                for _ in range(len(sent)):
                    next(slow)
            slow.close()
        assert wait_for(lambda: server.hub.subscribers == 0)


def test_a_piece_that_is_not_a_sealed_memory_file_is_refused(server):
    """A publisher that passes a memory file it could still change gets INVALID_ARGUMENT naming the seals."""
    stub = channels_pb2_grpc.ChannelsStub(server.channel())
    messages_done = threading.Event()

    def requests():
        yield channels_pb2.PublishRequest(channel="unsealed")
        messages_done.wait(10)

    call = stub.Publish.future(requests(), metadata=((TRANSPORT_KEY, "local"),), timeout=20)
    ticket = dict(call.initial_metadata())[TICKET_KEY]
    link = connect_unix(server.data_paths.socket_path)
    expect(link.receive()[0], "welcome")
    link.send(frame(hello=Hello(ticket=bytes.fromhex(ticket))))
    payload = serialize(torch.arange(4))
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.write(fd, payload)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # writes still allowed
    link.send(frame(piece=SealedPiece(size=len(payload))), [fd])
    os.close(fd)
    with pytest.raises(Exception) as raised:
        call.result()
    messages_done.set()
    link.close()
    assert raised.value.code().name == "INVALID_ARGUMENT"
    assert "not sealed" in raised.value.details()


def test_channels_on_a_server_without_a_data_port_refuse_tcp_naming_the_setting(server):
    """Channels take the TCP data path (tests/test_channel_tcp.py) where the server offers one;
    this server's data port is off, and the refusal says so."""
    stub = channels_pb2_grpc.ChannelsStub(server.channel())
    with pytest.raises(Exception) as raised:
        next(iter(stub.Subscribe(channels_pb2.SubscribeRequest(channel="x"), metadata=((TRANSPORT_KEY, "tcp"),),
                                 timeout=10)))
    assert raised.value.code().name == "FAILED_PRECONDITION"
    assert "no tcp data path for channels (--data-port / TANNERY_DATA_PORT is off)" in raised.value.details()


def test_a_closed_same_host_subscription_is_forgotten_by_the_server(tmp_path):
    with running_server(tmp_path, data_port="off") as server, tannery.Client(server.target, transport="local") as client:
        subscription = client.subscribe("leaving")
        assert server.hub.subscribers == 1
        subscription.close()
        assert wait_for(lambda: server.hub.subscribers == 0)
        published = client.publish("leaving", [torch.zeros(3)])  # nobody left to hold it up
        assert published.payloads == 1 and published.dropped_subscribers == 0
