"""The Channels service against a real grpc.aio server on loopback, through the raw stubs.

Behaviour is tested against the whole server (:func:`tests.server_harness.running_server`:
the app with every service, its call log and a data directory); the servicer's lifecycle
(shutdown, channels forgotten) against a bare server holding only the Channels servicer,
whose hub the test can look into. Either runs in a thread with its own event loop; each
test drives publishers and subscribers with grpc.aio clients in ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Sequence

import grpc
import pytest
import torch

from tannery_protocol import codec, framing
from tannery.dataplane import gathering
from tannery.torch import deserialize, serialize
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc
from tannery_server.channels import ChannelsServicer, add_to_server
from tannery_server.config import Config

from tests.server_harness import running_server

ROOT = Path(__file__).resolve().parents[1]
KiB = 1 << 10
MiB = 1 << 20


# -- a real server, in a thread with its own event loop --------------------------------------


class BareChannelsServer:
    """A grpc.aio server with only the Channels servicer, on a free port of 127.0.0.1."""

    def __init__(self, **config: Any) -> None:
        self.config = Config(**config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="channels-server", daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coroutine: Awaitable[Any], timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        self.servicer = ChannelsServicer(self.config)
        add_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.target = f"127.0.0.1:{port}"

    def subscriber_counts(self) -> dict[str, int]:
        """Live channels and their subscriber counts, read on the server's loop."""

        async def read() -> dict[str, int]:
            return {name: len(ch.subscriptions) for name, ch in self.servicer.hub.channels.items()}

        return self.call(read())

    async def _stop(self) -> None:
        await self.servicer.close()
        await self.server.stop(grace=1)

    def stop(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start the whole tannery server with the given config (stopped after the test)."""
    with ExitStack() as stack:
        yield lambda **config: stack.enter_context(running_server(tmp_path, **config))


@pytest.fixture
def serve_bare() -> Iterator[Callable[..., BareChannelsServer]]:
    """Start a server of the Channels servicer alone with the given config (stopped after the test)."""
    servers: list[BareChannelsServer] = []

    def start(**config: Any) -> BareChannelsServer:
        server = BareChannelsServer(**config)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def run(coroutine: Awaitable[Any], timeout: float = 60) -> Any:
    """Run a test scenario on a fresh event loop, failing it if it hangs."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


# -- payloads, publishing and receiving ------------------------------------------------------


def tagged(publisher: int, seq: int, extra: int = 0) -> bytes:
    """An int64 payload that says who published it and in what order: ``[publisher, seq, ...]``."""
    return serialize(torch.cat([torch.tensor([publisher, seq]), torch.arange(extra)]))


def tag_of(payload: codec.Buffer) -> tuple[int, int]:
    tensor = deserialize(payload)
    return int(tensor[0]), int(tensor[1])


def chunked(data: bytes, sizes: Iterable[int]) -> Iterator[bytes]:
    """``data`` cut into chunks whose sizes cycle through ``sizes``."""
    pos = 0
    for size in itertools.cycle(sizes):
        if pos >= len(data):
            return
        yield data[pos : pos + size]
        pos += size


def requests(channel: str, chunks: Iterable[bytes]) -> Iterator[channels_pb2.PublishRequest]:
    """The Publish stream: the channel in the first message, then every chunk."""
    first = True
    for chunk in chunks:
        yield channels_pb2.PublishRequest(channel=channel if first else "", chunk=chunk)
        first = False
    if first:
        yield channels_pb2.PublishRequest(channel=channel)


async def publish(
    stub: channels_pb2_grpc.ChannelsStub, channel: str, payloads: Sequence[bytes], sizes: Iterable[int] = (64 * KiB,)
) -> channels_pb2.PublishResponse:
    return await stub.Publish(requests(channel, chunked(b"".join(payloads), sizes)))


async def publish_in_background(
    stub: channels_pb2_grpc.ChannelsStub, channel: str, payloads: Sequence[bytes], sizes: Iterable[int] = (256 * KiB,)
) -> asyncio.Task:
    return asyncio.create_task(publish(stub, channel, payloads, sizes))


class Tally:
    """A Publish's requests, counting the chunk bytes gRPC has taken from them (``taken``): what
    the publisher got to send so far. Once the server makes it wait, ``taken`` stops growing."""

    def __init__(self, channel: str, payloads: Sequence[bytes], sizes: Iterable[int] = (256 * KiB,)) -> None:
        self.total = sum(len(p) for p in payloads)
        self.taken = 0
        self._requests = requests(channel, chunked(b"".join(payloads), sizes))

    def __iter__(self) -> Iterator[channels_pb2.PublishRequest]:
        for request in self._requests:
            self.taken += len(request.chunk)
            yield request


async def eventually(condition: Callable[[], bool], timeout: float = 30, what: str = "the condition") -> None:
    """Wait until ``condition()`` holds, polling while other tasks run; fail after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what} did not hold within {timeout} s"
        await asyncio.sleep(0.02)


async def stalled(tally: Tally, quiet: float = 0.5, timeout: float = 30) -> int:
    """Wait until the publisher has taken no more bytes for ``quiet`` seconds (it is held), then
    its bytes taken; fail if it never stops within ``timeout`` s or sends everything."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen, since = tally.taken, loop.time()
    while loop.time() - since < quiet:
        assert loop.time() < deadline, f"the publisher never stopped within {timeout} s ({tally.taken} bytes taken)"
        assert tally.taken < tally.total, "the publisher sent everything: nothing held it"
        await asyncio.sleep(0.02)
        if tally.taken != seen:
            seen, since = tally.taken, loop.time()
    return seen


async def refused_publish(target: str, channel: str, requests: Iterable[channels_pb2.PublishRequest]) -> grpc.RpcError:
    """The error of a Publish the server refuses, seen by a synchronous client.

    grpc.aio's client may report INTERNAL ("Failed execute_batch") instead of the server's
    status when the server ends a client-streaming call while the client is still writing
    (grpc/grpc#36066, fix proposed in grpc/grpc#43486); the synchronous client reports the
    server's status.
    """

    def call() -> grpc.RpcError:
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as caught:
                channels_pb2_grpc.ChannelsStub(ch).Publish(iter(list(requests)), timeout=30)
            return caught.value

    return await asyncio.to_thread(call)


async def subscribe(stub: channels_pb2_grpc.ChannelsStub, channel: str) -> grpc.aio.UnaryStreamCall:
    """A subscription that is registered on the server (its initial metadata has arrived)."""
    call = stub.Subscribe(channels_pb2.SubscribeRequest(channel=channel))
    await call.initial_metadata()
    return call


class Receiver:
    """Reads a subscription's chunks back into whole payloads, discarding abandoned ones as a client must."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.reframer = gathering.Reframer()
        self.chunk_sizes: list[int] = []
        #: Abandoned markers received (each discarded the payload in progress).
        self.abandoned = 0
        self._ready: list[bytes] = []

    async def payloads(self, count: int) -> list[bytes]:
        while len(self._ready) < count:
            response = await self.call.read()
            assert response is not grpc.aio.EOF, f"subscription ended after {len(self._ready)} of {count} payloads"
            if response.abandoned:
                assert not response.chunk, "an abandoned marker carries no chunk"
                self.abandoned += 1
                self.reframer = gathering.Reframer()
                continue
            self.chunk_sizes.append(len(response.chunk))
            self._ready.extend(bytes(payload) for payload in self.reframer.feed(response.chunk))
        taken, self._ready = self._ready[:count], self._ready[count:]
        return taken


async def first_read(stub: channels_pb2_grpc.ChannelsStub, channel: str) -> channels_pb2.SubscribeResponse:
    """The first message of a new subscription (raises the call's error if it fails)."""
    return await stub.Subscribe(channels_pb2.SubscribeRequest(channel=channel)).read()


async def error_of(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    return caught.value


# -- ordering and delivery -------------------------------------------------------------------


@pytest.mark.parametrize("backpressure", [False, True], ids=["roomy", "tight-buffers"])
def test_several_publishers_and_subscribers_see_one_order_without_loss(serve, backpressure):
    # With tight buffers, publishers wait for the slowest subscriber while the others have room.
    server = serve(channel_buffer_bytes=16 * KiB) if backpressure else serve()
    publishers, per_publisher, subscribers = 3, 25, 4

    async def read_slowly(receiver: Receiver, count: int, pause: float) -> list[bytes]:
        got = []
        for _ in range(count):
            got += await receiver.payloads(1)
            await asyncio.sleep(pause)
        return got

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receivers = [Receiver(await subscribe(stub, "mixed")) for _ in range(subscribers)]
            total = publishers * per_publisher
            reading = [
                asyncio.create_task(read_slowly(r, total, 0.005 if backpressure and i == 0 else 0))
                for i, r in enumerate(receivers)
            ]
            # Payloads of odd sizes in odd chunks, so payloads of different publishers arrive
            # at the server interleaved chunk by chunk.
            results = await asyncio.gather(
                *(
                    publish(stub, "mixed", [tagged(p, s, extra=(s * 97) % 3000) for s in range(per_publisher)], (997, 4099))
                    for p in range(publishers)
                )
            )
            received = await asyncio.gather(*reading)
            for r in receivers:
                r.call.cancel()
            return results, received

    results, received = run(scenario())
    for result in results:
        assert result.payloads == per_publisher
        assert result.dropped_subscribers == 0
    tags = [[tag_of(p) for p in payloads] for payloads in received]
    assert all(t == tags[0] for t in tags), "subscribers saw different orders"
    for p in range(publishers):
        assert [s for q, s in tags[0] if q == p] == list(range(per_publisher))
    expected = {p: [tagged(p, s, extra=(s * 97) % 3000) for s in range(per_publisher)] for p in range(publishers)}
    for payload, (p, s) in zip(received[0], tags[0]):
        assert payload == expected[p][s]


def test_a_subscriber_gets_only_what_was_published_after_it_subscribed(serve):
    server = serve()

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            early = Receiver(await subscribe(stub, "late"))
            await publish(stub, "late", [tagged(0, 0)])
            assert [tag_of(p) for p in await early.payloads(1)] == [(0, 0)]
            late = Receiver(await subscribe(stub, "late"))
            await publish(stub, "late", [tagged(0, 1), tagged(0, 2)])
            got_early = [tag_of(p) for p in await early.payloads(2)]
            got_late = [tag_of(p) for p in await late.payloads(2)]
            early.call.cancel()
            late.call.cancel()
            return got_early, got_late

    got_early, got_late = run(scenario())
    assert got_early == [(0, 1), (0, 2)]
    assert got_late == [(0, 1), (0, 2)]


def test_publish_reports_payloads_and_bytes_and_channels_need_no_subscribers(serve):
    server = serve()
    payloads = [tagged(1, s, extra=s) for s in range(5)]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            return await publish(stub, "nobody-listens", payloads)

    result = run(scenario())
    assert (result.payloads, result.bytes, result.dropped_subscribers) == (5, sum(map(len, payloads)), 0)


def varied_payloads() -> list[bytes]:
    """Payloads of several dtypes and sizes, an empty tensor and a scalar among them."""
    return [
        serialize(torch.arange(1000, dtype=torch.float32)),
        serialize(torch.tensor(3.5, dtype=torch.float64)),
        serialize(torch.zeros(0, 7, dtype=torch.int16)),
        serialize(torch.arange(77) % 3 == 0),
        serialize(torch.randn(33, 5).to(torch.bfloat16)),
        serialize(torch.arange(5000, dtype=torch.uint8).reshape(50, 100)),
    ]


@pytest.mark.parametrize(
    "sizes",
    [(1,), (7, 13, 1), (15,), (33, 34), (4099,), (10 * MiB,)],
    ids=["bytewise", "odd", "header-sized", "metadata-sized", "4099", "all-in-one-chunk"],
)
def test_payloads_split_across_chunks_and_packed_in_one_chunk(serve, sizes):
    server = serve(chunk_size=4 * KiB)
    # One byte per message is slow over gRPC: the small payloads are enough for that case.
    payloads = varied_payloads() if sizes != (1,) else varied_payloads()[1:4]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "chunks"))
            result = await publish(stub, "chunks", payloads, sizes)
            got = await receiver.payloads(len(payloads))
            receiver.call.cancel()
            return result, got, receiver.chunk_sizes

    result, got, chunk_sizes = run(scenario())
    assert result.payloads == len(payloads)
    assert got == payloads
    assert max(chunk_sizes) <= 4 * KiB


def test_chunks_larger_than_the_chunk_size_are_split(serve):
    server = serve(chunk_size=64 * KiB)
    payload = serialize(torch.randn(300_000))

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "split"))
            await publish(stub, "split", [payload], (1 * MiB,))
            got = await receiver.payloads(1)
            receiver.call.cancel()
            return got, receiver.chunk_sizes

    got, chunk_sizes = run(scenario())
    assert got == [payload]
    assert max(chunk_sizes) == 64 * KiB


