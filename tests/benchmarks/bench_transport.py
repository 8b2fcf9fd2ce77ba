"""Transport: one float32 tensor uploaded to a server on loopback and downloaded back.

Competitors (every server a subprocess, every client in this process, 1 MiB messages but
tannery's Fetch, which the server sends in chunks of its default size):

- the raw grpcio ceiling: bytes messages through a bare generic handler, no work on
  either side (the baseline of every ratio), and, when tannery's server sends messages of
  another size than 1 MiB, the same with its size (what its Fetch compares with message for
  message);
- the ceiling plus what a store must do with the bytes: written to a file and fsynced
  (upload), read from a file in the page cache with ``pread`` (download);
- tannery Store/Fetch with pre-built request bytes and raw response bytes: the server's
  share alone, the figure the 0.8x target is about;
- ``tannery.Client``: a tensor in, a tensor out (what users run), on each of its data paths:
  ``transport="grpc"`` (the gRPC streams), ``"local"`` (the server's Unix socket: a Fetch
  maps the blob file it is passed and checks every block's CRC before the tensor is handed
  out, so every byte is read; a Store passes sealed memory files) and ``"tcp"`` (the
  server's data port: ``sendfile`` out, ``recv_into`` the tensor in);
- pytannic's serialize/deserialize over its raw TCP framing;
- ``torch.save`` bytes in chunk-sized gRPC messages, ``torch.load`` on the way back;
- Apache Arrow Flight ``DoPut``/``DoGet`` of a one-column table.

Only tannery writes to disk (durably, as a store must); the other servers keep the bytes
in memory, which flatters them on upload. Every competitor is also given as a ratio to
Arrow Flight of the same run (DoPut for upload, DoGet for download). Each round is one
upload then one download; the server's copy is dropped after each round (so tannery's
Store writes every time).
"""

from __future__ import annotations

import gc
import time

import grpc
import torch

from . import clients
from .harness import (GiB, MiB, CaseResult, Options, Subprocess, Table, alternate, cpu_seconds, fmt_rate, fmt_ratio, fmt_size,
                      free_memory, scratch, tannery_server)

CEILING = "raw grpcio ceiling"
CEILING_LARGE = f"raw grpcio ceiling, {clients.TANNERY_SERVER_CHUNK >> 20} MiB messages"
CEILING_DISK = "ceiling + durable write / file read"
TANNERY_RAW = "tannery Store/Fetch (pre-built messages)"
TANNERY = "tannery.Client grpc"
TANNERY_LOCAL = "tannery.Client local"
TANNERY_TCP = "tannery.Client tcp"
PYTANNIC = "pytannic over TCP"
PYTANNIC_SHIPPED = "pytannic over TCP, Client.receive as shipped"
TORCH = "torch.save bytes over gRPC"
FLIGHT = "Arrow Flight DoPut/DoGet"
#: pytannic's own receive copies the message once per recv (quadratic): small sizes only.
SHIPPED_RECEIVE_MAX = 16 * MiB


