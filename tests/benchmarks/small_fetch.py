"""A fetch of one 4 KiB entry against a bare grpcio call returning the same bytes, same run.

Servers (subprocesses): the raw grpcio peer (``peers.py grpc``: a bare generic handler),
tannery, and with ``--before DIR`` a second tannery server run from another source tree
(``DIR/client`` and ``DIR/service``, e.g. from ``git archive``), so a change to the
server's Fetch is measured against what it replaces, alternating, in one run. Each sample
is the mean of enough calls to last ~50 ms; reported: the median of the samples, the
spread, the ratio against the bare call, and the server's CPU microseconds per call.

    git archive HEAD~1 client service | tar -x -C /tmp/before
    python -m tests.benchmarks.small_fetch --before /tmp/before
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from tannery_protocol import codec
from tannery_protocol.v1 import archives_pb2

from . import clients, peers
from .harness import HOST, KiB, Subprocess, alternate, cpu_seconds, fmt_time, free_port, load_average

SIZE = 4 * KiB
BARE = "bare grpcio call (4 KiB)"


def _tannery(data_dir: Path, tree: Path | None) -> Subprocess:
    # Free ports written as numbers, which trees from before "auto" read too (their data port's
    # default was 50052, and 0 turned it off).
    env = {"TANNERY_METRICS_PORT": "0", "TANNERY_DATA_PORT": str(free_port())}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "client"), str(tree / "service"), os.environ.get("PYTHONPATH", "")])
    return Subprocess("-m", "tannery_server", "serve", "--host", HOST, "--port", "0", "--data-dir", str(data_dir),
                      "--log-format", "json", env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", default=15, type=int)
    parser.add_argument("--before", type=Path, help="also run a server from this source tree")
    args = parser.parse_args(argv)

    import tannery

    payload = codec.encode_numpy(np.arange(SIZE // 4, dtype=np.float32))
    with tempfile.TemporaryDirectory(prefix="tannery-small-fetch-") as tmp:
        servers = {"": _tannery(Path(tmp) / "now", None)}
        if args.before:
            servers[", --before tree"] = _tannery(Path(tmp) / "before", args.before.resolve())
        raw = Subprocess("-m", "tests.benchmarks.peers", "grpc")
        try:
            bare_channel = grpc.insecure_channel(raw.target)
            source = bare_channel.unary_stream(f"/{peers.SERVICE}/Source", clients._identity, clients._identity)
            bare_request = struct.pack("<QQ", 1, SIZE)
            rounds = {BARE: (raw.pid, lambda: sum(len(m) for m in source(bare_request)))}
            for label, server in servers.items():
                channel = grpc.insecure_channel(server.target)
                store = channel.stream_unary("/tannery.v1.Archives/Store", clients._identity,
                                             archives_pb2.ArchiveInfo.FromString)
                store(iter(clients.store_messages("small", {"small": payload})))
                fetch = channel.unary_stream("/tannery.v1.Archives/Fetch",
                                             archives_pb2.FetchRequest.SerializeToString, clients._identity)
                request = archives_pb2.FetchRequest(archive="small", entries=[archives_pb2.EntryAsk(name="small")])
                client = tannery.Client(server.target)
                assert client.fetch("small", ["small"]).find("small").numel() == SIZE // 4
                rounds[f"tannery Fetch, raw stub{label}"] = (server.pid, lambda f=fetch, r=request: sum(len(m) for m in f(r)))
                rounds[f"tannery.Client.fetch{label}"] = (server.pid, lambda c=client: c.fetch("small", ["small"]))

            def sample(pid: int, call) -> dict[str, float]:
                for _ in range(20):
                    call()
                calls, cpu, start = 0, cpu_seconds(pid), time.perf_counter()
                while time.perf_counter() - start < 0.05 or calls < 20:
                    call()
                    calls += 1
                elapsed = time.perf_counter() - start
                return {"time": elapsed / calls, "server cpu": (cpu_seconds(pid) - cpu) / calls}

            timings = alternate({name: (lambda p=pid, c=call: sample(p, c)) for name, (pid, call) in rounds.items()},
                                args.reps)
        finally:
            raw.close()
            for server in servers.values():
                server.close()
    base = timings[BARE]["time"].median
    print(f"One 4 KiB entry, {args.reps} samples of >= 50 ms each, alternating; load average {load_average()}")
    print("| competitor | median per call | spread | vs bare grpcio call | server CPU per call |")
    print("|---|---|---|---|---|")
    for name, quantities in timings.items():
        samples = quantities["time"]
        print(f"| {name} | {fmt_time(samples.median)} | {samples.spread()} | {samples.median / base:.2f}x | "
              f"{quantities['server cpu'].median * 1e6:.0f} µs |")


if __name__ == "__main__":
    main()