@pytest.mark.slow
def test_a_64_mib_payload_is_relayed_intact(serve):
    server = serve()
    payload = serialize(torch.randn(16 * MiB))  # 64 MiB of float32, over the 64 MiB buffer bound
    digest = hashlib.sha256(payload).hexdigest()

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receivers = [Receiver(await subscribe(stub, "big")) for _ in range(2)]
            publishing = await publish_in_background(stub, "big", [payload, payload], (MiB,))
            # Both read at once: a subscriber that reads nothing can fall at most its buffer
            # bound behind (payloads are relayed piece by piece, never held whole).
            received = await asyncio.gather(*(r.payloads(2) for r in receivers))
            digests = [[hashlib.sha256(p).hexdigest() for p in got] for got in received]
            result = await publishing
            for r in receivers:
                r.call.cancel()
            return result, digests

    result, digests = run(scenario(), timeout=120)
    assert result.payloads == 2 and result.dropped_subscribers == 0
    assert digests == [[digest, digest], [digest, digest]]


# -- backpressure and slow subscribers -------------------------------------------------------


def test_a_slow_subscriber_makes_the_publisher_wait(serve):
    server = serve(channel_buffer_bytes=1 * MiB, channel_timeout_seconds=60)
    payloads = [tagged(0, s, extra=64 * KiB) for s in range(80)]  # 40 MiB in all

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            slow = Receiver(await subscribe(stub, "bp"))
            tally = Tally("bp", payloads)
            publishing = asyncio.ensure_future(stub.Publish(iter(tally)))
            # The subscriber reads nothing: the publisher is held with most of its bytes unsent.
            held = await stalled(tally)
            assert not publishing.done(), "the publisher finished while its subscriber read nothing"
            # Reading lets it go on: reading some releases more than it had sent, then all.
            got = await slow.payloads(10)
            await eventually(lambda: tally.taken > held, what="the publisher going on once the subscriber read")
            got += await slow.payloads(len(payloads) - 10)
            result = await publishing
            slow.call.cancel()
            return held, tally.total, result, got

    held, total, result, got = run(scenario())
    assert held < total // 2, f"{held} of {total} bytes sent to a subscriber that read nothing"
    assert result.dropped_subscribers == 0
    assert got == payloads


