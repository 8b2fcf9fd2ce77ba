"""Load: 32 concurrent clients mixing every RPC, and a channel pair, for 30 s against one server process.

Each client works in its own namespace (``load07/...``), so no call races another's Delete:
every error is a bug. Every Fetch (by names, by prefix, by rows) is checked byte-exact,
every Describe and List against what the client stored. A publisher sends numbered tensors
on a channel in calls of a few each; its subscriber must receive every one, in order. The
server's RSS and open file descriptors, sampled after a warm-up and at the end, stay flat.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

import tannery
from tannery_protocol.codec import DTYPES, encode_prefix
from tannery_protocol.names import join, owns
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import archives_pb2_grpc

from .server_harness import ServerProcess, collect_fetch, store_requests
from .store_checks import list_all, store_problems

SEED = int(os.environ.get("TANNERY_LOAD_SEED", "3232"))
SECONDS = float(os.environ.get("TANNERY_LOAD_SECONDS", "30"))
CLIENTS = 32
WARM_UP = 6.0
#: Archives a client keeps; beyond, it deletes its oldest.
KEEP = 4
RSS_GROWTH = 64 << 20
FD_GROWTH = 8
CHANNEL = "load/pair"


def matrix(rng: random.Random, nbytes: int) -> bytes:
    """A float32 payload of shape [rows, cols] of about ``nbytes`` random bytes."""
    cols = rng.choice([1, 4, 16, 64])
    rows = max(1, nbytes // (4 * cols))
    return encode_prefix(DTYPES["float32"], [rows, cols]) + rng.randbytes(4 * rows * cols)


def rows_of(payload: bytes, start: int, stop: int) -> bytes:
    """The payload rows [start, stop) of a 2-D float32 payload make, as the server sends them."""
    rows, cols = (int.from_bytes(payload[33 + 8 * i : 41 + 8 * i], "little") for i in range(2))
    stop = min(stop, rows)
    body = payload[49 + 4 * cols * start : 49 + 4 * cols * stop]
    return encode_prefix(DTYPES["float32"], [stop - start, cols]) + body


def server_figures(pid: int) -> tuple[int, int]:
    """The server's resident set (bytes) and number of open file descriptors."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) << 10
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Tally:
    """Calls by RPC, errors, and wrong answers of the whole run (shared by the clients)."""

    calls: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, rpc: str) -> None:
        with self.lock:
            self.calls[rpc] += 1

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


