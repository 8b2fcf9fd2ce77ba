"""Channels under failure (issue 11): memory bounded whatever the payload size, torn payloads
never returned, stalled publishers bounded by the timeout, undecodable requests refused,
and cancelled calls leaving nothing behind.

Uses the servers and helpers of :mod:`tests.test_channels`; a memory test runs the server
in a subprocess (:class:`tests.server_harness.ServerProcess`) to read its RSS alone.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import pytest
import torch

import tannery
import tannery.aio
from tannery_protocol import codec
from tannery.torch import serialize
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc

from tests.server_harness import ServerProcess
from tests.test_channels import (  # noqa: F401  (serve and serve_bare are fixtures)
    KiB,
    MiB,
    BareChannelsServer,
    Receiver,
    error_of,
    publish,
    run,
    serve,
    serve_bare,
    subscribe,
    wait_until,
)

PUBLISH = "/tannery.v1.Channels/Publish"
SUBSCRIBE = "/tannery.v1.Channels/Subscribe"
#: A SubscribeRequest or PublishRequest whose channel name, b"a\xff\xfe", is not UTF-8.
NOT_UTF8 = bytes.fromhex("0a0361fffe")


def message(channel: str = "", chunk: bytes = b"") -> bytes:
    """A serialized PublishRequest."""
    return channels_pb2.PublishRequest(channel=channel, chunk=chunk).SerializeToString()


def raw_publish(ch: grpc.aio.Channel):
    """Publish taking serialized requests, so a test can send bytes that are not a valid request."""
    return ch.stream_unary(PUBLISH, request_serializer=bytes, response_deserializer=channels_pb2.PublishResponse.FromString)


class HalfPublisher:
    """A Publish call that sends the first half of ``payload``, then waits to be told how to go on."""

    def __init__(self, ch: grpc.aio.Channel, channel: str, payload: bytes, timeout: float | None = None) -> None:
        self.payload = payload
        self.channel = channel
        #: Set to send ``then`` (a serialized request), if any; the call then waits for ever.
        self.go_on = asyncio.Event()
        self.then: bytes | None = None
        self.call = raw_publish(ch)(self._messages(), timeout=timeout)

    async def _messages(self) -> AsyncIterator[bytes]:
        half = len(self.payload) // 2
        for start in range(0, half, MiB):  # messages within gRPC's default limit of 4 MiB
            yield message(self.channel if start == 0 else "", self.payload[start : min(start + MiB, half)])
        await self.go_on.wait()
        if self.then is not None:
            yield self.then
        await asyncio.Event().wait()

    def send(self, request: bytes) -> None:
        self.then = request
        self.go_on.set()

    async def error(self) -> grpc.aio.AioRpcError | None:
        """The call's error (None if it was cancelled here)."""
        try:
            await self.call
        except asyncio.CancelledError:
            return None
        except grpc.aio.AioRpcError as error:
            return error
        raise AssertionError("the half-published call succeeded")


async def first_chunk(receiver: Receiver) -> None:
    """Wait until the subscriber has taken a piece (so it must be told if the payload is abandoned)."""
    response = await receiver.call.read()
    assert response is not grpc.aio.EOF and response.chunk and not response.abandoned
    receiver._ready.extend(bytes(p) for p in receiver.reframer.feed(response.chunk))


async def wait_event(event: threading.Event, what: str, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not event.is_set():
        assert asyncio.get_running_loop().time() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.01)


# -- (a) memory bounded whatever the payload size ----------------------------------------------