def test_a_subscriber_that_falls_behind_is_dropped_and_told_so(serve):
    server = serve(channel_buffer_bytes=1 * MiB, channel_timeout_seconds=1)
    payloads = [tagged(0, s, extra=64 * KiB) for s in range(80)]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            slow = Receiver(await subscribe(stub, "drop"))
            fast = Receiver(await subscribe(stub, "drop"))
            publishing = await publish_in_background(stub, "drop", payloads)
            got_fast = await fast.payloads(len(payloads))
            result = await publishing
            # The slow one reads now: some payloads, then the error.
            got_slow: list[bytes] = []
            error = await error_of(slow.payloads(len(payloads)))
            got_slow = slow._ready
            fast.call.cancel()
            return result, got_fast, got_slow, error

    result, got_fast, got_slow, error = run(scenario())
    assert result.dropped_subscribers == 1
    assert result.payloads == len(payloads)
    assert got_fast == payloads
    assert got_slow == payloads[: len(got_slow)] and len(got_slow) < len(payloads)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = error.details()
    assert "fell behind" in details and "'drop'" in details
    assert f"the bound is {MiB} bytes" in details and "within 1 s" in details


def test_a_payload_larger_than_the_buffer_bound_is_relayed(serve):
    server = serve(channel_buffer_bytes=64 * KiB, channel_timeout_seconds=30)
    payloads = [serialize(torch.randn(100_000)) for _ in range(6)]  # 400 KB each

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "large"))
            publishing = await publish_in_background(stub, "large", payloads)
            got = await receiver.payloads(len(payloads))
            result = await publishing
            receiver.call.cancel()
            return result, got

    result, got = run(scenario())
    assert result.dropped_subscribers == 0
    assert got == payloads


