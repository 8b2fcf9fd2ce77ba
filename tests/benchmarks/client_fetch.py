"""Fetch through ``tannery.Client`` against raw stubs reading the same server, each run in a fresh process.

One server (a subprocess) holds one archive; every repetition runs each variant once, in a
fresh client process, in an order rotated by the repetition (so drift on a shared machine
spreads over all of them). Per variant: the median wall time and its ratio against raw
stubs, the CPU seconds per GiB of the client process (all its threads) and of the server
during the fetch (steadier than wall time on a shared machine), and the client's peak RSS.

Variants:

- ``raw bytes``: a bare ``unary_stream`` stub whose deserializer passes the bytes through,
  each message dropped as read (the floor of any Python client of this server);
- ``tannery.Client`` / ``tannery.aio.Client``: ``fetch`` to tensors (``transport="auto"``: the
  same-host path here); ``tannery.Client tcp`` and ``tannery.Client grpc``: the data port and
  the gRPC streams, forced;
- ``tannery.Client.fetch_iter``: the streaming fetch, each tensor dropped as it arrives;
- ``tannery.Client, huge pages``: ``fetch`` with every new receive map advised ``MADV_HUGEPAGE``
  (as numpy does for arrays from 4 MiB), patched in here: the client never asks for huge pages
  (what docs/benchmarks.md, "Client memory", measured);
- ``Arrow Flight DoGet``: the same bytes as a one-column table from the Flight peer of the
  transport case (1 MiB record batches, combined into one tensor), the baseline of a client's
  first fetch in a new process (what a pod pays at start; a long-lived client's later fetches
  are the transport case's);
- ``... , untuned``: that variant with ``TANNERY_RECEIVE_TUNING=0`` (no map reuse, no pages
  faulted in ahead or from behind): what the client's memory tricks are worth;
- ``--before DIR``: ``tannery.Client`` from another source tree (``DIR/client``, e.g. from
  ``git archive``), to compare a change with what it replaces in the same run
  (``--before-as VARIANT``: that variant of it instead).

    python -m tests.benchmarks.client_fetch --size 1GiB --entries 1 --reps 5
    git archive HEAD~1 client | tar -x -C /tmp/before
    python -m tests.benchmarks.client_fetch --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB, MiB = 1 << 30, 1 << 20
RAW = "raw bytes"
CLIENT = "tannery.Client"
AIO = "tannery.aio.Client"
ITER = "tannery.Client.fetch_iter"
HUGE = "tannery.Client, huge pages"
TCP = "tannery.Client tcp"
GRPC = "tannery.Client grpc"
LOCAL = "tannery.Client local"
FLIGHT = "Arrow Flight DoGet"
BEFORE = "tannery.Client, --before tree"
VARIANTS = [RAW, CLIENT, TCP, GRPC, AIO, ITER, HUGE, FLIGHT]
#: A variant with this suffix runs as the one before it with the client's memory tricks off
#: (``TANNERY_RECEIVE_TUNING=0``, :mod:`tannery.dataplane.receive_memory`): what they are worth.
UNTUNED = ", untuned"
UNTUNED_VARIANTS = [v + UNTUNED for v in (CLIENT, TCP, GRPC, LOCAL, ITER)]


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _advise_huge_pages() -> None:
    """Every map the client makes for received payloads from now on asks for transparent huge
    pages (mremap keeps the advice as a map grows)."""
    import mmap

    from tannery.dataplane import receive_memory

    fresh = receive_memory.new_map

    def new_map(size: int) -> mmap.mmap:
        memory = fresh(size)
        memory.madvise(mmap.MADV_HUGEPAGE)
        return memory

    receive_memory.new_map = new_map


def measure(variant: str, target: str, server_pid: int, archive: str) -> dict:
    """Fetch ``archive`` once in this process, as ``variant`` does."""
    import asyncio

    import grpc

    import tannery
    import tannery.aio
    import tannery.torch  # torch, imported by tannery on first use: not part of the fetch timed
    from tannery_protocol.v1 import archives_pb2

    if variant == HUGE:
        _advise_huge_pages()
    if variant == RAW:
        channel = grpc.insecure_channel(target)
        fetch = channel.unary_stream("/tannery.v1.Archives/Fetch", archives_pb2.FetchRequest.SerializeToString,
                                     lambda data: data)
        run = lambda: sum(len(m) for m in fetch(archives_pb2.FetchRequest(archive=archive)))  # noqa: E731
    elif variant == AIO:
        async def fetch_async():
            async with tannery.aio.Client(target) as client:
                return await client.fetch(archive)

        run = lambda: asyncio.run(fetch_async())  # noqa: E731
    elif variant == FLIGHT:
        from .clients import ArrowFlight

        flight = ArrowFlight(target)
        run = flight.download
    elif variant in (TCP, GRPC, LOCAL):
        client = tannery.Client(target, transport=variant.rsplit(" ", 1)[1])
        run = lambda: client.fetch(archive)  # noqa: E731
    elif variant == ITER:
        client = tannery.Client(target)
        run = lambda: sum(tensor.nbytes for _, tensor in client.fetch_iter(archive))  # noqa: E731
    else:
        client = tannery.Client(target)
        run = lambda: client.fetch(archive)  # noqa: E731
    server, cpu, start = _server_cpu(server_pid), time.process_time(), time.perf_counter()
    result = run()
    wall, cpu, server = time.perf_counter() - start, time.process_time() - cpu, _server_cpu(server_pid) - server
    del result
    return {"wall": wall, "cpu": cpu, "server": server, "peak": _peak_rss()}


def _peak_rss() -> int:
    """VmHWM: this process's peak RSS since its exec (``ru_maxrss`` counts the parent's too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    from .harness import load_average, parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", type=parse_size, help="bytes of float32 tensors (1GiB)")
    parser.add_argument("--entries", default=1, type=int, help="entries the archive has (1)")
    parser.add_argument("--reps", default=5, type=int)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=[*VARIANTS, LOCAL, *UNTUNED_VARIANTS])
    parser.add_argument("--before", type=Path, help="also run tannery.Client from this source tree (its client/)")
    parser.add_argument("--before-as", default=CLIENT, choices=[CLIENT, ITER, TCP, GRPC, LOCAL],
                        help="what the --before tree runs (default: tannery.Client)")
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "TARGET", "PID", "ARCHIVE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, target, pid, archive = args.child
        variant = variant.removesuffix(UNTUNED)
        print(json.dumps(measure(os.environ.get("BEFORE_AS", CLIENT) if variant == BEFORE else variant, target,
                                 int(pid), archive)))
        return

    import tannery
    import torch

    from ..server_harness import ServerProcess
    from .clients import ArrowFlight
    from .harness import Subprocess

    variants = list(args.variants) + ([BEFORE] if args.before else [])
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with (tempfile.TemporaryDirectory(prefix="tannery-client-fetch-") as tmp,
          ServerProcess(Path(tmp) / "data", log_format="json") as server,
          Subprocess("-m", "tests.benchmarks.peers", "flight") as flight):
        generator = torch.Generator().manual_seed(0)
        per_entry = args.size // args.entries // 4
        tensors = {f"layer{i:03d}.weight": torch.randn(per_entry, generator=generator) for i in range(args.entries)}
        with tannery.Client(server.target) as client:
            client.store("bench", tensors)
        if FLIGHT in variants:
            uploader = ArrowFlight(flight.target)
            uploader.upload(torch.cat(list(tensors.values())))
            uploader.close()
        del tensors
        for rep in range(args.reps):
            for variant in variants[rep % len(variants):] + variants[: rep % len(variants)]:
                env = dict(os.environ)
                if variant.endswith(UNTUNED):
                    env["TANNERY_RECEIVE_TUNING"] = "0"
                if variant == BEFORE:
                    env["PYTHONPATH"] = os.pathsep.join([str(args.before.resolve() / "client"),
                                                         env.get("PYTHONPATH", "")])
                    env["BEFORE_AS"] = args.before_as
                target, pid = (flight.target, flight.pid) if variant == FLIGHT else (server.target, server.pid)
                out = subprocess.run(
                    [sys.executable, "-m", "tests.benchmarks.client_fetch", "--child", variant, target,
                     str(pid), "bench"], check=True, capture_output=True, text=True, env=env,
                ).stdout
                results[variant].append(json.loads(out.strip().splitlines()[-1]))
    nbytes = per_entry * 4 * args.entries
    per_gib = GiB / nbytes
    print(f"Fetch of {nbytes / MiB:.0f} MiB in {args.entries} float32 entries, {args.reps} repetitions "
          f"alternating, each in a fresh process; load average {load_average()}")
    print(f"| variant | median | spread | vs {RAW} | vs {FLIGHT} | client CPU s/GiB | server CPU s/GiB | "
          "client peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    base = statistics.median(r["wall"] for r in results[RAW]) if RAW in results else None
    flight = statistics.median(r["wall"] for r in results[FLIGHT]) if FLIGHT in results else None
    for variant, runs in results.items():
        walls = [r["wall"] for r in runs]
        wall = statistics.median(walls)
        ratio = f"{base / wall:.2f}x" if base else ""
        against_flight = f"{flight / wall:.2f}x" if flight else ""
        print(f"| {variant} | {nbytes / wall / 1e9:.2f} GB/s | {nbytes / max(walls) / 1e9:.2f} – "
              f"{nbytes / min(walls) / 1e9:.2f} | {ratio} | {against_flight} | {statistics.median(r['cpu'] for r in runs) * per_gib:.2f} | "
              f"{statistics.median(r['server'] for r in runs) * per_gib:.2f} | "
              f"{statistics.median(r['peak'] for r in runs) / MiB:.0f} MiB |")


if __name__ == "__main__":
    main()