def vm_rss(pid: int) -> int:
    """Resident set size of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read the server's RSS")
def test_a_one_gib_payload_leaves_server_memory_within_the_buffers(tmp_path):
    """The old server gathered the whole payload before relaying it (RSS grew by >1 GiB)."""
    buffer, size, chunk = 8 * MiB, 1 << 30, 1 * MiB
    # gRPC's transport buffers and the allocator's free lists take tens of MiB (measured
    # 33-66 MiB of growth for 1 GiB, 87 MiB for 2 GiB, a plateau near 100 MiB for 6 GiB).
    margin = 160 * MiB
    prefix = codec.encode_prefix(codec.dtype_named("uint8"), [size])
    block = os.urandom(chunk)

    def requests():
        yield channels_pb2.PublishRequest(channel="big", chunk=prefix)
        for _ in range(size // chunk):
            yield channels_pb2.PublishRequest(chunk=block)  # the same bytes each time: no memory here

    with ServerProcess(tmp_path / "data", channel_buffer_bytes=buffer) as server, \
            grpc.insecure_channel(server.target) as ch:
        stub = channels_pb2_grpc.ChannelsStub(ch)
        subscription = stub.Subscribe(channels_pb2.SubscribeRequest(channel="big"))
        subscription.initial_metadata()
        baseline = peak = vm_rss(server.pid)
        received = [0]

        def read() -> None:
            for response in subscription:
                received[0] += len(response.chunk)
                if received[0] >= len(prefix) + size:
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        publishing = threading.Thread(target=lambda: received.append(stub.Publish(requests(), timeout=120)))
        publishing.start()
        deadline = time.monotonic() + 120
        while (publishing.is_alive() or reader.is_alive()) and time.monotonic() < deadline:
            peak = max(peak, vm_rss(server.pid))
            time.sleep(0.01)
        subscription.cancel()
    assert received[0] == len(prefix) + size
    assert received[1].payloads == 1 and received[1].dropped_subscribers == 0
    growth = peak - baseline
    assert growth < buffer + margin, (
        f"server RSS grew by {growth / MiB:.0f} MiB ({baseline / MiB:.0f} -> {peak / MiB:.0f} MiB) relaying "
        f"a {size / MiB:.0f} MiB payload; the bound is the {buffer / MiB:.0f} MiB buffer + {margin / MiB:.0f} MiB"
    )


# -- (b) a payload cut off by its publisher never reaches a caller -----------------------------


CUTS = ["cancelled", "deadline", "renamed", "undecodable"]


@pytest.mark.parametrize("cut", CUTS)
def test_a_payload_cut_off_by_its_publisher_is_never_returned_and_the_next_one_is(serve_bare, cut):
    server = serve_bare(chunk_size=64 * KiB)
    torn = serialize(torch.arange(256 * KiB, dtype=torch.float32))  # 1 MiB, many pieces
    after = torch.arange(1000, dtype=torch.int64)

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch, tannery.aio.Client(server.target) as aio_client:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            raw = Receiver(await subscribe(stub, "torn"))
            aio_seen, sync_seen = threading.Event(), threading.Event()
            aio_subscription = await aio_client.subscribe("torn", progress=lambda n: aio_seen.set())
            aio_next = asyncio.create_task(anext(aio_subscription))
            with tannery.Client(server.target) as sync_client:
                sync_subscription = sync_client.subscribe("torn", progress=lambda n: sync_seen.set())
                sync_next = asyncio.create_task(asyncio.to_thread(next, sync_subscription))
                half = HalfPublisher(ch, "torn", torn, timeout=2 if cut == "deadline" else None)
                # Every subscriber has taken some of the payload before it is cut off.
                await first_chunk(raw)
                await wait_event(aio_seen, "the aio subscriber's first chunk")
                await wait_event(sync_seen, "the sync subscriber's first chunk")
                if cut == "cancelled":
                    half.call.cancel()
                elif cut == "renamed":
                    half.send(message("another", torn[len(torn) // 2 :]))
                elif cut == "undecodable":
                    half.send(NOT_UTF8)
                error = await half.error()
                result = await publish(stub, "torn", [serialize(after)])
                got_raw = await raw.payloads(1)
                got_aio = await asyncio.wait_for(aio_next, 10)
                got_sync = await asyncio.wait_for(sync_next, 10)
                sync_subscription.close()
            aio_subscription.close()
            raw.call.cancel()
            return error, result, raw, got_raw, got_aio, got_sync

    error, result, raw, got_raw, got_aio, got_sync = run(scenario())
    expected_code = {"cancelled": None, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                     "renamed": grpc.StatusCode.INVALID_ARGUMENT, "undecodable": grpc.StatusCode.INVALID_ARGUMENT}[cut]
    assert (error.code() if error is not None else None) == expected_code
    assert result.payloads == 1
    assert raw.abandoned == 1, "the subscriber was not told that the payload was abandoned"
    assert got_raw == [serialize(after)]
    assert torch.equal(got_aio, after) and torch.equal(got_sync, after)


def test_a_subscriber_dropped_mid_payload_raises_and_never_returns_the_part_it_got(serve):
    server = serve(channel_buffer_bytes=256 * KiB, channel_timeout_seconds=0.5, chunk_size=64 * KiB)
    small = torch.arange(100, dtype=torch.int64)
    big = torch.zeros(64 * MiB, dtype=torch.uint8)  # far more than the buffer and gRPC's windows take

    async def scenario():
        async with tannery.aio.Client(server.target) as client:
            subscription = await client.subscribe("behind")
            fast = await client.subscribe("behind")
            reading = asyncio.create_task(_take(fast, 2))
            published = await client.publish("behind", [small, big])
            first = await anext(subscription)
            with pytest.raises(tannery.ResourceExhausted) as caught:
                await anext(subscription)
            got_fast = await reading
            fast.close()
            return published, first, caught.value, got_fast

    published, first, error, got_fast = run(scenario())
    assert published.dropped_subscribers == 1
    assert torch.equal(first, small)
    assert "fell behind on channel 'behind'" in str(error) and f"of a {len(serialize(big))}-byte payload" in str(error)
    assert torch.equal(got_fast[0], small) and torch.equal(got_fast[1], big)


async def _take(subscription: Any, count: int) -> list[torch.Tensor]:
    return [await anext(subscription) for _ in range(count)]


def test_a_subscriber_that_joins_mid_payload_starts_with_the_next_payload(serve_bare):
    server = serve_bare(chunk_size=64 * KiB)
    first = serialize(torch.arange(256 * KiB, dtype=torch.float32))
    second = serialize(torch.arange(1000))

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            early = Receiver(await subscribe(stub, "join"))
            half = HalfPublisher(ch, "join", first)
            await first_chunk(early)
            late = Receiver(await subscribe(stub, "join"))
            half.send(message("", first[len(first) // 2 :] + second))
            got_early = await early.payloads(2)
            got_late = await late.payloads(1)
            half.call.cancel()  # its generator never ends; both payloads are whole by now
            first_message = late.chunk_sizes[0]
            early.call.cancel()
            late.call.cancel()
            return got_early, got_late, first_message

    got_early, got_late, first_message = run(scenario())
    assert got_early == [first, second]
    assert got_late == [second], "the late subscriber received (the tail of) the payload in flight"
    assert first_message == len(second)


# -- (c) a publisher stalled mid-payload holds the channel for the timeout at most -------------


def test_a_publisher_stalled_mid_payload_blocks_others_for_the_timeout_at_most(serve):
    timeout = 1.0
    server = serve(channel_timeout_seconds=timeout, chunk_size=64 * KiB)
    stalled = serialize(torch.arange(256 * KiB, dtype=torch.float32))
    after = serialize(torch.arange(1000))

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "stall"))
            half = HalfPublisher(ch, "stall", stalled)
            await first_chunk(receiver)
            started = asyncio.get_running_loop().time()
            result = await publish(stub, "stall", [after])
            waited = asyncio.get_running_loop().time() - started
            error = await half.error()
            got = await receiver.payloads(1)
            receiver.call.cancel()
            return waited, result, error, got, receiver.abandoned

    waited, result, error, got, abandoned = run(scenario())
    assert waited < timeout + 2, f"another publisher waited {waited:.1f} s for a stalled one; the timeout is {timeout:g} s"
    assert result.payloads == 1
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = error.details()
    assert "stalled on channel 'stall'" in details and f"no message for {timeout:g} s" in details
    assert f"of {len(stalled)} bytes sent" in details and "payload 1 of this call" in details
    assert abandoned == 1 and got == [after]


def test_a_publisher_may_pause_between_payloads_longer_than_the_timeout(serve):
    server = serve(channel_timeout_seconds=0.3)
    payloads = [serialize(torch.arange(10 + i)) for i in range(2)]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "pause"))

            async def messages():
                yield message("pause", payloads[0])
                await asyncio.sleep(1.0)  # holds nothing between payloads
                yield message("", payloads[1])

            result = await raw_publish(ch)(messages())
            got = await receiver.payloads(2)
            receiver.call.cancel()
            return result, got

    result, got = run(scenario())
    assert result.payloads == 2 and got == payloads


# -- (d) undecodable requests are INVALID_ARGUMENT naming the problem --------------------------


def refusals(target: str, request: bytes) -> tuple[grpc.RpcError, grpc.RpcError]:
    """The errors of a Subscribe and of a Publish whose (first) request is ``request``, sent as is."""
    with grpc.insecure_channel(target) as ch:
        subscribe_call = ch.unary_stream(SUBSCRIBE, request_serializer=bytes)
        with pytest.raises(grpc.RpcError) as subscribe_error:
            list(subscribe_call(request, timeout=10))
        publish_call = ch.stream_unary(PUBLISH, request_serializer=bytes)
        with pytest.raises(grpc.RpcError) as publish_error:
            publish_call(iter([request]), timeout=10)
    return subscribe_error.value, publish_error.value


BAD_REQUESTS = {
    "non-utf8-channel": (NOT_UTF8, "field channel b'a\\xff\\xfe' is not valid UTF-8"),
    "truncated": (bytes.fromhex("0a05616263"), "is not a valid tannery.v1."),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_undecodable_requests_are_invalid_argument(serve_bare, case):
    server = serve_bare()
    request, words = BAD_REQUESTS[case]
    subscribe_error, publish_error = refusals(server.target, request)
    for error, kind in ((subscribe_error, "SubscribeRequest"), (publish_error, "PublishRequest")):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (kind, error.details())
        assert words in error.details() and kind in error.details()
    assert "the Subscribe request" in subscribe_error.details()
    assert "message 1 of this Publish call" in publish_error.details()
    assert server.subscriber_counts() == {}


def test_the_app_refuses_a_non_utf8_channel_name_with_invalid_argument(serve):
    server = serve()
    for error in refusals(server.target, NOT_UTF8):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not valid UTF-8" in error.details()


# -- (e) cancelled calls leave nothing behind ------------------------------------------------


def hub_state(server: BareChannelsServer) -> dict[str, Any]:
    """What the hub holds: channels (subscribers, publishers, held for a payload, bytes buffered)."""

    async def read() -> dict[str, Any]:
        hub = server.servicer.hub
        return {
            "subscribers": hub.subscribers,
            "channels": {name: (len(c.subscriptions), c.publishers, c.busy, sum(s.buffered for s in c.subscriptions))
                         for name, c in hub.channels.items()},
        }

    return server.call(read())


async def wait_for_state(server: BareChannelsServer, expected: dict[str, Any]) -> None:
    for _ in range(250):
        if hub_state(server) == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the hub holds {hub_state(server)}, expected {expected}")


def test_cancelled_calls_mid_payload_free_the_channel_and_the_hub(serve_bare):
    # A timeout far longer than the test's: anything waiting it out would hang the test.
    server = serve_bare(channel_buffer_bytes=128 * KiB, channel_timeout_seconds=600, chunk_size=16 * KiB)
    payload = serialize(torch.zeros(16 * MiB, dtype=torch.uint8))  # half of it fills gRPC's windows and the buffer

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            # A subscriber cancelled mid-payload; then its publisher, holding the channel.
            reader = Receiver(await subscribe(stub, "e"))
            half = HalfPublisher(ch, "e", payload)
            await first_chunk(reader)
            reader.call.cancel()
            await wait_for_state(server, {"subscribers": 0, "channels": {"e": (0, 1, True, 0)}})
            half.call.cancel()
            await wait_for_state(server, {"subscribers": 0, "channels": {}})
            # A publisher cancelled while it waits for room mid-payload: the subscriber's
            # buffer is emptied of that payload at once and the channel is free.
            stuck = await subscribe(stub, "e")
            half = HalfPublisher(ch, "e", payload)
            await wait_for_state(server, {"subscribers": 1, "channels": {"e": (1, 1, True, 128 * KiB)}})
            half.call.cancel()
            await wait_for_state(server, {"subscribers": 1, "channels": {"e": (1, 0, False, 0)}})
            stuck.cancel()
            await wait_for_state(server, {"subscribers": 0, "channels": {}})
            # The channel takes payloads as before.
            receiver = Receiver(await subscribe(stub, "e"))
            await publish(stub, "e", [serialize(torch.arange(5))])
            got = await receiver.payloads(1)
            receiver.call.cancel()
            await wait_for_state(server, {"subscribers": 0, "channels": {}})
            return got

    assert run(scenario()) == [serialize(torch.arange(5))]
