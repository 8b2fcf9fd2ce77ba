"""Channels: throughput from one publisher to 1, 4 and 16 subscribers, and 4 KiB latency.

Side by side in one run with the baseline, a bare grpc.aio relay of bytes messages (a
generic handler, no protobuf, no codec: each published message is put on a bounded
queue per subscriber and written out as it is). Both servers run as subprocesses (the
tannery one is ``python -m tannery_server serve``); the publisher and subscribers run in
this process, so on a small machine the client shares the cost of every subscriber and
wall-clock rates are bound by it: the servers' CPU time per GiB delivered is printed too.

    .venv/bin/python -m tests.benchmarks.bench_channels [--mib 128] [--latency-rounds 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np

from tannery import codec
from tannery.v1 import channels_pb2, channels_pb2_grpc
from tests.server_harness import ServerProcess

MiB = 1 << 20
CHUNK = MiB
RELAY = "bench.Relay"


# -- the baseline: a bare relay --------------------------------------------------------------


async def serve_relay(port: int, queue_messages: int) -> None:
    subscribers: dict[str, set[asyncio.Queue]] = {}

    async def publish(request_iterator, context) -> bytes:
        channel = dict(context.invocation_metadata()).get("channel", "")
        async for message in request_iterator:
            for queue in list(subscribers.get(channel, ())):
                await queue.put(message)
        return b""

    async def subscribe(request: bytes, context) -> None:
        queue: asyncio.Queue = asyncio.Queue(queue_messages)
        subscribers.setdefault(request.decode(), set()).add(queue)
        try:
            await context.send_initial_metadata(())
            while True:
                await context.write(await queue.get())
        finally:
            subscribers[request.decode()].discard(queue)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                RELAY,
                {
                    "Publish": grpc.stream_unary_rpc_method_handler(publish),
                    "Subscribe": grpc.unary_stream_rpc_method_handler(subscribe),
                },
            ),
        )
    )
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


@contextmanager
def bench_server(*flags: str) -> Iterator[tuple[str, int]]:
    """This module run as a server (``--serve-relay``); yields its target and pid."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.benchmarks.bench_channels", *flags], stdout=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"serving on (\S+)", line)
        if not match:
            raise RuntimeError(f"the server did not start: {line!r}")
        yield match.group(1), process.pid
    finally:
        process.terminate()
        process.wait(10)


# -- clients: the same shapes over both servers ------------------------------------------------


class Tannery:
    """Raw Channels stubs."""

    name = "app"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = channels_pb2_grpc.ChannelsStub(channel)

    def subscribe(self, name: str) -> Any:
        return self.stub.Subscribe(channels_pb2.SubscribeRequest(channel=name))

    @staticmethod
    def chunk_of(response: Any) -> bytes:
        return response.chunk

    def publisher(self, name: str) -> Any:
        return self.stub.Publish()

    @staticmethod
    def request(name: str, chunk: bytes, first: bool) -> Any:
        return channels_pb2.PublishRequest(channel=name if first else "", chunk=chunk)


class Relay:
    """The bare relay's methods, bytes in and out."""

    name = "bare relay"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def subscribe(self, name: str) -> Any:
        return self.channel.unary_stream(f"/{RELAY}/Subscribe")(name.encode())

    @staticmethod
    def chunk_of(response: Any) -> bytes:
        return response

    def publisher(self, name: str) -> Any:
        return self.channel.stream_unary(f"/{RELAY}/Publish")(metadata=(("channel", name),))

    @staticmethod
    def request(name: str, chunk: bytes, first: bool) -> Any:
        return chunk