def test_a_cancelled_subscriber_is_removed_and_no_publisher_waits_on_it(serve):
    # A timeout far longer than the test's: a publisher waiting on a gone subscriber would hang it.
    server = serve(channel_buffer_bytes=256 * KiB, channel_timeout_seconds=600)
    payloads = [tagged(0, s, extra=64 * KiB) for s in range(80)]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            stuck = await subscribe(stub, "cancel")
            reader = Receiver(await subscribe(stub, "cancel"))
            tally = Tally("cancel", payloads)
            publishing = asyncio.ensure_future(stub.Publish(iter(tally)))
            reading = asyncio.create_task(reader.payloads(len(payloads)))
            # The reader reads all along; the publisher is held by the subscriber that reads nothing.
            await stalled(tally)
            assert not publishing.done(), "the publisher did not wait for the subscriber that reads nothing"
            assert not reading.done()
            stuck.cancel()
            got = await reading
            result = await asyncio.wait_for(publishing, 20)
            reader.call.cancel()
            return result, got

    result, got = run(scenario())
    assert result.dropped_subscribers == 0
    assert got == payloads


# -- the servicer's lifecycle, on a bare server --------------------------------------------


async def wait_until(server: BareChannelsServer, expected: dict[str, int]) -> None:
    """Wait (up to 5 s) until the server's live channels and subscriber counts are ``expected``."""
    for _ in range(250):
        if server.subscriber_counts() == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"channels are {server.subscriber_counts()}, expected {expected}")


