"""Latency per RPC: p50 and p99 of every call of the API, small requests, one client.

Each RPC is called many times with a small request (a 4 KiB entry: the latency of the
service, not the throughput of its disk or network): Store (one entry, replacing one
archive), Fetch of one entry by name, Fetch of some rows of it, Describe, List, Union of
two archives (replacing its target), Delete (of a one-entry archive stored untimed just
before) and Publish of one payload with a subscriber reading. The baseline is a bare
grpcio unary call (empty bytes in, empty bytes out) of the raw grpcio server of this suite,
in the same run: the floor of any gRPC call on this machine. Calls are made in rounds of a
few dozen per RPC, the order of the RPCs rotated every round, so drift spreads over all.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import grpc
import numpy as np

import tannery
from tannery_protocol import codec
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import channels_pb2

from . import clients, peers
from .harness import CaseResult, Options, Subprocess, Table, fmt_ratio, fmt_time, percentile, scratch, tannery_server

ENTRY = 4096
BASELINE = "bare grpcio unary call (raw server)"
ROUND = 25


def payload(seed: int) -> bytes:
    """A 4 KiB float32 [64, 16] payload."""
    return codec.encode_numpy(np.random.default_rng(seed).standard_normal((64, 16), dtype=np.float32))


def store_stream(archive: str, entries: dict[str, bytes], replace: bool = True) -> list[bytes]:
    """A Store call's messages: begin, each entry in one message, commit."""
    messages = [pb.StoreRequest(begin=pb.StoreBegin(archive=archive, replace=replace)).SerializeToString()]
    messages += [pb.StoreRequest(entry=name, chunk=data).SerializeToString() for name, data in entries.items()]
    return messages + [clients.commit_message(len(entries), sum(map(len, entries.values())))]


class Calls:
    """One small call of each RPC, on one channel to the server (and one to the raw server)."""

    def __init__(self, channel: grpc.Channel, raw_channel: grpc.Channel, target: str) -> None:
        identity = clients._identity
        prefix = "/tannery.v1.Archives/"
        self.store = channel.stream_unary(prefix + "Store", identity, pb.ArchiveInfo.FromString)
        self.fetch = channel.unary_stream(prefix + "Fetch", pb.FetchRequest.SerializeToString, identity)
        self.unary = {name: channel.unary_unary(prefix + name, request.SerializeToString, identity)
                      for name, request in (("Describe", pb.DescribeRequest), ("List", pb.ListRequest),
                                            ("Union", pb.UnionRequest), ("Delete", pb.DeleteRequest))}
        self.publish = channel.stream_unary("/tannery.v1.Channels/Publish", identity,
                                            channels_pb2.PublishResponse.FromString)
        self.clear = raw_channel.unary_unary(f"/{peers.SERVICE}/Clear", identity, identity)
        self.payload = payload(0)
        self.deleted = 0
        self.store(iter(store_stream("lat/a", {"w": self.payload, "b": payload(1)})))
        self.store(iter(store_stream("lat/b", {"w": payload(2)})))
        # A subscriber reading the channel Publish sends to, as a relay has.
        self.subscriber = tannery.Client(target)
        self.subscription = self.subscriber.subscribe("lat/channel")
        self.received = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for _ in self.subscription:
            self.received += 1

    def close(self) -> None:
        self.subscription.close()
        self._reader.join(10)
        self.subscriber.close()

    def rpcs(self) -> dict[str, tuple[Callable[[], None] | None, Callable[[], object]]]:
        """RPC name -> (untimed set-up before each call or None, the timed call)."""
        fetch_one = pb.FetchRequest(archive="lat/a", entries=[pb.EntryAsk(name="w")])
        fetch_rows = pb.FetchRequest(archive="lat/a", entries=[pb.EntryAsk(name="w", rows=pb.RowRange(start=8,
                                                                                                    stop=24))])
        union = pb.UnionRequest(target="lat/u", replace=True, sources=[pb.UnionSource(archive="lat/a", prefix="a"),
                                                                       pb.UnionSource(archive="lat/b", prefix="b")])
        one_store = store_stream("lat/store", {"w": self.payload})
        publish = [channels_pb2.PublishRequest(channel="lat/channel", chunk=self.payload).SerializeToString()]
        return {
            BASELINE: (None, lambda: self.clear(b"")),
            "Store (one 4 KiB entry)": (None, lambda: self.store(iter(one_store))),
            "Fetch (one 4 KiB entry by name)": (None, lambda: list(self.fetch(fetch_one))),
            "Fetch (16 rows of it)": (None, lambda: list(self.fetch(fetch_rows))),
            "Describe": (None, lambda: self.unary["Describe"](pb.DescribeRequest(archive="lat/a"))),
            "List": (None, lambda: self.unary["List"](pb.ListRequest(prefix="lat/"))),
            "Union (two archives)": (None, lambda: self.unary["Union"](union)),
            "Delete (a one-entry archive)": (self._store_doomed, self._delete_doomed),
            "Publish (one 4 KiB payload, one subscriber)": (None, lambda: self.publish(iter(publish))),
        }

    def _store_doomed(self) -> None:
        self.store(iter(store_stream("lat/doomed", {"w": payload(3)})))

    def _delete_doomed(self) -> None:
        self.unary["Delete"](pb.DeleteRequest(archive="lat/doomed"))
        self.deleted += 1


def measure(rpcs: dict[str, tuple[Callable[[], None] | None, Callable[[], object]]], rounds: int
            ) -> dict[str, list[float]]:
    """Seconds of every call, by RPC: ``rounds`` rounds of ROUND calls each, the order rotated."""
    names = list(rpcs)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: connections, caches, the first compilation of every path
        setup, call = rpcs[name]
        for _ in range(3):
            if setup:
                setup()
            call()
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            setup, call = rpcs[name]
            for _ in range(ROUND):
                if setup:
                    setup()
                started = time.perf_counter()
                call()
                latencies[name].append(time.perf_counter() - started)
    return latencies


def run(options: Options) -> CaseResult:
    rounds = 8 if options.quick else 40
    result = CaseResult("latency", "Latency per RPC: p50 and p99 of small calls", __doc__.split("\n\n", 1)[1].strip())
    table = Table("Latency per RPC (one client, small requests)",
                  ["RPC", "calls", "p50", "p99", "p50 vs grpcio", "p99 vs grpcio"])
    with scratch(options, "latency") as tmp, tannery_server(tmp / "data") as server, \
            Subprocess("-m", "tests.benchmarks.peers", "grpc") as raw, \
            grpc.insecure_channel(server.target) as channel, grpc.insecure_channel(raw.target) as raw_channel:
        calls = Calls(channel, raw_channel, server.target)
        try:
            latencies = measure(calls.rpcs(), rounds)
        finally:
            calls.close()
    base50, base99 = percentile(latencies[BASELINE], 50), percentile(latencies[BASELINE], 99)
    figures = {}
    for name, values in latencies.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        figures[name] = {"calls": len(values), "p50": p50, "p99": p99}
        table.add(name, len(values), fmt_time(p50), fmt_time(p99), fmt_ratio(p50 / base50), fmt_ratio(p99 / base99))
    table.note = ("Each call timed alone on the client, from the request to the last byte of the answer; one "
                  "channel, no concurrency. Ratios are over the bare grpcio unary call of the same run "
                  f"(p50 {fmt_time(base50)}, p99 {fmt_time(base99)}); lower is better.")
    result.tables.append(table)
    result.notes.append(f"{calls.received} payloads reached the subscriber while Publish was measured.")
    result.data = {"latency": figures}
    return result