def payload_stream(total: int) -> list[bytes]:
    """``total`` bytes of float32 tannic payloads of 4 MiB, in 1 MiB chunks."""
    payload = codec.encode_numpy(np.random.default_rng(0).standard_normal(MiB, dtype=np.float32))
    stream = payload * max(1, total // len(payload))
    return [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]


async def throughput(kind: type, target: str, subscribers: int, chunks: list[bytes]) -> float:
    """Seconds from the first published byte to the last one received by every subscriber."""
    total = sum(map(len, chunks))
    async with grpc.aio.insecure_channel(target) as channel:
        client = kind(channel)
        calls = [client.subscribe("bench") for _ in range(subscribers)]
        for call in calls:
            await call.initial_metadata()

        async def drain(call: Any) -> None:
            received = 0
            while received < total:
                received += len(client.chunk_of(await call.read()))

        started = time.perf_counter()
        draining = [asyncio.create_task(drain(call)) for call in calls]
        publisher = client.publisher("bench")
        for i, chunk in enumerate(chunks):
            await publisher.write(client.request("bench", chunk, i == 0))
        await publisher.done_writing()
        await asyncio.gather(*draining)
        elapsed = time.perf_counter() - started
        await publisher
        for call in calls:
            call.cancel()
        return elapsed


async def latency(kind: type, target: str, rounds: int) -> list[float]:
    """Seconds from writing one 4 KiB payload to reading it back, ``rounds`` times."""
    payload = codec.encode_numpy(np.zeros(4096 - codec.FIXED_PREFIX - codec.DIM.size, dtype=np.uint8))
    async with grpc.aio.insecure_channel(target) as channel:
        client = kind(channel)
        call = client.subscribe("latency")
        await call.initial_metadata()
        publisher = client.publisher("latency")
        times = []
        for i in range(rounds + 50):
            started = time.perf_counter()
            await publisher.write(client.request("latency", payload, i == 0))
            got = client.chunk_of(await call.read())
            if i >= 50:  # warm-up
                times.append(time.perf_counter() - started)
            assert len(got) == len(payload)
        await publisher.done_writing()
        await publisher
        call.cancel()
        return times


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace, servers: dict[type, tuple[str, int]]) -> None:
    targets = {kind: target for kind, (target, _) in servers.items()}
    chunks = payload_stream(args.mib * MiB)
    total = sum(map(len, chunks))
    kinds = list(targets)
    print(f"throughput: one publisher, {total / MiB:.0f} MiB of 4 MiB payloads in 1 MiB chunks; MiB/s per subscriber")
    print(f"{'subscribers':>11}" + "".join(f"  {k.name:>10}" for k in kinds) + "".join(f"  {k.name + '/relay':>16}" for k in kinds[1:])
          + "".join(f"  {'cpu s/GiB ' + k.name:>20}" for k in kinds))
    for subscribers in args.subscribers:
        rates, cpu = {}, {}
        for kind in kinds:
            pid = servers[kind][1]
            used = cpu_seconds(pid)
            seconds = min([await throughput(kind, targets[kind], subscribers, chunks) for _ in range(args.repeat)])
            cpu[kind] = (cpu_seconds(pid) - used) / (args.repeat * subscribers * total / (1 << 30))
            rates[kind] = total / seconds / MiB
        line = f"{subscribers:>11}" + "".join(f"  {rates[k]:>10.0f}" for k in kinds)
        line += "".join(f"  {rates[k] / rates[kinds[0]]:>16.2f}" for k in kinds[1:])
        print(line + "".join(f"  {cpu[k]:>20.2f}" for k in kinds))
    print(f"latency: one 4 KiB payload published, then read by one subscriber ({args.latency_rounds} rounds)")
    print(f"{'':>11}  {'p50 us':>8}  {'p99 us':>8}  {'p50/relay':>9}  {'p99/relay':>9}")
    base = None
    for kind in kinds:
        times = await latency(kind, targets[kind], args.latency_rounds)
        p50, p99 = percentile(times, 50) * 1e6, percentile(times, 99) * 1e6
        base = base or (p50, p99)
        print(f"{kind.name:>11}  {p50:>8.0f}  {p99:>8.0f}  {p50 / base[0]:>9.2f}  {p99 / base[1]:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB published per throughput run")
    parser.add_argument("--subscribers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=2, help="runs per figure (the fastest is kept)")
    parser.add_argument("--latency-rounds", type=int, default=2000)
    parser.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--queue", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        asyncio.run(serve_relay(0, args.queue))
        return
    queue = str(64 * MiB // CHUNK)  # the relay buffers as much as a subscriber's default bound
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess(Path(tmp) / "data") as app,
        bench_server("--serve-relay", "--queue", queue) as relay,
    ):
        asyncio.run(run(args, {Relay: relay, Tannery: (app.target, app.pid)}))


if __name__ == "__main__":
    main()