def run(options: Options) -> CaseResult:
    sizes = options.pick_sizes([MiB, 16 * MiB, 256 * MiB, GiB], [MiB, 32 * MiB])
    result = CaseResult("transport", "Transport: upload and download of one tensor on loopback", __doc__.split("\n\n", 1)[1].strip())
    note = ("Throughput of the tensor's bytes (median of the repetitions, and the slowest to the fastest); "
            "ratios of medians against the ceilings of the same run; CPU seconds per GiB moved, of the server "
            "process and of the client (this process), medians (resolution 10 ms: meaningless below ~64 MiB).")
    tables = {d: Table(f"{d.capitalize()}", ["size", "competitor", "median", "spread (slow – fast)",
                                             f"vs {CEILING}", "vs ceiling + disk", "vs Flight",
                                             "server CPU s/GiB",
                                             "client CPU s/GiB"], note=note)
              for d in ("upload", "download")}
    series: dict[str, dict[str, list]] = {"upload": {}, "download": {}}
    ratios: dict[tuple[int, str, str], float] = {}
    with (scratch(options, "transport") as tmp, Subprocess("-m", "tests.benchmarks.peers", "grpc") as raw,
          Subprocess("-m", "tests.benchmarks.peers", "tcp") as tcp,
          Subprocess("-m", "tests.benchmarks.peers", "flight") as flight,
          tannery_server(tmp / "data") as server, grpc.insecure_channel(raw.target) as raw_channel,
          grpc.insecure_channel(server.target) as tannery_channel):
        for size in sizes:
            tensor = clients.random_tensor(size)
            payload = clients.tannic_payload(tensor)
            competitors = {
                CEILING: clients.RawCeiling(raw_channel, payload),
                CEILING_DISK: clients.RawCeiling(raw_channel, payload, durable_dir=tmp),
                TANNERY_RAW: clients.TanneryMessages(tannery_channel, payload),
                TANNERY: clients.TanneryClient(server.target),
                TANNERY_LOCAL: clients.TanneryClient(server.target, "bench-local", transport="local"),
                TANNERY_TCP: clients.TanneryClient(server.target, "bench-tcp", transport="tcp"),
                PYTANNIC: clients.PytannicTcp(tcp.target),
                TORCH: clients.TorchSaveGrpc(raw_channel),
                FLIGHT: clients.ArrowFlight(flight.target),
            }
            if clients.TANNERY_SERVER_CHUNK != clients.CHUNK:  # else it is the ceiling itself
                competitors[CEILING_LARGE] = clients.RawCeiling(raw_channel, payload, chunk=clients.TANNERY_SERVER_CHUNK)
            if size <= SHIPPED_RECEIVE_MAX:
                competitors[PYTANNIC_SHIPPED] = clients.PytannicTcp(tcp.target, shipped_receive=True)
            del payload
            competitors = options.select(competitors, CEILING, CEILING_DISK, FLIGHT)
            for name, competitor in competitors.items():  # each gives the tensor back, exactly
                competitor.upload(tensor)
                back = competitor.download()
                if isinstance(back, torch.Tensor):
                    assert torch.equal(back.view(-1), tensor), name
                competitor.clear()
                del back

            def round_of(competitor, pid: int):
                def measure() -> dict[str, float]:
                    cpu = [cpu_seconds(pid), time.process_time()]
                    start = time.perf_counter()
                    competitor.upload(tensor)
                    middle = time.perf_counter()
                    cpu += [cpu_seconds(pid), time.process_time()]
                    back = competitor.download()
                    end = time.perf_counter()
                    cpu += [cpu_seconds(pid), time.process_time()]
                    del back
                    competitor.clear()
                    return {"upload": middle - start, "download": end - middle,
                            "upload server cpu": cpu[2] - cpu[0], "upload client cpu": cpu[3] - cpu[1],
                            "download server cpu": cpu[4] - cpu[2], "download client cpu": cpu[5] - cpu[3]}

                return measure

            pids = {CEILING: raw.pid, CEILING_LARGE: raw.pid, CEILING_DISK: raw.pid, TORCH: raw.pid, TANNERY_RAW: server.pid,
                    TANNERY: server.pid, TANNERY_LOCAL: server.pid, TANNERY_TCP: server.pid, PYTANNIC: tcp.pid,
                    PYTANNIC_SHIPPED: tcp.pid, FLIGHT: flight.pid}
            timings = alternate({name: round_of(c, pids[name]) for name, c in competitors.items()},
                                options.repetitions(size))
            for competitor in competitors.values():
                competitor.close()
            nbytes = tensor.nbytes
            for direction, table in tables.items():
                base = timings[CEILING][direction].median
                disk = timings[CEILING_DISK][direction].median
                flight_time = timings[FLIGHT][direction].median
                for name, quantities in timings.items():
                    samples = quantities[direction]
                    ratio = base / samples.median
                    ratios[size, name, direction] = ratio
                    ratios[size, name, direction + " vs flight"] = flight_time / samples.median
                    per_gib = GiB / nbytes
                    table.add(fmt_size(size), name, fmt_rate(nbytes, samples.median), samples.rate_spread(nbytes),
                              fmt_ratio(ratio), fmt_ratio(disk / samples.median),
                              fmt_ratio(flight_time / samples.median),
                              f"{quantities[direction + ' server cpu'].median * per_gib:.2f}",
                              f"{quantities[direction + ' client cpu'].median * per_gib:.2f}")
                    series[direction].setdefault(name, []).append(
                        [size, nbytes / samples.median, nbytes / samples.high, nbytes / samples.low])
            del competitors, tensor, timings
            gc.collect()
            free_memory()
    result.tables += tables.values()
    largest = max(sizes)
    for direction, rpc in (("upload", "Store"), ("download", "Fetch")):
        if (largest, TANNERY_RAW, direction) not in ratios:
            continue
        result.target(f"tannery {rpc} at {fmt_size(largest)} (pre-built messages) vs the raw grpcio ceiling",
                      ratios[largest, TANNERY_RAW, direction], 0.8)
        others = {name: ratios.get((largest, name, direction))
                  for name in (TANNERY, TANNERY_LOCAL, TANNERY_TCP, CEILING_LARGE, CEILING_DISK, PYTANNIC, TORCH, FLIGHT)}
        result.notes.append(f"{rpc} at {fmt_size(largest)}, against the ceiling: " + "; ".join(
            f"{name} {fmt_ratio(r)}" for name, r in others.items() if r is not None) + ".")
    # The data paths' targets (issue 14), against Arrow Flight of the same run.
    for name, direction, rpc, flight_rpc, goal in (
            (TANNERY_LOCAL, "download", "same-host Fetch", "DoGet", 3.0),
            (TANNERY_LOCAL, "upload", "same-host Store", "DoPut", 0.6),
            (TANNERY_TCP, "download", "TCP data port Fetch", "DoGet", 1.3),
            (TANNERY_TCP, "upload", "TCP data port Store", "DoPut", 0.6)):
        ratio = ratios.get((largest, name, direction + " vs flight"))
        if ratio is not None:
            result.target(f"{rpc} at {fmt_size(largest)} ({name}) vs Arrow Flight {flight_rpc}", ratio, goal)
    result.data = {"series": series, "sizes": sizes}
    return result
