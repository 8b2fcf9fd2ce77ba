"""Channels: throughput from one publisher to 1, 4 and 16 subscribers, and 4 KiB latency.

Side by side in one run with the baseline, a bare grpc.aio relay of bytes messages (a
generic handler, no protobuf, no codec: each published message is put on a bounded
queue per subscriber and written out as it is). Both servers run as subprocesses (the
tannery one is ``python -m tannery_server serve``); the publisher and subscribers run in
this process (raw grpc.aio stubs), so on a small machine the client shares the cost of
every subscriber and wall-clock rates are bound by it: the servers' CPU time per GiB
delivered is given too. ``python -m tests.benchmarks --cases channels``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tannery_protocol import codec
from tannery_protocol.v1 import channels_pb2, channels_pb2_grpc

from .harness import (GiB, CaseResult, Options, Subprocess, Table, alternate, cpu_seconds, fmt_ratio, fmt_size,
                      fmt_time, percentile, tannery_server)

MiB = 1 << 20
CHUNK = MiB
PAYLOAD = 4 * MiB
LATENCY_PAYLOAD = 4096
RELAY = "bench.Relay"
INTRO = __doc__.split("\n\n", 1)[1].strip()


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


# -- clients: the same shapes over both servers ------------------------------------------------


class Tannery:
    """Raw Channels stubs."""

    name = "tannery"

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


async def throughput(kind: type, target: str, subscribers: int, chunks: list[bytes], sub_target: str = "") -> float:
    """Seconds from the first published byte to the last one received by every subscriber
    (subscribed on ``sub_target``, another replica, when given)."""
    total = sum(map(len, chunks))
    async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(sub_target or target) as sub:
        client, sub_client = kind(channel), kind(sub)
        calls = [sub_client.subscribe("bench") for _ in range(subscribers)]
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


async def latency(kind: type, target: str, rounds: int, sub_target: str = "") -> list[float]:
    """Seconds from writing one 4 KiB payload to reading it back, ``rounds`` times (subscribed on
    ``sub_target``, another replica, when given)."""
    payload = codec.encode_numpy(np.zeros(4096 - codec.FIXED_PREFIX - codec.DIM.size, dtype=np.uint8))
    async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(sub_target or target) as sub:
        client = kind(channel)
        call = kind(sub).subscribe("latency")
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


def measure(options: Options, servers: dict[type, tuple[str, int]], mib: int, rounds: int) -> CaseResult:
    result = CaseResult("channels", "Channels: one publisher, many subscribers", INTRO)
    chunks = payload_stream(mib * MiB)
    total = sum(map(len, chunks))
    payloads = total // PAYLOAD
    kinds = list(servers)
    throughput_table = Table(
        f"Throughput: {fmt_size(total)} in {payloads} payloads of {fmt_size(PAYLOAD)}",
        ["subscribers", "server", "median MiB/s per subscriber", "spread", "tensors/s delivered (all subscribers)",
         "vs bare relay", "server CPU s/GiB delivered"],
        note="From the first byte published to the last one received by every subscriber; tensors/s counts "
             "every delivery (payloads x subscribers).")
    series: dict[str, dict] = {"throughput": {}, "latency": {}}
    for subscribers in (1, 4) if options.quick else (1, 4, 16):
        cpu: dict[type, list[float]] = {k: [] for k in kinds}

        def round_of(kind: type):
            def one() -> float:
                target, pid = servers[kind]
                used = cpu_seconds(pid)
                seconds = asyncio.run(throughput(kind, target, subscribers, chunks))
                cpu[kind].append((cpu_seconds(pid) - used) / (subscribers * total / GiB))
                return seconds
            return one

        timings = alternate({k.name: round_of(k) for k in kinds}, options.repetitions())
        base = timings[Relay.name]["time"].median
        for kind in kinds:
            samples = timings[kind.name]["time"]
            throughput_table.add(subscribers, kind.name, f"{total / samples.median / MiB:.0f}",
                                 f"{total / samples.high / MiB:.0f} – {total / samples.low / MiB:.0f}",
                                 f"{payloads * subscribers / samples.median:.0f}", fmt_ratio(base / samples.median),
                                 f"{statistics.median(cpu[kind]):.2f}")
            series["throughput"].setdefault(kind.name, []).append([subscribers, total / samples.median])
    latency_table = Table(f"Latency of one {fmt_size(LATENCY_PAYLOAD)} payload, publisher to subscriber",
                          ["server", "p50", "p90", "p99", "p50 vs bare relay", "p99 vs bare relay"],
                          note=f"{rounds} round trips per repetition, {options.repetitions()} repetitions "
                               "alternating; percentiles over all of them.")
    times: dict[str, list[float]] = {k.name: [] for k in kinds}

    def latency_round(kind: type):
        def one() -> float:
            got = asyncio.run(latency(kind, servers[kind][0], rounds))
            times[kind.name].extend(got)
            return statistics.median(got)
        return one

    alternate({k.name: latency_round(k) for k in kinds}, options.repetitions())
    base50, base99 = percentile(times[Relay.name], 50), percentile(times[Relay.name], 99)
    for kind in kinds:
        values = times[kind.name]
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        latency_table.add(kind.name, fmt_time(p50), fmt_time(p90), fmt_time(p99), fmt_ratio(p50 / base50),
                          fmt_ratio(p99 / base99))
        series["latency"][kind.name] = {str(q): percentile(values, q) for q in (50, 75, 90, 95, 99, 99.9)}
    result.tables += [throughput_table, latency_table]
    result.data = series
    return result


SAME_HOST_PAYLOAD = 64 * MiB


def same_host(options: Options, target: str, pid: int) -> Table:
    """64 MiB payloads from a publisher (``tannery.Client``, this process) to a subscriber in a
    process of its own, over the gRPC streams and over the same-host data path."""
    import subprocess
    import sys

    import torch

    count = 4 if options.quick else 8
    tensor = torch.from_numpy(np.random.default_rng(1).standard_normal(SAME_HOST_PAYLOAD // 4, dtype=np.float32))
    tensors = [tensor] * count
    table = Table(f"Same host: {count} payloads of {fmt_size(SAME_HOST_PAYLOAD)}, tannery.Client publisher to a "
                  "subscriber process", ["transport", "median MiB/s", "spread", "vs grpc", "server CPU s/GiB"],
                  note="From the publish call to the subscriber's last tensor (it reads one element of each).")
    subscribers = {}
    try:
        for transport in ("grpc", "local"):
            subscribers[transport] = subprocess.Popen(
                [sys.executable, "-m", "tests.benchmarks.channel_subscriber", target, transport, str(count)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert subscribers[transport].stdout.readline().strip() == "ready"
        clients = {t: __import__("tannery").Client(target, transport=t) for t in subscribers}
        cpu: dict[str, list[float]] = {t: [] for t in subscribers}

        def round_of(transport: str):
            def one() -> float:
                process = subscribers[transport]
                used = cpu_seconds(pid)
                process.stdin.write("go\n")
                process.stdin.flush()
                started = time.monotonic()
                clients[transport].publish(f"same-host-{transport}", tensors)
                ended = float(process.stdout.readline().split()[1])
                cpu[transport].append((cpu_seconds(pid) - used) / (count * SAME_HOST_PAYLOAD / GiB))
                return ended - started
            return one

        timings = alternate({t: round_of(t) for t in subscribers}, options.repetitions())
        total = count * SAME_HOST_PAYLOAD
        base = timings["grpc"]["time"].median
        for transport in subscribers:
            samples = timings[transport]["time"]
            table.add(transport, f"{total / samples.median / MiB:.0f}",
                      f"{total / samples.high / MiB:.0f} – {total / samples.low / MiB:.0f}",
                      fmt_ratio(base / samples.median), f"{statistics.median(cpu[transport]):.2f}")
        for client in clients.values():
            client.close()
    finally:
        for process in subscribers.values():
            process.kill()
            process.wait()
    return table


CROSS_PAYLOAD = 64 * MiB
#: The NATS server's max_payload in the cross-replica rows (what docs/scale-out.md recommends).
NATS_MAX_PAYLOAD = 4 * MiB


def cross_replica(options: Options) -> list[Table]:
    """64 MiB payloads and 4 KiB latency from a publisher on replica A to a subscriber on replica
    B through NATS, next to both on replica A, in the same run (no tables without nats-server)."""
    from tests.nats_harness import NatsServer, nats_server_bin

    if nats_server_bin() is None:
        print("channels: nats-server is not installed, no cross-replica rows", flush=True)
        return []
    count = 4 if options.quick else 8
    payload = codec.encode_numpy(np.random.default_rng(2).standard_normal(CROSS_PAYLOAD // 4 - 64, dtype=np.float32))
    stream = payload * count
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]
    nats_server = NatsServer(max_payload=NATS_MAX_PAYLOAD).start()
    try:
        with (
            tempfile.TemporaryDirectory(dir=options.tmp) as tmp,
            tannery_server(Path(tmp) / "a", data_port="off", nats=nats_server.url) as a,
            tannery_server(Path(tmp) / "b", data_port="off", nats=nats_server.url) as b,
        ):
            where = {"one replica": "", "A to B through NATS": b.target}

            def round_of(sub_target: str):
                return lambda: asyncio.run(throughput(Tannery, a.target, 1, chunks, sub_target))

            timings = alternate({k: round_of(v) for k, v in where.items()}, options.repetitions())
            total = sum(map(len, chunks))
            table = Table(f"Across replicas: {count} payloads of {fmt_size(CROSS_PAYLOAD)}, one publisher on replica "
                          "A, one subscriber", ["subscriber on", "median MiB/s", "spread", "vs one replica"],
                          note=f"Both replicas and nats-server (max_payload {fmt_size(NATS_MAX_PAYLOAD)}) on this "
                               "machine, as subprocesses; raw gRPC stubs in this process.")
            base = timings["one replica"]["time"].median
            for name in where:
                samples = timings[name]["time"]
                table.add(name, f"{total / samples.median / MiB:.0f}",
                          f"{total / samples.high / MiB:.0f} – {total / samples.low / MiB:.0f}",
                          fmt_ratio(base / samples.median))
            rounds = 300 if options.quick else 1000
            times: dict[str, list[float]] = {k: [] for k in where}

            def latency_round(name: str):
                def one() -> float:
                    got = asyncio.run(latency(Tannery, a.target, rounds, where[name]))
                    times[name].extend(got)
                    return statistics.median(got)
                return one

            alternate({k: latency_round(k) for k in where}, options.repetitions())
            lat = Table(f"Across replicas: latency of one {fmt_size(LATENCY_PAYLOAD)} payload",
                        ["subscriber on", "p50", "p90", "p99", "p50 vs one replica"],
                        note=f"{rounds} round trips per repetition; percentiles over all of them.")
            base50 = percentile(times["one replica"], 50)
            for name, values in times.items():
                lat.add(name, *(fmt_time(percentile(values, q)) for q in (50, 90, 99)),
                        fmt_ratio(percentile(values, 50) / base50))
            return [table, lat]
    finally:
        nats_server.close()


def run(options: Options) -> CaseResult:
    mib = 64 if options.quick else 256
    rounds = 500 if options.quick else 2000
    queue = str(64 * MiB // CHUNK)  # the relay buffers as much as a subscriber's default bound
    with (
        tempfile.TemporaryDirectory(dir=options.tmp) as tmp,
        tannery_server(Path(tmp) / "data", data_port="off") as app,
        Subprocess("-m", "tests.benchmarks.bench_channels", "--serve-relay", "--queue", queue) as relay,
    ):
        servers = {Relay: (relay.target, relay.pid), Tannery: (app.target, app.pid)}
        result = measure(options, servers, mib, rounds)
        table = same_host(options, app.target, app.pid)
        result.tables.append(table)
    result.tables += cross_replica(options)
    return result


def main() -> None:
    """The bare relay's server (``--serve-relay``); the benchmark itself runs from the suite."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-relay", action="store_true")
    parser.add_argument("--queue", type=int, default=64)
    args = parser.parse_args()
    if args.serve_relay:
        asyncio.run(serve_relay(0, args.queue))
        return
    parser.error("run the benchmark with: python -m tests.benchmarks --cases channels")


if __name__ == "__main__":
    main()