def test_channels_are_forgotten_when_their_last_subscriber_leaves(serve_bare):
    server = serve_bare(channel_buffer_bytes=256 * KiB, channel_timeout_seconds=0.5)
    payloads = [tagged(0, s, extra=64 * KiB) for s in range(40)]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            cancelled = [await subscribe(stub, "a"), await subscribe(stub, "a")]
            slow = await subscribe(stub, "b")
            reader = Receiver(await subscribe(stub, "b"))
            await wait_until(server, {"a": 2, "b": 2})
            for call in cancelled:
                call.cancel()
            await wait_until(server, {"b": 2})
            # The slow subscriber is dropped: the channel keeps its reader only.
            publishing = await publish_in_background(stub, "b", payloads)
            await reader.payloads(len(payloads))
            assert (await publishing).dropped_subscribers == 1
            await wait_until(server, {"b": 1})
            assert (await error_of(Receiver(slow).payloads(len(payloads)))).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            reader.call.cancel()
            await wait_until(server, {})
            # A publisher alone keeps a channel only while it publishes.
            await publish(stub, "c", payloads[:2])
            await wait_until(server, {})

    run(scenario())


def test_close_ends_subscriptions_and_refuses_new_calls(serve_bare):
    server = serve_bare()

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receivers = [Receiver(await subscribe(stub, name)) for name in ("x", "x", "y")]
            await publish(stub, "x", [tagged(0, 0)])
            assert len(await receivers[0].payloads(1)) == 1
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.servicer.close(), server.loop))
            assert server.subscriber_counts() == {}, "close() returned before the subscriptions ended"
            ended = [await error_of(r.payloads(2)) for r in receivers]
            refused_subscribe = await error_of(first_read(stub, "x"))
            refused = await refused_publish(server.target, "x", requests("x", [tagged(0, 1)]))
            return [*ended, refused_subscribe, refused]

    for error in run(scenario()):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.details()


