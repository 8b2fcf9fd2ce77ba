"""Memory: peak RSS of the server and of the client while a large archive is stored and fetched.

The archive is 16 float32 entries (2 GiB in all; 256 MiB with ``--quick``), stored with
``tannery.Client.store`` and fetched back whole with ``tannery.Client.fetch``, then
streamed with ``fetch_iter`` (each tensor checked and dropped as it arrives) and with
``fetch_pieces`` (views of the received messages, nothing gathered). The
server's RSS and anonymous RSS (``RssAnon``: not counting mapped files) are sampled every
5 ms from ``/proc``; so is this process's, the client, whose figure is its growth over
what it held before the call (the tensors themselves are 2 GiB: a fetch must hold them
once). For scale, the raw grpcio ceiling's server is sampled while it sinks and sources
the same bytes.
"""

from __future__ import annotations

import os

import grpc
import torch

from . import clients
from .harness import (GiB, MiB, CaseResult, Options, PeakRss, Subprocess, Table, fmt_size, free_memory, proc_status,
                      scratch, tannery_server)

ENTRIES = 16


def mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.0f} MiB"


def run(options: Options) -> CaseResult:
    total = options.sizes[-1] if options.sizes else (256 * MiB if options.quick else 2 * GiB)
    result = CaseResult("memory", f"Memory: storing and fetching a {fmt_size(total)} archive",
                        __doc__.split("\n\n", 1)[1].strip())
    table = Table("Peak memory", ["call", "process", "peak RSS", "peak RssAnon", "peak growth over the start",
                                  "vs the archive's size"],
                  note="Highest of the repetitions. Growth: peak minus the process's RSS just before the call.")
    per_entry = total // ENTRIES
    tensors = {f"layer{i:02d}.weight": clients.random_tensor(per_entry, seed=i) for i in range(ENTRIES)}
    peaks: dict[tuple[str, str], tuple[int, int, int]] = {}

    def record(call: str, process: str, rss: PeakRss, start: int) -> None:
        old = peaks.get((call, process), (0, 0, 0))
        peaks[call, process] = (max(old[0], rss.rss), max(old[1], rss.anon), max(old[2], rss.rss - start))

    with scratch(options, "memory") as tmp, tannery_server(tmp / "data") as server:
        client = clients.TanneryClient(server.target, archive="memory")
        for _ in range(2 if options.quick else options.repetitions() // 2 or 1):
            for call in ("Store", "Fetch", "Fetch, fetch_iter", "Fetch, fetch_pieces"):
                free_memory()
                me, them = proc_status(os.getpid())["VmRSS"], proc_status(server.pid)["VmRSS"]
                with PeakRss(server.pid) as server_rss, PeakRss(os.getpid()) as client_rss:
                    if call == "Store":
                        client.client.store("memory", tensors, replace=True)
                    elif call == "Fetch":
                        fetched = client.client.fetch("memory")
                    elif call == "Fetch, fetch_iter":
                        streamed = 0
                        for name, tensor in client.client.fetch_iter("memory"):
                            assert torch.equal(tensor, tensors[name]), name
                            streamed += tensor.nbytes
                            del tensor
                        assert streamed == total, (streamed, total)
                    else:
                        streamed = sum(len(piece.data) for piece in client.client.fetch_pieces("memory"))
                        assert streamed == total, (streamed, total)
                if call == "Fetch":
                    assert all(torch.equal(fetched.find(n), t) for n, t in tensors.items())
                    del fetched
                record(call, "tannery server", server_rss, them)
                record(call, "tannery.Client (this process)", client_rss, me)
            client.clear()
        client.close()
    payload = b"".join(clients.tannic_payload(t) for t in tensors.values())
    del tensors
    free_memory()
    with Subprocess("-m", "tests.benchmarks.peers", "grpc") as raw, grpc.insecure_channel(raw.target) as channel:
        ceiling = clients.RawCeiling(channel, payload)
        del payload
        for call, fn in (("Store", lambda: ceiling.upload(None)), ("Fetch", ceiling.download)):
            start = proc_status(raw.pid)["VmRSS"]
            with PeakRss(raw.pid) as rss:
                fn()
            record(call, "raw grpcio ceiling server", rss, start)
        del ceiling
    free_memory()
    for (call, process), (rss, anon, growth) in sorted(peaks.items()):
        table.add(call, process, mib(rss), mib(anon), mib(growth), f"{growth / total:.2f}")
    result.tables.append(table)
    server_peak = max(anon for (call, process), (_, anon, _) in peaks.items() if process == "tannery server")
    result.target(f"tannery server's peak anonymous RSS storing and fetching {fmt_size(total)}", server_peak / MiB,
                  300, higher_is_better=False, unit=" MiB")
    result.data = {"total": total, "peaks": {f"{c}|{p}": v for (c, p), v in peaks.items()}}
    return result

