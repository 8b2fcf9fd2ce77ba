"""A change's effect on Store, side by side: two servers, one from a base tree and one from this
checkout, each storing the same tensor in turn (the order flipped every round).

    git worktree add /tmp/base HEAD~1
    python -m tests.benchmarks.compare_trees /tmp/base --transport tcp --size 1GiB --reps 5

Each server runs in a subprocess on its own data directory (``--metrics-port 0``, a free
``--data-port`` given as a number, which trees from before ``auto`` read too); the client is this checkout's ``tannery.Client``. Prints each tree's median
time, every round's time and the server's CPU seconds per round. This is how the Store
changes of docs/benchmarks.md ("Why the code is like this: Store path") were measured; the
transport case of ``make bench`` gives the figures against Arrow Flight.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import tannery

from .harness import parse_size

HERE = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(tree: Path, data_dir: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{tree}/service:{tree}/client")
    process = subprocess.Popen(
        [sys.executable, "-m", "tannery_server", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--data-dir", data_dir, "--data-port", str(_free_port()), "--metrics-port", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with tannery.Client(target, transport="grpc", timeout=2) as client:
                client.list()
            return process, target
        except tannery.ServiceError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError(f"the server of {tree} did not start")
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the base tree (a git worktree of the commit to compare with)")
    parser.add_argument("--transport", default="tcp", choices=["grpc", "local", "tcp"])
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="bytes of the float32 tensor stored")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    tensor = torch.randn(args.size // 4)
    trees = {"base": args.base.resolve(), "this": HERE}
    times: dict[str, list[float]] = {name: [] for name in trees}
    cpus: dict[str, list[float]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        servers = {name: _serve(tree, os.path.join(scratch, name)) for name, tree in trees.items()}
        try:
            for round_ in range(args.reps + 1):  # round 0 warms up
                order = list(servers.items()) if round_ % 2 else list(servers.items())[::-1]
                for name, (process, target) in order:
                    with tannery.Client(target, transport=args.transport) as client:
                        cpu, started = _cpu_seconds(process.pid), time.perf_counter()
                        client.store("compare", {"w": tensor}, replace=True)
                        took = time.perf_counter() - started
                    if round_:
                        times[name].append(took)
                        cpus[name].append(_cpu_seconds(process.pid) - cpu)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait()
    for name in trees:
        median = statistics.median(times[name])
        print(f"{args.transport} Store {name}: median {median:.3f} s ({args.size / median / 1e9:.2f} GB/s); "
              f"rounds {[round(t, 3) for t in times[name]]}; server CPU s {[round(c, 2) for c in cpus[name]]}")


if __name__ == "__main__":
    main()