def test_stopping_the_server_ends_open_subscriptions_without_waiting_out_the_grace(serve):
    """A subscription never ends by itself: the app must end it while calls drain, not cut it after."""
    server = serve(grace_seconds=30.0)

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            receiver = Receiver(await subscribe(channels_pb2_grpc.ChannelsStub(ch), "x"))
            loop = asyncio.get_running_loop()
            started = loop.time()
            stopping = asyncio.create_task(asyncio.to_thread(server.stop, 30.0))
            error = await error_of(receiver.payloads(1))
            await stopping
            return error, loop.time() - started

    error, seconds = run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in error.details()
    assert seconds < 15, f"stop took {seconds:.1f} s: it waited out the grace period for the subscription"


# -- bad input -------------------------------------------------------------------------------


def with_header(payload: bytes, **fields: int) -> bytes:
    """``payload`` with header or metadata fields replaced (magic, nbytes, dcode, rank)."""
    magic, version, checksum, nbytes = codec.HEADER.unpack_from(payload)
    dcode, offset, buffer_nbytes, rank = codec.METADATA.unpack_from(payload, codec.HEADER.size)
    header = codec.HEADER.pack(fields.get("magic", magic), version, checksum, fields.get("nbytes", nbytes))
    metadata = codec.METADATA.pack(fields.get("dcode", dcode), offset, buffer_nbytes, fields.get("rank", rank))
    return header + metadata + payload[codec.FIXED_PREFIX :]


