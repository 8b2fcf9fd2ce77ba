"""Channels on the TCP data path, on the real server: publishers and subscribers on the data port.

A TCP publisher sends each payload's raw bytes on its data connection; a TCP subscriber
receives every piece as raw bytes, the same piece objects for every subscriber. The
promises of channels hold across every mix of gRPC, same-host and TCP peers on one channel:
every payload published after a subscription reaches it whole, bit-exact and in order; a
subscriber that stops reading is dropped visibly (RESOURCE_EXHAUSTED) while the others keep
up; a payload cut off by its publisher is never returned, not even in part; a data
connection presents its call's ticket (and TLS, tokens) as a TCP Fetch does; and the
server's memory is the subscribers' buffers whatever the size of a payload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery.torch import serialize
from tannery_protocol.datalink import TICKET_KEY, TRANSPORT_KEY, expect, frame
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc
from tannery_protocol.v1.data_pb2 import EntryBytes, Hello

from .channel_peers import MiB, RawPublisher, RawSubscriber, data_route, digest
from .server_harness import ServerProcess, running_server, wait_for
from .test_channels_failures import vm_rss
from .test_security import READ_TOKEN, WRITE_TOKEN, pki  # noqa: F401  (pki: a fixture)

#: (publisher, subscriber) transports with TCP on at least one side.
PAIRS = [("tcp", "tcp"), ("tcp", "grpc"), ("tcp", "local"), ("grpc", "tcp"), ("local", "tcp")]
ROOT = Path(__file__).resolve().parent.parent

#: The caller's TANNERY_* client variables do not apply (conftest.no_client_environment).
pytestmark = pytest.mark.usefixtures("no_client_environment")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("channels-tcp")) as running:
        yield running


def tensors() -> list[torch.Tensor]:
    """Payloads of several dtypes and sizes, one over the server's 1 MiB chunk (several pieces)."""
    generator = torch.Generator().manual_seed(11)
    return [torch.arange(10, dtype=torch.int64), torch.tensor([True, False, True]),
            torch.randn(3, 4, dtype=torch.float64, generator=generator), torch.tensor(2.5),
            torch.randn(5 * MiB // 4, generator=generator), torch.zeros(0, 3),
            torch.randint(0, 255, (3 * MiB + 7,), dtype=torch.uint8, generator=generator)]


def receive(subscription, count: int, into: list) -> threading.Thread:
    def take() -> None:
        for _, tensor in zip(range(count), subscription):
            into.append(tensor)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def assert_same(got: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
    assert len(got) == len(sent), f"{len(got)} tensors received of {len(sent)}"
    for index, (a, b) in enumerate(zip(got, sent)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"tensor {index} differs"


# -- every mix, whole and in order -----------------------------------------------------------------


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
            thread.join(60)
    assert published.payloads == len(sent) and published.dropped_subscribers == 0
    assert_same(got, sent)


def test_a_tcp_subscriber_gathers_payloads_published_in_chunks_of_any_size(server):
    """A raw gRPC publisher cuts its stream anywhere (7 bytes, a header split in two, the end of
    one payload and the start of the next in one chunk): the TCP subscriber's pieces start and
    end where the server relays them, and each payload still comes whole."""
    sent = [torch.arange(300, dtype=torch.int16), torch.randn(3 * MiB // 4 + 5), torch.tensor(True)]
    stream = b"".join(serialize(t) for t in sent)
    cuts = [0, 7, 20, 61, 600, 700 + MiB, 2 * MiB + 3, len(stream)]
    chunks = [stream[a:b] for a, b in zip(cuts, cuts[1:])]
    stub = channels_pb2_grpc.ChannelsStub(server.channel())
    with tannery.Client(server.target, transport="tcp") as reader, reader.subscribe("cuts") as subscription:
        got: list = []
        thread = receive(subscription, len(sent), got)
        requests = [channels_pb2.PublishRequest(channel="cuts", chunk=chunks[0])]
        requests += [channels_pb2.PublishRequest(chunk=chunk) for chunk in chunks[1:]]
        assert stub.Publish(iter(requests), timeout=30).payloads == len(sent)
        thread.join(30)
    assert_same(got, sent)


def test_subscriber_processes_of_every_path_get_every_publishers_payloads_bit_exact_in_order(server):
    """Three subscriber processes (TCP, gRPC, same host) on one channel; TCP, gRPC and same-host
    publishers take turns on it. Each process reports the SHA-256 of every tensor it got."""
    batches = {transport: [torch.randn(MiB // 4 + 3 * i) * i for i in range(3)] + [torch.arange(i + 1)]
               for i, transport in enumerate(("tcp", "grpc", "local"))}
    sent = [tensor for batch in batches.values() for tensor in batch]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("protocol", "client", "service", "."))}
    env = {k: v for k, v in env.items() if not k.startswith("TANNERY_")}
    processes = {t: subprocess.Popen([sys.executable, "-m", "tests.channel_peers", "subscribe", server.target, t,
                                      "turns", str(len(sent))], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                 for t in ("tcp", "grpc", "local")}
    try:
        for transport, process in processes.items():
            assert json.loads(process.stdout.readline()) == {"ready": transport}
        for transport, batch in batches.items():
            with tannery.Client(server.target, transport=transport) as writer:
                assert writer.publish("turns", batch).payloads == len(batch)
        expected = [digest(tensor) for tensor in sent]
        for transport, process in processes.items():
            got = [json.loads(process.stdout.readline()) for _ in sent]
            assert got == expected, f"the {transport} subscriber process got other tensors"
            assert process.wait(30) == 0
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_the_aio_client_publishes_and_subscribes_over_tcp(server):
    import asyncio

    async def main() -> list[torch.Tensor]:
        async with (tannery.aio.Client(server.target, transport="tcp") as reader,
                    tannery.aio.Client(server.target, transport="tcp") as writer):
            assert await reader.transport() == "tcp"
            subscription = await reader.subscribe("aio-tcp")
            sent = tensors()

            async def take() -> list[torch.Tensor]:
                return [await subscription.__anext__() for _ in sent]

            task = asyncio.create_task(take())

            async def produce():
                for tensor in sent:
                    yield tensor

            await writer.publish("aio-tcp", produce())
            got = await asyncio.wait_for(task, 60)
            subscription.close()
            return got

    assert_same(asyncio.run(main()), tensors())


def test_auto_takes_tcp_where_the_socket_is_not_reachable(tmp_path):
    """A server whose same-host socket is off, as one on another host is: auto takes the data port."""
    with running_server(tmp_path, socket="off") as server, tannery.Client(server.target) as client:
        assert client.transport == "tcp"
        with client.subscribe("auto") as subscription:
            got: list = []
            thread = receive(subscription, 2, got)
            client.publish("auto", tensors()[:2])
            thread.join(30)
        assert_same(got, tensors()[:2])


def test_a_tcp_publisher_on_one_replica_reaches_tcp_subscribers_on_another_through_nats(tmp_path, nats_url):
    """Payloads over NATS's 256 KiB message limit too: each crosses in chunks and arrives whole."""
    with (running_server(tmp_path / "a", nats=nats_url) as a, running_server(tmp_path / "b", nats=nats_url) as b,
          tannery.Client(a.target, transport="tcp") as writer, tannery.Client(b.target, transport="tcp") as reader,
          tannery.Client(a.target, transport="tcp") as near):
        with reader.subscribe("across") as far, near.subscribe("across") as here:
            got_far: list = []
            got_here: list = []
            sent = tensors()
            threads = [receive(far, len(sent), got_far), receive(here, len(sent), got_here)]
            writer.publish("across", sent)
            for thread in threads:
                thread.join(60)
    assert_same(got_far, sent)
    assert_same(got_here, sent)


# -- falling behind, cut-off payloads ---------------------------------------------------------------


def test_a_tcp_subscriber_that_stops_reading_is_dropped_visibly_while_others_keep_up(tmp_path):
    with running_server(tmp_path, channel_buffer_bytes=2 * MiB, channel_timeout_seconds=0.5) as server:
        with (tannery.Client(server.target, transport="tcp") as slow_client,
              tannery.Client(server.target, transport="tcp") as fast_client,
              tannery.Client(server.target, transport="grpc") as grpc_client):
            slow = slow_client.subscribe("busy")
            with fast_client.subscribe("busy") as fast, grpc_client.subscribe("busy") as other:
                got: list = []
                got_other: list = []
                # More than the socket buffers of the slow subscriber's connection hold.
                sent = [torch.full((MiB // 4,), float(i)) for i in range(64)]
                threads = [receive(fast, len(sent), got), receive(other, len(sent), got_other)]
                published = fast_client.publish("busy", sent)
                for thread in threads:
                    thread.join(60)
            assert published.dropped_subscribers == 1
            assert [int(t[0]) for t in got] == list(range(64)) == [int(t[0]) for t in got_other]
            received = []
            with pytest.raises(tannery.ResourceExhausted, match="fell behind|read nothing") as raised:
                for _ in range(len(sent)):
                    received.append(int(next(slow)[0]))
            assert "'busy'" in str(raised.value)  # the message names the channel
            assert received == list(range(len(received))) and len(received) < len(sent)  # a prefix, in order
            slow.close()
        assert wait_for(lambda: server.hub.subscribers == 0)


def test_a_tcp_publisher_killed_mid_payload_leaves_no_subscriber_a_torn_payload(server):
    """Killed (SIGKILL) after half of a 16 MiB payload: every subscriber, whatever its path, gets
    the payloads before and after it whole, and nothing of it."""
    readers = {t: tannery.Client(server.target, transport=t) for t in ("tcp", "grpc", "local")}
    subscriptions = {t: client.subscribe("killed") for t, client in readers.items()}
    raw = RawSubscriber(server.target, "killed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("protocol", "client", "service", "."))}
    try:
        got: dict[str, list] = {t: [] for t in subscriptions}
        threads = [receive(s, 2, got[t]) for t, s in subscriptions.items()]
        with tannery.Client(server.target, transport="tcp") as writer:
            writer.publish("killed", [torch.arange(5)])
            publisher = subprocess.Popen([sys.executable, "-m", "tests.channel_peers", "publish-half", server.target,
                                          "killed", str(16 * MiB)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                         env=env)
            try:
                assert publisher.stdout.readline().strip() == "half"
                raw.read_bytes(len(serialize(torch.arange(5))) + 4 * MiB)  # the first payload, some of the cut one
                publisher.send_signal(signal.SIGKILL)
                publisher.wait(30)
            finally:
                publisher.kill()
            writer.publish("killed", [torch.arange(7)])
        for thread in threads:
            thread.join(30)
        for transport, tensors_got in got.items():
            assert [t.tolist() for t in tensors_got] == [list(range(5)), list(range(7))], transport
        # The raw subscriber reads what it was sent of the cut payload, then is told to discard
        # it (in at most its 16 pieces of 1 MiB), then gets the next payload whole (one piece).
        while raw.read_frame() != "abandoned":
            assert len(raw.frames) < 1 + 16, "the raw TCP subscriber was not told to discard the cut-off payload"
        assert raw.read_frame() == "entry" and raw.bytes < len(serialize(torch.arange(5))) + 8 * MiB + 100
    finally:
        raw.close()
        for subscription in subscriptions.values():
            subscription.close()
        for client in readers.values():
            client.close()


def test_a_tcp_publisher_that_stalls_mid_payload_is_cut_off_naming_the_channel(tmp_path):
    with running_server(tmp_path, channel_timeout_seconds=0.5) as server:
        publisher = RawPublisher(server.target, "stalled")
        try:
            publisher.send_payload(4 * MiB, stop_after=MiB)
            with pytest.raises(grpc.RpcError) as raised:
                publisher.call.result(timeout=30)
        finally:
            publisher.close()
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "publisher stalled on channel 'stalled'" in raised.value.details()
    assert f"1048576 of {4 * MiB} bytes sent" in raised.value.details()


def test_a_payload_whose_header_disagrees_with_its_entry_frame_is_refused(server):
    publisher = RawPublisher(server.target, "liar")
    try:
        publisher.link.send(frame(entry=EntryBytes(payload_bytes=MiB)))
        publisher.link.send_bytes(bytes(MiB))  # no header: zeros
        with pytest.raises(grpc.RpcError) as raised:
            publisher.call.result(timeout=30)
    finally:
        publisher.close()
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "payload 1 of this call is malformed" in raised.value.details()


def test_a_data_connection_closed_mid_payload_ends_the_publish_unavailable_naming_it(server):
    publisher = RawPublisher(server.target, "closed")
    try:
        publisher.send_payload(4 * MiB, stop_after=MiB)
        publisher.link.close()
        with pytest.raises(grpc.RpcError) as raised:
            publisher.call.result(timeout=30)
    finally:
        publisher.close()
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    assert f"closed by the publisher after 1048576 of {4 * MiB} bytes of payload 1" in raised.value.details()


def test_an_entry_frame_of_no_bytes_is_refused(server):
    publisher = RawPublisher(server.target, "empty")
    try:
        publisher.link.send(frame(entry=EntryBytes(payload_bytes=0)))
        with pytest.raises(grpc.RpcError) as raised:
            publisher.call.result(timeout=30)
    finally:
        publisher.close()
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "payload 1 of this call is malformed: an entry frame of 0 bytes" in raised.value.details()


def test_a_closed_tcp_subscription_is_forgotten_by_the_server(tmp_path):
    with running_server(tmp_path) as server, tannery.Client(server.target, transport="tcp") as client:
        subscription = client.subscribe("leaving")
        assert server.hub.subscribers == 1
        subscription.close()
        assert wait_for(lambda: server.hub.subscribers == 0)
        published = client.publish("leaving", [torch.zeros(3)])  # nobody left to hold it up
        assert published.payloads == 1 and published.dropped_subscribers == 0


def test_a_tcp_subscriber_hears_that_the_server_shuts_down(tmp_path):
    with running_server(tmp_path) as server, tannery.Client(server.target, transport="tcp", retries=0) as client:
        subscription = client.subscribe("closing")
        server.stop()
        with pytest.raises(tannery.Unavailable, match="shutting down"):
            next(subscription)
        subscription.close()


# -- tickets, tokens, TLS ---------------------------------------------------------------------------


def test_a_channel_data_connection_presents_its_calls_ticket(server):
    """A made-up ticket, and a same-host ticket, are refused on the data port; the call's own works once."""
    stub = channels_pb2_grpc.ChannelsStub(server.channel())
    call = stub.Subscribe(channels_pb2.SubscribeRequest(channel="tickets"), metadata=((TRANSPORT_KEY, "tcp"),),
                          timeout=60)
    ticket = bytes.fromhex(dict(call.initial_metadata())[TICKET_KEY])
    local_call = stub.Subscribe(channels_pb2.SubscribeRequest(channel="tickets"),
                                metadata=((TRANSPORT_KEY, "local"),), timeout=60)
    local_ticket = bytes.fromhex(dict(local_call.initial_metadata())[TICKET_KEY])
    route = data_route(server.channel())
    for wrong, message in ((os.urandom(16), "unknown ticket"),
                           (local_ticket, "a ticket for the local data path, presented on the tcp one")):
        with route.open() as link:
            link.send(frame(hello=Hello(ticket=wrong)))
            answer, _ = link.receive()
            assert answer.WhichOneof("kind") == "failure", answer
            assert answer.failure.code == "PERMISSION_DENIED" and message in answer.failure.message
    local_call.cancel()
    with route.connect(ticket.hex()) as link:  # the call's own ticket: its payloads come
        with tannery.Client(server.target, transport="grpc") as writer:
            writer.publish("tickets", [torch.arange(3)])
        received, _ = link.receive()
        assert expect(received, "entry") == "entry" and received.entry.payload_bytes > 0
    call.cancel()


def test_tokens_and_tls_hold_on_the_channels_data_port(tmp_path, pki):  # noqa: F811
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{WRITE_TOKEN} write\n{READ_TOKEN} read\n")
    tls = tannery.TLS(ca=pki["ca"])
    with running_server(tmp_path, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                        tokens_file=tokens) as server:
        with (tannery.Client(server.target, token=READ_TOKEN, tls=tls, transport="tcp") as reader,
              tannery.Client(server.target, token=WRITE_TOKEN, tls=tls, transport="tcp") as writer,
              tannery.Client(server.target, token=WRITE_TOKEN, tls=tls, transport="local") as local_writer):
            with pytest.raises(tannery.PermissionDenied, match="Publish needs a write token"):
                reader.publish("secure", [torch.arange(3)])
            with tannery.Client(server.target, tls=tls, transport="tcp") as anonymous:
                with pytest.raises(tannery.Unauthenticated, match="needs a token"):
                    anonymous.subscribe("secure")
            sent = tensors()
            with reader.subscribe("secure") as subscription:
                got: list = []
                thread = receive(subscription, 2 * len(sent), got)
                writer.publish("secure", sent)  # TLS both ways
                local_writer.publish("secure", sent)  # a memory file sent through TLS (no sendfile there)
                thread.join(60)
            assert_same(got, sent * 2)


# -- memory ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read the server's RSS")
def test_a_one_gib_tcp_payload_to_three_tcp_subscribers_leaves_server_memory_within_the_buffers(tmp_path):
    """Relayed as it arrives, each piece shared by the subscribers: not the payload, not a copy each."""
    buffer, size = 8 * MiB, 1 << 30
    margin = 160 * MiB  # gRPC's and the allocator's own, as test_channels_failures' gRPC case measured
    with ServerProcess(tmp_path / "data", channel_buffer_bytes=buffer) as server:
        subscribers = [RawSubscriber(server.target, "big") for _ in range(3)]
        baseline = peak = vm_rss(server.pid)
        readers = [threading.Thread(target=s.read_bytes, args=(size,), daemon=True) for s in subscribers]
        for reader in readers:
            reader.start()
        publisher = RawPublisher(server.target, "big")
        answer: list = []

        def publish() -> None:
            publisher.send_payload(size, block=os.urandom(MiB))
            answer.append(publisher.finish())

        publishing = threading.Thread(target=publish, daemon=True)
        publishing.start()
        deadline = time.monotonic() + 180
        while (publishing.is_alive() or any(r.is_alive() for r in readers)) and time.monotonic() < deadline:
            peak = max(peak, vm_rss(server.pid))
            time.sleep(0.01)
        for subscriber in subscribers:
            subscriber.close()
    assert [s.bytes for s in subscribers] == [size] * 3
    assert answer and answer[0].payloads == 1 and answer[0].dropped_subscribers == 0
    growth = peak - baseline
    print(f"server RSS growth relaying 1 GiB over TCP to 3 TCP subscribers: {growth / MiB:.0f} MiB")
    assert growth < buffer * 3 + margin, (
        f"server RSS grew by {growth / MiB:.0f} MiB ({baseline / MiB:.0f} -> {peak / MiB:.0f} MiB) relaying a "
        f"{size / MiB:.0f} MiB payload to 3 TCP subscribers; the bound is 3 buffers of {buffer / MiB:.0f} MiB + "
        f"{margin / MiB:.0f} MiB")