class LoadClient:
    """One client: a channel of its own, a namespace of its own, and a model of what it stored."""

    def __init__(self, target: str, index: int, tally: Tally, stop: threading.Event) -> None:
        self.rng = random.Random(SEED * 100 + index)
        self.prefix = f"load{index:02d}/"
        self.tally, self.stop = tally, stop
        self.channel = grpc.insecure_channel(target)
        self.stub = archives_pb2_grpc.ArchivesStub(self.channel)
        self.model: dict[str, dict[str, bytes]] = {}
        self.count = 0

    def run(self) -> None:
        ops = [(self.store, 5), (self.fetch_names, 4), (self.fetch_prefix, 2), (self.fetch_rows, 2),
               (self.fetch_shared, 2), (self.describe, 2), (self.list, 1), (self.union, 1), (self.delete, 1)]
        try:
            while not self.stop.is_set():
                op = self.rng.choices([o for o, _ in ops], [w for _, w in ops])[0]
                if op is not self.store and not self.model:
                    op = self.store
                try:
                    op()
                except grpc.RpcError as error:
                    self.tally.error(f"{self.prefix} {op.__name__}: {error.code().name} {error.details()!r}")
        finally:
            self.channel.close()

    def own(self) -> str:
        return self.rng.choice(sorted(self.model))

    def store(self) -> None:
        if len(self.model) >= KEEP:
            self.delete()
        self.count += 1
        name = f"{self.prefix}a{self.count}"
        sizes = [1 << 10, 16 << 10, 128 << 10, 512 << 10]
        entries = {n: matrix(self.rng, 3 << 20 if self.rng.random() < 0.02 else self.rng.choice(sizes))
                   for n in self.rng.sample(["blk.0.w", "blk.0.b", "blk.1.w", "head", "emb"], self.rng.randint(1, 4))}
        self.tally.call("Store")
        info = self.stub.Store(store_requests(name, entries, self.rng.choice([64 << 10, 1 << 20])), timeout=120)
        if info.entries != len(entries):
            self.tally.error(f"Store {name}: {info.entries} entries answered, {len(entries)} sent")
        self.model[name] = entries

    def fetch_names(self) -> None:
        name = self.own()
        asked = self.rng.sample(sorted(self.model[name]), self.rng.randint(1, len(self.model[name])))
        self.tally.call("Fetch names")
        request = pb.FetchRequest(archive=name, entries=[pb.EntryAsk(name=n) for n in asked])
        got = collect_fetch(self.stub.Fetch(request, timeout=120))
        if got != {n: self.model[name][n] for n in asked}:
            self.tally.error(f"Fetch {name} {asked}: bytes differ")

    def fetch_prefix(self) -> None:
        name = self.own()
        prefix = self.rng.choice(["blk", "blk.0", "blk.1", "head", "emb", ""])
        owned = {n: p for n, p in sorted(self.model[name].items()) if owns(prefix, n)}
        self.tally.call("Fetch prefix")
        try:
            got = collect_fetch(self.stub.Fetch(pb.FetchRequest(archive=name, prefix=prefix), timeout=120))
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND and not owned:
                return  # a prefix that owns nothing: expected
            raise
        if got != owned:
            self.tally.error(f"Fetch {name} prefix {prefix!r}: {sorted(got)} instead of {sorted(owned)}")

    def fetch_rows(self) -> None:
        name = self.own()
        entry = self.rng.choice(sorted(self.model[name]))
        payload = self.model[name][entry]
        rows = int.from_bytes(payload[33:41], "little")
        start = self.rng.randrange(rows)
        stop = self.rng.randint(start + 1, rows)
        self.tally.call("Fetch rows")
        request = pb.FetchRequest(archive=name, entries=[pb.EntryAsk(name=entry, rows=pb.RowRange(start=start,
                                                                                               stop=stop))])
        got = collect_fetch(self.stub.Fetch(request, timeout=120))
        if got != {entry: rows_of(payload, start, stop)}:
            self.tally.error(f"Fetch {name}/{entry} rows [{start}, {stop}): bytes differ")

    def fetch_shared(self) -> None:
        self.tally.call("Fetch shared")
        got = collect_fetch(self.stub.Fetch(pb.FetchRequest(archive="shared", entries=[pb.EntryAsk(name="w")]),
                                            timeout=120))
        if got.get("w") != SHARED["w"]:
            self.tally.error("Fetch shared/w: bytes differ")

    def describe(self) -> None:
        name = self.own()
        self.tally.call("Describe")
        described = self.stub.Describe(pb.DescribeRequest(archive=name), timeout=120)
        if sorted(e.name for e in described.entries) != sorted(self.model[name]):
            self.tally.error(f"Describe {name}: entries differ")

    def list(self) -> None:
        self.tally.call("List")
        names = [a.name for a in list_all(self.stub, self.prefix, page_size=self.rng.choice([0, 2]))]
        if names != sorted(self.model):
            self.tally.error(f"List {self.prefix}: {names} instead of {sorted(self.model)}")

    def union(self) -> None:
        if len(self.model) < 2:
            return self.store()
        if len(self.model) >= KEEP:
            self.delete()
        a, b = self.rng.sample(sorted(self.model), 2)
        self.count += 1
        target = f"{self.prefix}u{self.count}"
        self.tally.call("Union")
        self.stub.Union(pb.UnionRequest(target=target, sources=[pb.UnionSource(archive=a, prefix="x"),
                                                                pb.UnionSource(archive=b, prefix="y")]), timeout=120)
        self.model[target] = ({join("x", n): p for n, p in self.model[a].items()}
                              | {join("y", n): p for n, p in self.model[b].items()})

    def delete(self) -> None:
        name = sorted(self.model, key=lambda n: int(n.rsplit("/", 1)[1][1:]))[0]
        self.tally.call("Delete")
        self.stub.Delete(pb.DeleteRequest(archive=name), timeout=120)
        del self.model[name]


SHARED = {"w": matrix(random.Random(SEED), 256 << 10)}


