"""Replicas on PostgreSQL and S3 (issue 15): a replica's Store, Fetch, small reads, cache and memory.

Servers, all on loopback: a private PostgreSQL (``tests/postgres_harness.py``) and SeaweedFS
(``tests/s3_harness.py``, ``weed server -s3``: master, volume server, filer and S3 gateway in
one process); two tannery replicas on that catalog and bucket (``TANNERY_CATALOG``,
``TANNERY_BLOBS``, the ``AWS_*`` variables; no data port), one without a cache and one with
``--cache-dir``; and an embedded tannery server on a data directory. Every client runs in this
process, ``tannery.Client`` with ``transport="grpc"`` and the default ``"auto"`` (which takes
the server's same-host socket here: on the shared backend without a cache the server fills a
memory file from the bucket and passes it; from the cache or a data directory it passes the
blob file). Archives are float32 entries (rows of 4 KiB): the 1 GiB archive is 4 entries of
256 MiB, the 2 GiB one 8 of them and a 4 KiB entry. ``--quick``: 128 MiB and 256 MiB (entries
of 32 MiB, which a replica holds in memory and uploads at their end, where 256 MiB ones
stream to their digest key as they arrive, the client having sent each digest ahead: quick
figures are a smoke test).

1. **Store and Fetch of a 1 GiB archive** on the replica without a cache, against the plain S3
   client of ``s3_client_baseline.py`` (boto3: s3transfer's multipart PUT, 16 MiB parts x 8,
   and parallel 16 MiB ranged GETs into one buffer) putting and getting the same 1 GiB (the
   four tensors' bytes, one object) to the same SeaweedFS; alternating, the order rotated each
   repetition. Each round stores new bytes (one value of each entry changed), so no Store finds
   its blobs in the bucket already.
2. **A 4 KiB read from a 2 GiB archive**: an entry of 4 KiB, and one row (4 KiB) of a 256 MiB
   entry at a random place, from the replica without a cache (a catalog query and a ranged
   GET of the block around it) and from the embedded server; each call timed, p50 and p90.
3. **A cache hit**: the 1 GiB archive fetched from the replica with a cache once its
   background fill is done, against the embedded server's Fetch of the same archive.
4. **Server memory**: the replica without a cache storing a 2 GiB archive (both transports)
   and fetching it (both), its ``RssAnon`` sampled every 5 ms. Measured first, on the fresh
   replica (as the ``memory`` case measures a fresh embedded server).

CPU seconds per GiB (``/proc``) of the tannery server, of SeaweedFS and of this process (the
client) are given beside each transfer.
"""

from __future__ import annotations

import gc
import random
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch

from . import clients
from .harness import (GiB, KiB, MiB, CaseResult, Options, PeakRss, Subprocess, Table, alternate, cpu_seconds,
                      fmt_rate, fmt_ratio, fmt_size, fmt_time, free_memory, load_average, percentile, proc_status,
                      scratch, tannery_server)
from .s3_client_baseline import baseline, boto3_client, boto3_get, boto3_put

BUCKET = "tannery-bench"
ROW = 4 * KiB
PLAIN = "plain S3 client (boto3)"
TRANSPORTS = ("grpc", "auto")
#: Seconds to wait for the cache's background fill before giving up on the cache figures.
FILL_TIMEOUT = 300.0


