"""Scale: how Store and Fetch time grows with the size and with concurrent clients; Union.

- Size: one entry of 1 MiB, 2 MiB, ... 1 GiB stored (pre-built messages) and fetched
  (raw bytes), alternating with the raw grpcio ceiling's Sink and Source of the same
  bytes. The ratio per doubling is the time at 2S over the time at S: 2.00 is linear,
  lower means a fixed cost still dominates, higher means worse than linear.
- Concurrency: 1, 4 and 16 clients (a thread and a channel each) storing, then
  fetching, an archive of their own (distinct bytes) at the same time, against as many
  concurrent Sink/Source calls of the ceiling. Aggregate throughput.
- Union of two archives of 1 GiB (64 entries each; 64 MiB with ``--quick``): its time,
  and what it wrote (blob files and bytes under ``blobs/`` before and after, and the
  server's ``write_bytes`` from ``/proc``: only the catalog's pages).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc

from . import clients
from .harness import (GiB, MiB, CaseResult, Options, Samples, Subprocess, Table, alternate, fmt_rate, fmt_ratio,
                      fmt_size, fmt_time, free_memory, io_written, scratch, tannery_server)
from tannery_protocol.v1 import archives_pb2


def blob_usage(data_dir: Path) -> tuple[int, int]:
    files = [p for p in (data_dir / "blobs").glob("*/*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def growth(options: Options, raw_channel, tannery_channel, result: CaseResult) -> None:
    top = 64 * MiB if options.quick else GiB
    sizes = options.sizes or [MiB << i for i in range((top // MiB).bit_length())]
    table = Table("Time against size (one entry)", ["size", "Store", "per doubling", "Sink (ceiling)", "per doubling",
                                                    "Fetch", "per doubling", "Source (ceiling)", "per doubling"],
                  note="Medians; 'per doubling' is this size's time over the previous size's.")
    previous: dict[str, float] = {}
    series: dict[str, list] = {}
    for size in sizes:
        tensor = clients.random_tensor(size, seed=size)
        payload = clients.tannic_payload(tensor)
        ceiling = clients.RawCeiling(raw_channel, payload)
        tannery = clients.TanneryMessages(tannery_channel, payload, archive="scale")
        del payload

        def both(competitor) -> dict[str, float]:
            start = time.perf_counter()
            competitor.upload(tensor)
            middle = time.perf_counter()
            competitor.download()
            end = time.perf_counter()
            competitor.clear()
            return {"up": middle - start, "down": end - middle}

        timings = alternate({"tannery": lambda: both(tannery), "ceiling": lambda: both(ceiling)},
                            options.repetitions(size))
        medians = {"Store": timings["tannery"]["up"].median, "Sink": timings["ceiling"]["up"].median,
                   "Fetch": timings["tannery"]["down"].median, "Source": timings["ceiling"]["down"].median}
        row = [fmt_size(size)]
        for name in ("Store", "Sink", "Fetch", "Source"):
            ratio = medians[name] / previous[name] if name in previous else None
            row += [fmt_time(medians[name]), f"{ratio:.2f}" if ratio else "–"]
            series.setdefault(name, []).append([size, medians[name]])
        table.add(*row)
        previous = medians
        del tensor, ceiling, tannery, timings
        free_memory()
    result.tables.append(table)
    result.data["growth"] = series


def concurrency(options: Options, raw_target: str, tannery_target: str, result: CaseResult) -> None:
    each = 16 * MiB if options.quick else 64 * MiB
    counts = (1, 4) if options.quick else (1, 4, 16)
    table = Table(f"Concurrent clients, {fmt_size(each)} each", [
        "clients", "Store", "Sink (ceiling)", "Store vs ceiling", "Fetch", "Source (ceiling)", "Fetch vs ceiling"],
        note="Aggregate throughput (all clients' bytes over the time until the last one finished), medians.")
    series: dict[str, list] = {}
    for count in counts:
        payloads = [clients.tannic_payload(clients.random_tensor(each, seed=1000 + i)) for i in range(count)]
        raw_channels = [grpc.insecure_channel(raw_target) for _ in range(count)]
        tannery_channels = [grpc.insecure_channel(tannery_target) for _ in range(count)]
        ceilings = [clients.RawCeiling(ch, p) for ch, p in zip(raw_channels, payloads)]
        tannerys = [clients.TanneryMessages(ch, p, archive=f"client-{i}")
                    for i, (ch, p) in enumerate(zip(tannery_channels, payloads))]
        del payloads

        def together(competitors) -> dict[str, float]:
            out = {}
            for phase in ("upload", "download"):
                barrier = threading.Barrier(len(competitors) + 1)
                errors: list[BaseException] = []

                def work(competitor) -> None:
                    barrier.wait()
                    try:
                        getattr(competitor, phase)(None) if phase == "upload" else competitor.download()
                    except BaseException as error:  # reported below
                        errors.append(error)

                threads = [threading.Thread(target=work, args=(c,)) for c in competitors]
                for thread in threads:
                    thread.start()
                barrier.wait()
                start = time.perf_counter()
                for thread in threads:
                    thread.join()
                out[phase] = time.perf_counter() - start
                if errors:
                    raise errors[0]
            for competitor in competitors:
                competitor.clear()
            return out

        timings = alternate({"tannery": lambda: together(tannerys), "ceiling": lambda: together(ceilings)},
                            options.repetitions(each * count))
        nbytes = each * count
        t, c = timings["tannery"], timings["ceiling"]
        table.add(count, fmt_rate(nbytes, t["upload"].median), fmt_rate(nbytes, c["upload"].median),
                  fmt_ratio(c["upload"].median / t["upload"].median), fmt_rate(nbytes, t["download"].median),
                  fmt_rate(nbytes, c["download"].median), fmt_ratio(c["download"].median / t["download"].median))
        for name, samples in (("Store", t["upload"]), ("Sink", c["upload"]), ("Fetch", t["download"]),
                              ("Source", c["download"])):
            series.setdefault(name, []).append([count, nbytes / samples.median])
        for channel in raw_channels + tannery_channels:
            channel.close()
        del ceilings, tannerys, timings
        free_memory()
    result.tables.append(table)
    result.data["concurrency"] = series


def union(options: Options, channel, server_pid: int, data_dir: Path, result: CaseResult) -> None:
    each = 64 * MiB if options.quick else GiB
    entries = 64
    stub_store = channel.stream_unary("/tannery.v1.Archives/Store", clients._identity,
                                      archives_pb2.ArchiveInfo.FromString)
    stub_union = channel.unary_unary("/tannery.v1.Archives/Union", archives_pb2.UnionRequest.SerializeToString,
                                     archives_pb2.ArchiveInfo.FromString)
    stub_delete = channel.unary_unary("/tannery.v1.Archives/Delete", archives_pb2.DeleteRequest.SerializeToString,
                                      archives_pb2.DeleteResponse.FromString)
    for source in ("a", "b"):
        def messages(source=source):
            yield archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=source)).SerializeToString()
            sent = 0
            for i in range(entries):
                payload = clients.tannic_payload(clients.random_tensor(each // entries, seed=hash((source, i)) % 2**32))
                sent += len(payload)
                for index, piece in enumerate(clients.payload_chunks(payload)):
                    message = archives_pb2.StoreRequest(chunk=piece)
                    if index == 0:
                        message.entry = f"layer{i:03d}.weight"
                    yield message.SerializeToString()
            yield clients.commit_message(entries, sent)

        stub_store(messages())
    request = archives_pb2.UnionRequest(target="ab", sources=[archives_pb2.UnionSource(archive="a", prefix="a"),
                                                               archives_pb2.UnionSource(archive="b", prefix="b")])
    samples = Samples()
    written = []
    blobs_before = blob_usage(data_dir)
    for _ in range(options.repetitions()):
        io_before = io_written(server_pid)
        start = time.perf_counter()
        info = stub_union(request)
        samples.values.append(time.perf_counter() - start)
        written.append(io_written(server_pid) - io_before)
        assert info.entries == 2 * entries and info.payload_bytes >= 2 * each
        assert blob_usage(data_dir) == blobs_before, "Union wrote blobs"
        stub_delete(archives_pb2.DeleteRequest(archive="ab"))
    table = Table(f"Union of two {fmt_size(each)} archives ({entries} entries each)",
                  ["median", "spread", "blob files before → after", "blob bytes written",
                   "server write_bytes (catalog), median"])
    written.sort()
    table.add(fmt_time(samples.median), samples.spread(), f"{blobs_before[0]} → {blob_usage(data_dir)[0]}", "0",
              f"{written[len(written) // 2] / 1024:.0f} KiB")
    result.tables.append(table)
    result.target(f"Union of two {fmt_size(each)} archives", samples.median * 1e3, 100, higher_is_better=False,
                  unit=" ms")
    result.data["union_ms"] = [v * 1e3 for v in samples.values]


def run(options: Options) -> CaseResult:
    result = CaseResult("scale", "Scale: size, concurrent clients, Union", __doc__.split("\n\n", 1)[1].strip())
    with (scratch(options, "scale") as tmp, tannery_server(tmp / "data") as server,
          Subprocess("-m", "tests.benchmarks.peers", "grpc") as raw,
          grpc.insecure_channel(raw.target) as raw_channel, grpc.insecure_channel(server.target) as channel):
        growth(options, raw_channel, channel, result)
        concurrency(options, raw.target, server.target, result)
        union(options, channel, server.pid, tmp / "data", result)
    return result