class ChannelPair:
    """A publisher of numbered tensors in calls of a few each, and the subscriber that must get them all."""

    def __init__(self, target: str, stop: threading.Event, tally: Tally) -> None:
        self.target, self.stop, self.tally = target, stop, tally
        self.published = 0
        self.received: list[torch.Tensor] = []
        self.client = tannery.Client(target)
        self.subscription = self.client.subscribe(CHANNEL)  # registered once this returns
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    @staticmethod
    def tensor(seq: int) -> torch.Tensor:
        return torch.arange(seq, seq + 1 + seq % 4096, dtype=torch.int64)

    def read(self) -> None:
        try:
            for tensor in self.subscription:
                self.received.append(tensor)
        except tannery.ServiceError as error:
            self.tally.error(f"Subscribe: {error!r}")

    def publish(self) -> None:
        rng = random.Random(SEED)
        with tannery.Client(self.target) as publisher:
            while not self.stop.is_set():
                batch = [self.tensor(self.published + i) for i in range(rng.randint(1, 8))]
                self.tally.call("Publish")
                try:
                    publisher.publish(CHANNEL, batch)
                except tannery.ServiceError as error:
                    self.tally.error(f"Publish: {error!r}")
                    return
                self.published += len(batch)
                time.sleep(0.005)

    def finish(self, timeout: float = 60) -> list[str]:
        """Wait for the subscriber to get everything published; what went wrong."""
        deadline = time.monotonic() + timeout
        while len(self.received) < self.published and time.monotonic() < deadline:
            time.sleep(0.05)
        self.subscription.close()
        self.reader.join(10)
        self.client.close()
        problems = []
        if len(self.received) != self.published:
            problems.append(f"subscriber received {len(self.received)} of {self.published} payloads")
        wrong = [i for i, t in enumerate(self.received) if not torch.equal(t, self.tensor(i))]
        if wrong:
            problems.append(f"{len(wrong)} payloads out of order or wrong, the first at {wrong[0]}")
        return problems


@pytest.mark.slow
def test_32_clients_mixing_every_rpc_for_30_seconds(tmp_path, record_property):
    tally = Tally()
    stop = threading.Event()
    with ServerProcess(tmp_path / "data") as server:
        with grpc.insecure_channel(server.target) as channel:
            archives_pb2_grpc.ArchivesStub(channel).Store(store_requests("shared", SHARED), timeout=60)
        pair = ChannelPair(server.target, stop, tally)
        clients = [LoadClient(server.target, i, tally, stop) for i in range(CLIENTS)]
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
        threads.append(threading.Thread(target=pair.publish, daemon=True))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(WARM_UP)
        rss_before, fds_before = server_figures(server.pid)
        peak = rss_before
        while time.monotonic() - started < SECONDS:
            time.sleep(0.5)
            peak = max(peak, server_figures(server.pid)[0])
        stop.set()
        for thread in threads:
            thread.join(120)
        elapsed = time.monotonic() - started
        pair_problems = pair.finish()
        time.sleep(1.0)  # calls settle: the server closes what the last ones held
        rss_after, fds_after = server_figures(server.pid)
        model = {"shared": SHARED} | {name: e for c in clients for name, e in c.model.items()}
        with grpc.insecure_channel(server.target) as channel:
            stub = archives_pb2_grpc.ArchivesStub(channel)
            listed = len(list_all(stub))
            problems = store_problems(stub, server.data_dir, model)
    calls = sum(tally.calls.values())
    summary = (f"load: {CLIENTS} clients + a channel pair for {elapsed:.1f} s: {calls} calls "
               f"({calls / elapsed:.0f}/s; {dict(sorted(tally.calls.items()))}), {len(tally.errors)} errors; "
               f"{pair.published} payloads published, {len(pair.received)} received; server RSS "
               f"{rss_before >> 20} MiB after warm-up, {rss_after >> 20} MiB at the end (peak {peak >> 20} MiB), "
               f"fds {fds_before} -> {fds_after}; {listed} archives listed")
    print("\n" + summary)
    record_property("load_summary", summary)
    assert not tally.errors, f"{len(tally.errors)} errors: {tally.errors[:10]}"
    assert not pair_problems, pair_problems
    assert not problems, problems
    assert all(tally.calls[rpc] > 0 for rpc in ("Store", "Fetch names", "Fetch prefix", "Fetch rows", "Describe",
                                                "List", "Union", "Delete", "Publish")), tally.calls
    assert rss_after - rss_before <= RSS_GROWTH, summary
    assert fds_after - fds_before <= FD_GROWTH, summary