GOOD = serialize(torch.arange(10_000, dtype=torch.float32))
MALFORMED = {
    "bad-magic": (with_header(GOOD, magic=0xDEADBEEF), "bad magic 0xDEADBEEF"),
    "unknown-dcode": (with_header(GOOD, dcode=99), "unknown dcode 99"),
    "inconsistent-nbytes": (with_header(GOOD, nbytes=codec.METADATA.size + 8 + 100), "is inconsistent with the metadata"),
    "over-size-limit": (serialize(torch.zeros(300_000)), "is over the limit of 1048576 bytes"),
    "over-rank-limit": (serialize(torch.zeros([1] * 9)), "rank 9 is over the limit of 8"),
    "truncated": (GOOD[:-10], "stream ended inside a payload"),
    "truncated-header": (GOOD[:20], "stream ended inside a payload header"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_payload_fails_the_call_and_reaches_no_subscriber(serve, case):
    server = serve(max_payload_bytes=MiB, max_rank=8)
    bad, message = MALFORMED[case]
    before, after = tagged(1, 0, extra=500), tagged(2, 0, extra=500)

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receiver = Receiver(await subscribe(stub, "bad"))
            error = await refused_publish(server.target, "bad", requests("bad", chunked(before + bad, (1000,))))
            # Another publisher's payload comes next, whole: nothing of the bad one got through.
            await publish(stub, "bad", [after])
            got = await receiver.payloads(2)
            receiver.call.cancel()
            return error, got

    error, got = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert "payload 2 of this call" in error.details()
    assert ("tannery-error", "format") in tuple(error.trailing_metadata() or ())
    assert got == [before, after]


BAD_NAMES = {
    "empty": ("", "channel name is empty"),
    "too-long": ("é" * 128, "channel name is 256 bytes of UTF-8, over the limit of 255"),
    "control": ("a\nb", "has a control character, U+000A, at index 1"),
    "nul": ("\x00", "U+0000"),
}


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_bad_channel_names_are_refused(serve, case):
    server = serve()
    name, message = BAD_NAMES[case]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            return (
                await error_of(first_read(stub, name)),
                await refused_publish(server.target, name, requests(name, [tagged(0, 0)])),
            )

    for error in run(scenario()):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details()


def test_the_longest_name_and_unicode_names_are_channels(serve):
    server = serve()
    names = ["x" * 255, "é" * 127 + "x", "модель/веса", "with space"]

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            receivers = [Receiver(await subscribe(stub, name)) for name in names]
            for i, name in enumerate(names):
                await publish(stub, name, [tagged(i, 0)])
            got = [tag_of((await r.payloads(1))[0]) for r in receivers]
            for r in receivers:
                r.call.cancel()
            return got

    assert run(scenario()) == [(i, 0) for i in range(len(names))]


def test_publish_must_name_its_channel_first_and_only_once(serve):
    server = serve()

    async def scenario():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = channels_pb2_grpc.ChannelsStub(ch)
            nothing = await refused_publish(server.target, "", [])
            renamed = await refused_publish(
                server.target,
                "one",
                [
                    channels_pb2.PublishRequest(channel="one", chunk=tagged(0, 0)),
                    channels_pb2.PublishRequest(channel="two", chunk=tagged(0, 1)),
                ],
            )
            return nothing, renamed

    nothing, renamed = run(scenario())
    assert nothing.code() == renamed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no message naming a channel" in nothing.details()
    assert "'two' after 'one'" in renamed.details()


# -- separate processes ----------------------------------------------------------------------

PEER_PAYLOADS = 20


def peer_payloads() -> list[bytes]:
    """What the publisher process publishes: tensors of several dtypes, some over a chunk."""
    generator = torch.Generator().manual_seed(7)
    return [
        serialize(torch.randn(1000 * (i + 1), generator=generator).to([torch.float32, torch.bfloat16][i % 2]))
        for i in range(PEER_PAYLOADS)
    ]


def peer_main(role: str, address: str, channel: str) -> None:
    """A publisher or subscriber process (run by the two-process test)."""

    async def publisher() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            result = await publish(channels_pb2_grpc.ChannelsStub(ch), channel, peer_payloads(), (100_003,))
            print(json.dumps({"payloads": result.payloads, "bytes": result.bytes}), flush=True)

    async def subscriber() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            receiver = Receiver(await subscribe(channels_pb2_grpc.ChannelsStub(ch), channel))
            print("subscribed", flush=True)
            got = await receiver.payloads(PEER_PAYLOADS)
            tensors = [deserialize(p) for p in got]
            summary = [[str(t.dtype), list(t.shape), hashlib.sha256(p).hexdigest()] for t, p in zip(tensors, got)]
            print(json.dumps(summary), flush=True)

    asyncio.run(publisher() if role == "publish" else subscriber())


def spawn_peer(role: str, address: str, channel: str) -> subprocess.Popen:
    code = f"from tests.test_channels import peer_main; peer_main({role!r}, {address!r}, {channel!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )


@pytest.mark.slow
def test_publisher_and_subscriber_in_separate_processes(serve):
    server = serve(chunk_size=64 * KiB)
    subscriber = spawn_peer("subscribe", server.target, "between-processes")
    try:
        assert subscriber.stdout.readline().strip() == "subscribed"
        publisher = spawn_peer("publish", server.target, "between-processes")
        published, _ = publisher.communicate(timeout=120)
        received, _ = subscriber.communicate(timeout=120)
    finally:
        for process in (subscriber,):
            if process.poll() is None:
                process.kill()
    assert publisher.returncode == 0 and subscriber.returncode == 0
    expected = peer_payloads()
    assert json.loads(published) == {"payloads": PEER_PAYLOADS, "bytes": sum(map(len, expected))}
    dtypes = ["torch.float32", "torch.bfloat16"]
    assert json.loads(received) == [
        [dtypes[i % 2], [1000 * (i + 1)], hashlib.sha256(p).hexdigest()] for i, p in enumerate(expected)
    ]


def test_the_channels_service_does_not_import_torch():
    code = "import sys, tannery_server.channels; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
