"""Store and Fetch of one archive against the raw grpcio ceiling, and the server's memory.

Both servers run as subprocesses and the client here, with identical client work: the
same pre-built message bytes are sent to the ceiling's ``Sink`` and to ``Store`` (sent
as already-serialized ``StoreRequest``s), and both ``Fetch`` and ``Source`` are read as
raw bytes. The server's anonymous RSS (``RssAnon``: not counting mapped files or the page
cache) is sampled during each call.

    python -m tests.benchmarks.archives_throughput --size 1GiB
    python -m tests.benchmarks.archives_throughput --size 2GiB --repeat 1   # the memory target
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from tannery.codec import DTYPES, encode_prefix
from tannery.v1 import archives_pb2
from tannery_server.config import parse_size

from ..server_harness import ServerProcess

MiB = 1 << 20


def _identity(data: bytes) -> bytes:
    return data


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples a process's RssAnon every few milliseconds while in use."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon(self.pid))
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRss":
        self.peak = rss_anon(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    name: str
    seconds: float
    nbytes: int
    peak_rss: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def archive_messages(name: str, size: int, entries: int, chunk: int) -> list[bytes]:
    """Serialized StoreRequests of an archive of ``entries`` random float32 tensors totalling ``size`` bytes."""
    rng = np.random.default_rng(0)
    per_entry = size // entries // 4
    messages = [archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=name, replace=True)).SerializeToString()]
    for index in range(entries):
        data = rng.integers(0, 2**32, per_entry, dtype=np.uint32).view(np.float32)
        payload = encode_prefix(DTYPES["float32"], (per_entry,)) + data.tobytes()
        for start in range(0, len(payload), chunk):
            message = archives_pb2.StoreRequest(chunk=payload[start : start + chunk])
            if start == 0:
                message.entry = f"layer{index:03d}.weight"
            messages.append(message.SerializeToString())
    return messages


def start_raw_server() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "tests.benchmarks.raw_grpc_server", "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r"serving on (\S+)", line)
    if not match:
        process.kill()
        raise RuntimeError(f"raw server did not start: {line!r}")
    return process, match.group(1)


def timed(name: str, pid: int, call, nbytes: int) -> Result:
    with PeakRss(pid) as rss:
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    return Result(name, seconds, nbytes, rss.peak)


def run(size: int, chunk: int, entries: int, repeat: int, data_dir: Path) -> list[Result]:
    messages = archive_messages("bench", size, entries, chunk)
    total = sum(len(m) for m in messages)
    fetch_messages = len(messages) - 1
    results: list[Result] = []

    raw, raw_target = start_raw_server()
    try:
        with grpc.insecure_channel(raw_target) as channel:
            sink = channel.stream_unary(f"/bench.Raw/Sink", request_serializer=_identity, response_deserializer=_identity)
            source = channel.unary_stream(f"/bench.Raw/Source", request_serializer=_identity,
                                          response_deserializer=_identity)

            def fetch_raw() -> None:
                for _ in source(struct.pack("<QQ", fetch_messages, chunk)):
                    pass

            for _ in range(repeat):
                results.append(timed("ceiling: client stream (Sink)", raw.pid, lambda: sink(iter(messages)), total))
                results.append(timed("ceiling: server stream (Source)", raw.pid, fetch_raw, fetch_messages * chunk))
    finally:
        raw.terminate()
        raw.wait()

    with ServerProcess(data_dir, chunk_size=chunk, log_format="json") as server:
        with grpc.insecure_channel(server.target) as channel:
            store = channel.stream_unary("/tannery.v1.Archives/Store", request_serializer=_identity,
                                         response_deserializer=archives_pb2.ArchiveInfo.FromString)
            fetch = channel.unary_stream("/tannery.v1.Archives/Fetch",
                                         request_serializer=archives_pb2.FetchRequest.SerializeToString,
                                         response_deserializer=_identity)
            fetched = [0]

            def fetch_all() -> None:
                fetched[0] = sum(len(m) for m in fetch(archives_pb2.FetchRequest(archive="bench")))

            delete = channel.unary_unary("/tannery.v1.Archives/Delete",
                                         request_serializer=archives_pb2.DeleteRequest.SerializeToString,
                                         response_deserializer=archives_pb2.DeleteResponse.FromString)
            for index in range(repeat):
                if index:  # so that every Store writes (and fsyncs) all its blobs
                    delete(archives_pb2.DeleteRequest(archive="bench"))
                results.append(timed("tannery: Store", server.pid, lambda: store(iter(messages)), total))
                results.append(timed("tannery: Fetch", server.pid, fetch_all, total))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", type=parse_size)
    parser.add_argument("--chunk", default="1MiB", type=parse_size)
    parser.add_argument("--entries", default=16, type=int)
    parser.add_argument("--repeat", default=2, type=int)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tannery-bench-") as tmp:
        data_dir = args.data_dir or Path(tmp) / "data"
        results = run(args.size, args.chunk, args.entries, args.repeat, data_dir)
    best: dict[str, Result] = {}
    for r in results:
        if r.name not in best or r.seconds < best[r.name].seconds:
            best[r.name] = r
    print(f"archive of {args.size / MiB:.0f} MiB in {args.entries} entries, {args.chunk // 1024} KiB chunks, "
          f"best of {args.repeat}")
    print(f"{'':34} {'GB/s':>7} {'seconds':>8} {'peak RssAnon MiB':>17}")
    for r in best.values():
        print(f"{r.name:34} {r.gbps:7.3f} {r.seconds:8.3f} {r.peak_rss / MiB:17.1f}")
    store = best["tannery: Store"].gbps / best["ceiling: client stream (Sink)"].gbps
    fetch = best["tannery: Fetch"].gbps / best["ceiling: server stream (Source)"].gbps
    print(f"Store / ceiling: {store:.2f}x   Fetch / ceiling: {fetch:.2f}x   (target >= 0.8x)")


if __name__ == "__main__":
    main()
