"""Channels across replicas through a real NATS (Debian's nats-server, tests/nats_harness.py).

Two or three tannery replicas in this process (``running_server(..., nats=url)``; channels
need no shared catalog) on one NATS whose ``max_payload`` is 256 KiB, so every payload of
more than that crosses it in several chunks; a replica as a subprocess for kill -9.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest

from tannery_protocol.v1 import archives_pb2, channels_pb2, channels_pb2_grpc

from tests.nats_harness import MAX_PAYLOAD
from tests.server_harness import ServerProcess, running_server
from tests.test_channels import (KiB, MiB, Receiver, error_of, publish, publish_in_background, refused_publish,
                                 requests, run, subscribe, tag_of, tagged)


@pytest.fixture
def replicas(tmp_path: Path, nats_url: str) -> Iterator[Callable[..., Any]]:
    """Start in-process replicas on the session's NATS: ``replicas("a", **config)``."""
    with ExitStack() as stack:
        yield lambda name, **config: stack.enter_context(
            running_server(tmp_path / name, nats=nats_url, **config))


def fabric(server) -> Any:
    return server._running.channels.fabric


def by_publisher(payloads: list[bytes]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for payload in payloads:
        out.setdefault(tag_of(payload)[0], []).append(payload)
    return out


def test_publishers_and_subscribers_on_both_replicas_get_every_payload_whole_and_in_order(replicas):
    a, b = replicas("a"), replicas("b")
    # Publisher 0 on a, publisher 1 on b; sizes from 16 bytes to 1.5 MiB (6 NATS chunks).
    sent = {p: [tagged(p, s, extra=(s * 37 * KiB) % (192 * KiB)) for s in range(12)] for p in (0, 1)}
    sent[0].append(tagged(0, 12, extra=192 * KiB))
    sent[1].append(tagged(1, 12, extra=3))

    async def scenario():
        async with grpc.aio.insecure_channel(a.target) as ca, grpc.aio.insecure_channel(b.target) as cb:
            sa, sb = channels_pb2_grpc.ChannelsStub(ca), channels_pb2_grpc.ChannelsStub(cb)
            receivers = [Receiver(await subscribe(stub, "mesh")) for stub in (sa, sa, sb, sb)]
            results = await asyncio.gather(publish(sa, "mesh", sent[0], sizes=(100 * KiB, 7)),
                                           publish(sb, "mesh", sent[1]))
            got = [await r.payloads(len(sent[0]) + len(sent[1])) for r in receivers]
            for r in receivers:
                r.call.cancel()
            return results, got

    results, got = run(scenario())
    assert [r.payloads for r in results] == [len(sent[0]), len(sent[1])]
    for payloads in got:
        assert by_publisher(payloads) == sent  # byte-exact and in order per publisher
    assert fabric(a).payloads_out == fabric(b).payloads_in == len(sent[0])
    assert fabric(b).payloads_out == fabric(a).payloads_in == len(sent[1])


def test_a_payload_larger_than_the_nats_message_limit_crosses_whole(replicas):
    a, b = replicas("a"), replicas("b")
    big = tagged(0, 0, extra=MiB)  # 8 MiB of int64: 32 times NATS's max_payload here

    async def scenario():
        async with grpc.aio.insecure_channel(a.target) as ca, grpc.aio.insecure_channel(b.target) as cb:
            receiver = Receiver(await subscribe(channels_pb2_grpc.ChannelsStub(cb), "big"))
            await publish(channels_pb2_grpc.ChannelsStub(ca), "big", [big], sizes=(MiB,))
            got = await receiver.payloads(1)
            receiver.call.cancel()
            return got

    assert run(scenario()) == [big]
    assert fabric(a).nc.max_payload == MAX_PAYLOAD < len(big)
    assert fabric(b).bytes_in == len(big)


def test_a_slow_subscriber_on_another_replica_is_dropped_visibly_while_the_others_keep_up(replicas):
    a = replicas("a")
    b = replicas("b", channel_buffer_bytes=MiB, channel_timeout_seconds=1)
    payloads = [tagged(0, s, extra=64 * KiB) for s in range(60)]  # 512 KiB each, 30 MiB

    async def scenario():
        async with grpc.aio.insecure_channel(a.target) as ca, grpc.aio.insecure_channel(b.target) as cb:
            sa, sb = channels_pb2_grpc.ChannelsStub(ca), channels_pb2_grpc.ChannelsStub(cb)
            slow = Receiver(await subscribe(sb, "drop"))
            fast = Receiver(await subscribe(sb, "drop"))
            local = Receiver(await subscribe(sa, "drop"))
            publishing = await publish_in_background(sa, "drop", payloads)
            got_fast, got_local = await fast.payloads(len(payloads)), await local.payloads(len(payloads))
            result = await publishing
            error = await error_of(slow.payloads(len(payloads)))
            fast.call.cancel()
            local.call.cancel()
            return result, got_fast, got_local, slow._ready, error

    result, got_fast, got_local, got_slow, error = run(scenario())
    assert got_fast == payloads and got_local == payloads
    assert got_slow == payloads[: len(got_slow)] and len(got_slow) < len(payloads)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell behind" in error.details() and "another replica" in error.details()
    assert result.dropped_subscribers == 0  # the publisher on a is not held back, nor told
    assert b.hub.dropped_subscribers == 1


def test_a_replica_killed_mid_payload_leaves_no_torn_payload_anywhere(replicas, nats_url, tmp_path):
    b = replicas("b", channel_timeout_seconds=1)
    c = replicas("c", channel_timeout_seconds=1)
    doomed = ServerProcess(tmp_path / "doomed", nats=nats_url).start()
    cut = tagged(9, 0, extra=512 * KiB)  # 4 MiB, of which 1 MiB is sent
    whole = tagged(1, 0, extra=100 * KiB)

    async def scenario():
        async with (grpc.aio.insecure_channel(doomed.target) as cd, grpc.aio.insecure_channel(b.target) as cb,
                    grpc.aio.insecure_channel(c.target) as cc):
            receivers = [Receiver(await subscribe(channels_pb2_grpc.ChannelsStub(ch), "cut")) for ch in (cb, cc)]
            half = channels_pb2_grpc.ChannelsStub(cd).Publish()
            for request in requests("cut", [cut[i : i + 256 * KiB] for i in range(0, MiB, 256 * KiB)]):
                await half.write(request)
            deadline = time.monotonic() + 10
            while not all(fabric(s)._inboxes.get("cut") and fabric(s)._inboxes["cut"].held >= MiB // 2
                          for s in (b, c)):
                assert time.monotonic() < deadline, "the first chunks never reached the other replicas"
                await asyncio.sleep(0.02)
            doomed.kill()
            half.cancel()
            await publish(channels_pb2_grpc.ChannelsStub(cc), "cut", [whole])
            got = [await r.payloads(1) for r in receivers]
            await asyncio.sleep(1.5)  # past the timeout: the incomplete payload is dropped
            for r in receivers:
                r.call.cancel()
            return got, receivers

    try:
        got, receivers = run(scenario())
    finally:
        doomed.kill()
    assert got == [[whole], [whole]]
    assert all(r.abandoned == 0 and not r._ready for r in receivers)
    for server in (b, c):
        assert fabric(server).incomplete == 1
        assert fabric(server)._inboxes.get("cut") is None or fabric(server)._inboxes["cut"].held == 0


def test_nats_stopped_and_started_during_traffic(replicas, nats_server):
    a, b = replicas("a"), replicas("b")
    first, later = tagged(0, 0, extra=40 * KiB), tagged(0, 1, extra=40 * KiB)

    async def scenario():
        async with grpc.aio.insecure_channel(a.target) as ca, grpc.aio.insecure_channel(b.target) as cb:
            sa, sb = channels_pb2_grpc.ChannelsStub(ca), channels_pb2_grpc.ChannelsStub(cb)
            receiver = Receiver(await subscribe(sb, "outage"))
            await publish(sa, "outage", [first])
            assert await receiver.payloads(1) == [first]
            nats_server.stop()
            ended = await error_of(receiver.payloads(1))
            refused = await refused_publish(a.target, "outage", requests("outage", [later]))
            resubscribe = await error_of(sb.Subscribe(channels_pb2.SubscribeRequest(channel="outage")).read())
            listed = await archives_stub(ca).List(archives_pb2.ListRequest())  # Archives go on
            nats_server.start()
            deadline = time.monotonic() + 15
            while True:  # both replicas reconnect by themselves
                try:
                    receiver = Receiver(await subscribe(sb, "outage"))
                    await publish(sa, "outage", [later])
                    got = await asyncio.wait_for(receiver.payloads(1), 5)
                    break
                except (grpc.aio.AioRpcError, TimeoutError):
                    assert time.monotonic() < deadline, "the replicas did not come back after NATS did"
                    await asyncio.sleep(0.2)
            receiver.call.cancel()
            return ended, refused, resubscribe, listed, got

    ended, refused, resubscribe, listed, got = run(scenario())
    url = nats_server.url
    for error in (ended, refused, resubscribe):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert f"NATS at {url}" in error.details()
    assert list(listed.archives) == []
    assert got == [later]
    assert fabric(a).connected and fabric(b).connected


def archives_stub(channel: grpc.aio.Channel) -> Any:
    from tannery_protocol.v1 import archives_pb2_grpc

    return archives_pb2_grpc.ArchivesStub(channel)


def test_without_nats_the_server_never_imports_nats(tmp_path):
    import subprocess
    import sys

    code = ("import sys, asyncio\nfrom tannery_server.channels import ChannelsServicer\n"
            "from tannery_server.config import Config\nChannelsServicer(Config())\n"
            "assert 'nats' not in sys.modules, 'nats imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
