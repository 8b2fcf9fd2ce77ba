"""Channel fan-out: a state dict from one publisher to K subscriber processes, on each path.

A 256 MiB state dict in 16 float32 tensors (64 MiB with ``--quick``) published with
``tannery.Client.publish`` from this process to K = 3 subscriber processes
(``tests.benchmarks.channel_subscriber``), all on one path: the gRPC streams, the same-host
data path (sealed memory files) or the TCP data path (``transport="tcp"`` forced, as across
hosts). The time runs from the publish call to the last subscriber's last tensor; GiB/s is
what was delivered (K times the state dict) over it. CPU seconds per GiB delivered are given
for the server, the publisher (this process) and the K subscribers together.
``python -m tests.benchmarks --cases channel-fanout``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .harness import GiB, CaseResult, Options, Table, alternate, cpu_seconds, fmt_ratio, fmt_size, tannery_server

MiB = 1 << 20
#: Subscriber processes per path.
SUBSCRIBERS = 3
#: Tensors in the state dict.
TENSORS = 16
PATHS = ("grpc", "local", "tcp")
INTRO = __doc__.split("\n\n", 1)[1].strip()


class _Path:
    """One path's subscriber processes and publishing client, and the CPU each round used."""

    def __init__(self, target: str, transport: str) -> None:
        import tannery

        self.transport = transport
        self.channel = f"fanout-{transport}"
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "tests.benchmarks.channel_subscriber", target, transport,
                              str(TENSORS), self.channel], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(SUBSCRIBERS)]
        for process in self.processes:
            assert process.stdout.readline().strip() == "ready"
        self.client = tannery.Client(target, transport=transport)
        assert self.client.transport == transport
        #: CPU seconds per round: server, publisher, subscribers.
        self.cpu: dict[str, list[float]] = {"server": [], "publisher": [], "subscribers": []}

    def round(self, tensors: list, server_pid: int) -> float:
        """Publish once; the seconds until every subscriber has every tensor."""
        used = self._cpu(server_pid)
        for process in self.processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        started = time.monotonic()
        self.client.publish(self.channel, tensors)
        ended = max(float(process.stdout.readline().split()[1]) for process in self.processes)
        for key, now in self._cpu(server_pid).items():
            self.cpu[key].append(now - used[key])
        return ended - started

    def _cpu(self, server_pid: int) -> dict[str, float]:
        return {"server": cpu_seconds(server_pid), "publisher": time.process_time(),
                "subscribers": sum(cpu_seconds(p.pid) for p in self.processes)}

    def close(self) -> None:
        self.client.close()
        for process in self.processes:
            process.kill()
            process.wait()


def run(options: Options) -> CaseResult:
    import torch

    size = 64 * MiB if options.quick else 256 * MiB
    rng = np.random.default_rng(3)
    tensors = [torch.from_numpy(rng.standard_normal(size // TENSORS // 4, dtype=np.float32)) for _ in range(TENSORS)]
    delivered = SUBSCRIBERS * size
    result = CaseResult("channel-fanout", f"Channel fan-out: {fmt_size(size)} in {TENSORS} tensors to "
                        f"{SUBSCRIBERS} subscriber processes", INTRO)
    paths: dict[str, _Path] = {}
    with tempfile.TemporaryDirectory(dir=options.tmp) as tmp, tannery_server(Path(tmp) / "data") as server:
        try:
            for transport in options.select({p: p for p in PATHS}, "grpc"):
                paths[transport] = _Path(server.target, transport)
            for path in paths.values():  # a warm-up round each: the processes' first maps and connections
                path.round(tensors, server.pid)
                path.cpu = {key: [] for key in path.cpu}
            timings = alternate({t: (lambda p=p: p.round(tensors, server.pid)) for t, p in paths.items()},
                                options.repetitions())
        finally:
            for path in paths.values():
                path.close()
    table = Table(f"{fmt_size(size)} in {TENSORS} tensors, one publisher, {SUBSCRIBERS} subscriber processes",
                  ["path", "median time", "spread", "GiB/s delivered", "vs grpc", "server CPU s/GiB",
                   "publisher CPU s/GiB", "subscribers CPU s/GiB"],
                  note=f"Delivered: {SUBSCRIBERS} x {fmt_size(size)} per round. CPU per GiB delivered, medians over "
                       "the rounds.")
    base = timings["grpc"]["time"].median
    for transport, path in paths.items():
        samples = timings[transport]["time"]
        cpu = {key: statistics.median(values) / (delivered / GiB) for key, values in path.cpu.items()}
        table.add(transport, f"{samples.median:.2f} s", f"{samples.low:.2f} – {samples.high:.2f} s",
                  f"{delivered / GiB / samples.median:.2f}", fmt_ratio(base / samples.median),
                  f"{cpu['server']:.2f}", f"{cpu['publisher']:.2f}", f"{cpu['subscribers']:.2f}")
        result.data[transport] = {"seconds": samples.values, "cpu": path.cpu, "delivered": delivered}
    result.tables.append(table)
    return result