def _tensors(total: int, count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` float32 entries of 4 KiB rows, ``total`` bytes in all."""
    return {f"layer{i:02d}.weight": clients.random_tensor(total // count, seed=seed + i).view(-1, ROW // 4)
            for i in range(count)}


def _perturb(tensors: dict[str, torch.Tensor], value: float) -> None:
    """A new value in each entry's first element: new bytes, new digests, the same sizes."""
    for tensor in tensors.values():
        tensor[0, 0] = value


def _per_gib(seconds: float, nbytes: int) -> str:
    return f"{seconds * GiB / nbytes:.2f}"


def shared_backend(stack: ExitStack, root: Path, seaweed_class: type | None = None,
                   prefix: str = "replicas") -> tuple[Any, dict[str, str]]:
    """A private PostgreSQL and SeaweedFS (``seaweed_class``, else ``SeaweedFS``, with the bucket
    BUCKET) on loopback, closed by ``stack``: the SeaweedFS, and a replica's environment on them
    (``TANNERY_CATALOG``, ``TANNERY_BLOBS`` under ``prefix``, the ``AWS_*`` variables)."""
    from tests.postgres_harness import PostgresServer
    from tests.s3_harness import SeaweedFS

    postgres = PostgresServer()
    stack.callback(postgres.close)
    postgres.start()
    catalog = postgres.create_database("tannery_bench")
    seaweed = (seaweed_class or SeaweedFS)(root=root / "seaweedfs")
    stack.callback(seaweed.close)
    seaweed.create_bucket(BUCKET)
    return seaweed, {"TANNERY_CATALOG": catalog, "TANNERY_BLOBS": f"s3://{BUCKET}/{prefix}", **seaweed.env()}


def run(options: Options) -> CaseResult:
    sizes = options.sizes or ([128 * MiB, 256 * MiB] if options.quick else [GiB, 2 * GiB])
    archive_bytes, big_bytes = sizes[0], sizes[-1]
    reps = options.reps or 3
    result = CaseResult("replicas", "Replicas on PostgreSQL and S3", __doc__.split("\n\n", 1)[1].strip())
    hot = _tensors(archive_bytes, 4, seed=0)
    big = _tensors(big_bytes, 8, seed=100)
    big["small"] = clients.random_tensor(ROW, seed=999)
    data: dict = {"archive_bytes": archive_bytes, "big_bytes": big_bytes}
    with ExitStack() as stack:
        tmp = stack.enter_context(scratch(options, "replicas"))
        seaweed, shared_env = shared_backend(stack, tmp)
        aws = seaweed.env()
        weed_pid = seaweed._process.pid
        shared = stack.enter_context(tannery_server(tmp / "shared", env=shared_env, data_port="off"))
        cached = stack.enter_context(tannery_server(tmp / "cached", env=shared_env, data_port="off",
                                                    cache_dir=tmp / "cache", cache_size=4 * big_bytes))
        embedded = stack.enter_context(tannery_server(tmp / "embedded", data_port="off"))
        import tannery

        def client(server: Subprocess, transport: str) -> tannery.Client:
            made = tannery.Client(server.target, transport=None if transport == "auto" else transport)
            stack.callback(made.close)
            return made

        on = {(server, transport): client(server, transport) for server in (shared, cached, embedded)
              for transport in TRANSPORTS}
        data["auto is"] = {name: on[server, "auto"].transport
                           for name, server in (("shared", shared), ("cached", cached), ("embedded", embedded))}
        idle_anon = proc_status(shared.pid)["RssAnon"]  # the fresh replica's, before any call

        # 4. Memory: a 2 GiB archive stored and fetched through the replica without a cache ------
        print(f"  4. memory: {fmt_size(big_bytes)} through the replica (load {load_average()})", flush=True)
        memory = Table(f"4. The replica's memory storing and fetching a {fmt_size(big_bytes)} archive "
                       f"({len(big) - 1} entries of {fmt_size(big_bytes // (len(big) - 1))} and one of 4 KiB)",
                       ["call", "transport", "time", "rate", "peak RssAnon", "peak RssAnon over idle",
                        "RssAnon before the call", "peak RSS", "server CPU s/GiB"],
                       note="The fresh replica without a cache (the first calls it serves), sampled every 5 ms; "
                            "idle: its RssAnon before any call ({idle}). RSS counts the memory files a same-host "
                            "Fetch passes (shared memory), RssAnon does not.")
        peak_anon = 0
        big_total = sum(t.nbytes for t in big.values())
        memory_data = []
        for call, transport in (("Store", "grpc"), ("Store", "auto"), ("Fetch", "grpc"), ("Fetch", "auto")):
            free_memory()
            start_anon = proc_status(shared.pid)["RssAnon"]
            cpu = cpu_seconds(shared.pid)
            with PeakRss(shared.pid) as rss:
                began = time.perf_counter()
                if call == "Store":
                    if transport == "auto":
                        _perturb({k: v for k, v in big.items() if k != "small"}, 1.0)  # new bytes: written again
                    on[shared, transport].store("big", big, replace=True)
                else:
                    fetched = on[shared, transport].fetch("big")
                took = time.perf_counter() - began
            cpu = cpu_seconds(shared.pid) - cpu
            if call == "Fetch":
                assert all(torch.equal(fetched.find(n), t) for n, t in big.items()), transport
                del fetched
            peak_anon = max(peak_anon, rss.anon)
            memory.add(call, transport, fmt_time(took), fmt_rate(big_total, took), f"{rss.anon / MiB:.0f} MiB",
                       f"{(rss.anon - idle_anon) / MiB:.0f} MiB", f"{start_anon / MiB:.0f} MiB", f"{rss.rss / MiB:.0f} MiB",
                       _per_gib(cpu, big_total))
            memory_data.append({"call": call, "transport": transport, "seconds": took, "peak_anon": rss.anon,
                                "start_anon": start_anon, "peak_rss": rss.rss, "cpu": cpu})
        data["memory"] = memory_data
        data["idle_anon"] = idle_anon
        memory.note = memory.note.format(idle=f"{idle_anon / MiB:.0f} MiB")
        free_memory()

        # 1. Store and Fetch against the plain S3 client -----------------------------------------
        print(f"  1. Store/Fetch of {fmt_size(archive_bytes)} against the plain S3 client "
              f"(load {load_average()})", flush=True)
        check = baseline(archive_bytes, BUCKET, aws)  # the plain client once, its bytes checked
        data["baseline warm-up"] = check
        plain_bytes = memoryview(bytearray(archive_bytes))
        at = 0
        for tensor in hot.values():
            raw = tensor.view(-1).numpy().view("uint8")
            plain_bytes[at:at + raw.nbytes] = raw
            at += raw.nbytes
        nbytes = at
        s3 = boto3_client(aws)
        counter = [0]

        def cpus(server_pid: int | None) -> list[float]:
            return [cpu_seconds(server_pid) if server_pid else 0.0, cpu_seconds(weed_pid), time.process_time()]

        def transfer_round(up: Callable[[], None], down: Callable[[], object], server_pid: int | None):
            def measure() -> dict[str, float]:
                first = cpus(server_pid)
                start = time.perf_counter()
                up()
                middle = time.perf_counter()
                second = cpus(server_pid)
                back = down()
                end = time.perf_counter()
                third = cpus(server_pid)
                del back
                out = {"Store": middle - start, "Fetch": end - middle}
                for direction, (a, b) in (("Store", (first, second)), ("Fetch", (second, third))):
                    for name, x, y in zip(("server", "SeaweedFS", "client"), a, b):
                        out[f"{direction} {name} cpu"] = y - x
                return out

            return measure

        def plain_up() -> None:
            boto3_put(s3, BUCKET, "plain/archive", plain_bytes)

        def plain_down() -> object:
            return boto3_get(s3, BUCKET, "plain/archive", nbytes)

        def tannery_up(transport: str) -> Callable[[], None]:
            def up() -> None:
                counter[0] += 1
                _perturb(hot, float(counter[0]))
                on[shared, transport].store(f"run-{transport}", hot, replace=True)
            return up

        def tannery_down(transport: str) -> Callable[[], object]:
            return lambda: on[shared, transport].fetch(f"run-{transport}")

        for transport in TRANSPORTS:  # each gives back what it stored
            tannery_up(transport)()
            back = tannery_down(transport)()
            assert all(torch.equal(back.find(n), t) for n, t in hot.items()), transport
            del back
        competitors = {PLAIN: transfer_round(plain_up, plain_down, None)}
        for transport in TRANSPORTS:
            competitors[f"tannery.Client {transport}"] = transfer_round(tannery_up(transport), tannery_down(transport),
                                                                        shared.pid)
        timings = alternate(competitors, reps, between=free_memory)
        _perturb(hot, 0.0)
        table = Table(f"1. Store and Fetch of a {fmt_size(nbytes)} archive ({len(hot)} entries of "
                      f"{fmt_size(nbytes // len(hot))}) on the replica without a cache",
                      ["call", "competitor", "median", "spread", "rate (median)", f"vs {PLAIN}",
                       "tannery server CPU s/GiB", "SeaweedFS CPU s/GiB", "client CPU s/GiB"],
                      note=f"Medians of {reps} alternating repetitions; ratio: the plain client's median time over "
                           "the competitor's (higher is better). The plain client PUTs and GETs one object of "
                           "the same bytes.")
        ratios: dict[tuple[str, str], float] = {}
        for direction in ("Store", "Fetch"):
            base = timings[PLAIN][direction].median
            for name, quantities in timings.items():
                samples = quantities[direction]
                ratio = base / samples.median
                ratios[direction, name] = ratio
                cpu = {k: quantities[f"{direction} {k} cpu"].median for k in ("server", "SeaweedFS", "client")}
                table.add(direction if name == PLAIN else "", name + (" (PUT)" if name == PLAIN and direction == "Store"
                                                                     else " (GET)" if name == PLAIN else ""),
                          fmt_time(samples.median), samples.spread(), fmt_rate(nbytes, samples.median),
                          fmt_ratio(ratio), "–" if name == PLAIN else _per_gib(cpu["server"], nbytes),
                          _per_gib(cpu["SeaweedFS"], nbytes), _per_gib(cpu["client"], nbytes))
        result.tables.append(table)
        data["transfer"] = {name: {q: s.values for q, s in quantities.items()} for name, quantities in timings.items()}
        del plain_bytes, competitors, timings
        s3.delete_object(Bucket=BUCKET, Key="plain/archive")
        free_memory()

        # 2. Latency of a 4 KiB read from the 2 GiB archive --------------------------------------
        print(f"  2. 4 KiB reads from {fmt_size(big_bytes)} (load {load_average()})", flush=True)
        on[embedded, "grpc"].store("big", big, replace=True)
        rows_entry = next(iter(big))
        row_count = big[rows_entry].shape[0]
        rng = random.Random(15)
        latencies: dict[str, list[float]] = {}
        reads: dict[str, Callable[[], object]] = {}
        for label, server in (("shared, no cache", shared), ("embedded", embedded)):
            for transport in TRANSPORTS:
                remote = on[server, transport].archive("big")
                c = on[server, transport]
                reads[f"entry, {label}, {transport}"] = lambda c=c: c.fetch("big", ["small"]).find("small")
                reads[f"row, {label}, {transport}"] = (
                    lambda r=remote: (lambda i: r.rows(rows_entry, i, i + 1))(rng.randrange(row_count)))
        for name, read in reads.items():  # each right once, then warm
            if name.startswith("entry"):
                assert torch.equal(read(), big["small"]), name
            latencies[name] = []
        calls = 30 if options.quick else 60

        def latency_round(name: str) -> Callable[[], float]:
            def measure() -> float:
                read = reads[name]
                for _ in range(3):
                    read()
                total = 0.0
                for _ in range(calls):
                    began = time.perf_counter()
                    read()
                    took = time.perf_counter() - began
                    latencies[name].append(took)
                    total += took
                return total / calls
            return measure

        alternate({name: latency_round(name) for name in reads}, max(reps, 5))
        latency = Table(f"2. One 4 KiB read from a {fmt_size(big_bytes)} archive",
                        ["read", "backend", "transport", "calls", "p50", "p90", "p99", "p50 vs embedded",
                         "p90 vs embedded"],
                        note="Every call timed; rounds of calls alternate between the competitors. entry: "
                             "`fetch(archive, ['small'])` of a 4 KiB entry; row: `archive(...).rows(name, i, i + 1)` "
                             f"of a {fmt_size(big[rows_entry].nbytes)} entry at a random row (the server reads and "
                             "checks the 1 MiB block around it).")
        lat_ratio: dict[tuple[str, str], float] = {}
        for read in ("entry", "row"):
            for transport in TRANSPORTS:
                base = latencies[f"{read}, embedded, {transport}"]
                for label in ("shared, no cache", "embedded"):
                    values = latencies[f"{read}, {label}, {transport}"]
                    p50, p90 = percentile(values, 50) / percentile(base, 50), percentile(values, 90) / percentile(base, 90)
                    lat_ratio[read, label, transport] = p50
                    latency.add(read, label, transport, len(values), fmt_time(percentile(values, 50)),
                                fmt_time(percentile(values, 90)), fmt_time(percentile(values, 99)),
                                fmt_ratio(p50), fmt_ratio(p90))
        result.tables.append(latency)
        data["latency"] = latencies
        del reads
        on[embedded, "grpc"].delete("big")
        free_memory()

        # 3. A cache hit against the embedded server ---------------------------------------------
        print(f"  3. cache hit of {fmt_size(nbytes)} (load {load_average()})", flush=True)
        on[shared, "grpc"].store("hot", hot, replace=True)
        on[embedded, "grpc"].store("hot", hot, replace=True)
        cache_dir = tmp / "cache"
        began = time.perf_counter()
        first = on[cached, "grpc"].fetch("hot")
        first_fetch = time.perf_counter() - began
        assert all(torch.equal(first.find(n), t) for n, t in hot.items())
        del first
        filled = None
        while time.perf_counter() - began < FILL_TIMEOUT:
            files = [p for p in cache_dir.iterdir() if p.is_file()]
            if (not any(p.name.endswith(".part") for p in files)
                    and sum(p.stat().st_size for p in files) >= nbytes):
                filled = time.perf_counter() - began
                break
            time.sleep(0.2)
        data["cache"] = {"first fetch": first_fetch, "filled after": filled}
        if filled is None:
            result.notes.append(f"The cache did not fill within {FILL_TIMEOUT:.0f} s: no cache-hit figures.")
        else:
            def fetch_round(server: Subprocess, transport: str) -> Callable[[], dict[str, float]]:
                def measure() -> dict[str, float]:
                    cpu, mine = cpu_seconds(server.pid), time.process_time()
                    began = time.perf_counter()
                    back = on[server, transport].fetch("hot")
                    took = time.perf_counter() - began
                    out = {"time": took, "server cpu": cpu_seconds(server.pid) - cpu,
                           "client cpu": time.process_time() - mine}
                    del back
                    return out
                return measure

            weed_cpu = cpu_seconds(weed_pid)
            hits = alternate({f"{label}, {transport}": fetch_round(server, transport)
                              for label, server in (("replica with a cache (hit)", cached), ("embedded", embedded))
                              for transport in TRANSPORTS}, reps, between=free_memory)
            weed_cpu = cpu_seconds(weed_pid) - weed_cpu
            cache = Table(f"3. Fetch of a {fmt_size(nbytes)} archive from a replica's cache, against the embedded "
                          "server", ["server", "transport", "median", "spread", "rate", "vs embedded (time ratio)",
                                     "server CPU s/GiB", "client CPU s/GiB"],
                          note=f"Medians of {reps} alternating repetitions, after the cache was filled by a first "
                               f"Fetch ({fmt_time(first_fetch)}; the background fill was done "
                               f"{fmt_time(filled)} after that Fetch began). SeaweedFS used "
                               f"{weed_cpu:.2f} CPU s during these rounds (nothing read from the bucket).")
            cache_ratio = {}
            for label in ("replica with a cache (hit)", "embedded"):
                for transport in TRANSPORTS:
                    q = hits[f"{label}, {transport}"]
                    ratio = q["time"].median / hits[f"embedded, {transport}"]["time"].median
                    cache_ratio[label, transport] = ratio
                    cache.add(label, transport, fmt_time(q["time"].median), q["time"].spread(),
                              fmt_rate(nbytes, q["time"].median), fmt_ratio(ratio),
                              _per_gib(q["server cpu"].median, nbytes), _per_gib(q["client cpu"].median, nbytes))
            result.tables.append(cache)
            data["cache"]["hits"] = {n: {k: s.values for k, s in q.items()} for n, q in hits.items()}
        result.tables.append(memory)

        # Targets -------------------------------------------------------------------------------
        for direction, what in (("Store", "PUT"), ("Fetch", "GET")):
            for transport in TRANSPORTS:
                result.target(f"{direction} of {fmt_size(nbytes)} through a replica, tannery.Client {transport} "
                              f"(auto = {data['auto is']['shared']}), vs the plain S3 client's {what}",
                              ratios[direction, f"tannery.Client {transport}"], 0.7)
        for transport in TRANSPORTS:
            result.target(f"4 KiB entry from a {fmt_size(big_bytes)} archive, p50 on the shared backend (no cache) "
                          f"/ the embedded one, {transport}", lat_ratio["entry", "shared, no cache", transport], 3.0,
                          higher_is_better=False)
        if filled is not None:
            for transport in TRANSPORTS:
                result.target(f"Fetch of {fmt_size(nbytes)} from a replica's cache / the embedded server's, "
                              f"{transport}", cache_ratio["replica with a cache (hit)", transport], 1.2,
                              higher_is_better=False)
        result.target(f"the replica's peak anonymous RSS storing and fetching {fmt_size(big_bytes)}",
                      peak_anon / MiB, 300, higher_is_better=False, unit=" MiB")
        result.target(f"the same, over the idle replica's ({idle_anon / MiB:.0f} MiB)", (peak_anon - idle_anon) / MiB,
                      300, higher_is_better=False, unit=" MiB")
        end_anon = proc_status(shared.pid)["RssAnon"]
        data["end_anon"] = end_anon
        result.notes.append(f"The replica without a cache held {end_anon / MiB:.0f} MiB RssAnon at the end of the case "
                            f"(after every Store and Fetch above; {idle_anon / MiB:.0f} MiB idle at its start).")
        result.notes.append(f"auto took: {', '.join(f'{k} {v}' for k, v in data['auto is'].items())}.")
        result.notes.append(f"The plain client's warm-up round (`baseline()`, its bytes checked): PUT "
                            f"{fmt_time(check['put_s'])}, GET {fmt_time(check['get_s'])}.")
        result.notes.append(f"Load average at the end of the case: {load_average()}.")
    result.data = data
    gc.collect()
    return result
