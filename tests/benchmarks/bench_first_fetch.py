"""First fetch: one tensor fetched once by a new client process, what a pod pays at every start.

One tannery server and the Arrow Flight peer of the transport case (both subprocesses) hold
the same float32 tensor. Each repetition runs every competitor once, each in a new Python
process (imports and connecting untimed; ``tests/benchmarks/client_fetch.py`` does the
fetching), in an order rotated by the repetition: ``tannery.Client`` on each data path
(``local``, ``tcp``, ``grpc``) and Flight's DoGet (its 1 MiB record batches combined into one
tensor, as in the transport case). The transport case measures a long-lived client's later
fetches; this one its first, into memory the process never had.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import tannery

from . import clients
from .client_fetch import FLIGHT, GRPC, LOCAL, TCP
from .harness import (GiB, MiB, CaseResult, Options, Subprocess, Table, fmt_rate, fmt_ratio, fmt_size, scratch,
                      tannery_server)

COMPETITORS = [LOCAL, TCP, GRPC, FLIGHT]


def _fetch_once(competitor: str, target: str, pid: int) -> dict:
    """One fetch in a new process: its wall time, client CPU, server CPU and peak RSS."""
    out = subprocess.run([sys.executable, "-m", "tests.benchmarks.client_fetch", "--child", competitor, target,
                          str(pid), "bench"], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(options: Options) -> CaseResult:
    sizes = options.pick_sizes([GiB], [64 * MiB])
    result = CaseResult(
        "first-fetch", "First fetch: a new client process fetches one tensor once", __doc__.split("\n\n", 1)[1].strip())
    table = Table("First fetch in a new process", ["size", "competitor", "median", "spread (slow – fast)",
                                                  "vs Flight DoGet", "client CPU s/GiB", "server CPU s/GiB",
                                                  "client peak RSS"])
    result.tables.append(table)
    with (scratch(options, "first-fetch") as tmp, tannery_server(tmp / "data") as server,
          Subprocess("-m", "tests.benchmarks.peers", "flight") as flight):
        for size in sizes:
            tensor = clients.random_tensor(size)
            with tannery.Client(server.target, transport="grpc") as client:
                client.store("bench", {"t": tensor}, replace=True)
            uploader = clients.ArrowFlight(flight.target)
            uploader.upload(tensor)
            uploader.close()
            del tensor
            competitors = options.select({c: c for c in COMPETITORS}, FLIGHT)
            runs: dict[str, list[dict]] = {c: [] for c in competitors}
            for rep in range(options.repetitions(size)):
                order = list(competitors)
                for competitor in order[rep % len(order):] + order[: rep % len(order)]:
                    target, pid = (flight.target, flight.pid) if competitor == FLIGHT else (server.target, server.pid)
                    runs[competitor].append(_fetch_once(competitor, target, pid))
            flight_median = statistics.median(r["wall"] for r in runs[FLIGHT])
            per_gib = GiB / size
            for competitor, measured in runs.items():
                walls = [r["wall"] for r in measured]
                median = statistics.median(walls)
                table.add(fmt_size(size), competitor, fmt_rate(size, median),
                          f"{fmt_rate(size, max(walls))} – {fmt_rate(size, min(walls))}", fmt_ratio(flight_median / median),
                          f"{statistics.median(r['cpu'] for r in measured) * per_gib:.2f}",
                          f"{statistics.median(r['server'] for r in measured) * per_gib:.2f}",
                          f"{statistics.median(r['peak'] for r in measured) / MiB:.0f} MiB")
                result.data.setdefault(competitor, {})[size] = median
            if size == max(sizes):
                for competitor, goal in ((LOCAL, 3.0), (TCP, 1.3)):
                    if competitor in runs:
                        ratio = flight_median / statistics.median(r["wall"] for r in runs[competitor])
                        result.target(f"first {competitor} Fetch at {fmt_size(size)} vs Flight's first DoGet",
                                      ratio, goal)
    return result
