"""Small entries: archives of 100 to 10,000 float32 tensors of 16 elements (64 bytes each).

Archives of thousands of small entries are ordinary (optimizer state, DCP shards, norms, MoE
experts). Entries are named like a state_dict's, ``layers.N.experts.M.w`` (8 experts a layer),
and all hold distinct values. ``--quick``: 100 and 1,000 entries. Competitors, alternating,
the order rotated each repetition:

- **safetensors** on the same disk, the baseline of every ratio: ``save_file`` followed by an
  fsync of the file and of its directory; ``safe_open(path, "pt")`` + ``get_tensor(name)``;
  ``load_file(path)``.
- **tannery, embedded**: the server of the other cases (SQLite catalog, blobs in its data
  directory), ``tannery.Client`` with ``transport="grpc"`` and ``"local"`` (same-host socket).
- **tannery, replica**: one replica on a private PostgreSQL and SeaweedFS, set up as the
  ``replicas`` case does (no data port), the same two transports; skipped, with a note, when
  PostgreSQL or SeaweedFS cannot start.

Calls, through the public API only: **Store** (``client.store(name, tensors)``, new values
every round, so every Store writes); **one-entry read**, 20 calls a round, each of an entry
drawn at random: ``client.archive(name).tensor(one, (16,), float32)`` with a fresh
``archive()`` each call (open + read) and ``client.fetch(name, names=[one])``; **whole
fetch**, ``client.fetch(name)``. Beside the times: CPU seconds of the tannery server, of this
process (the client) and of SeaweedFS; the files a Store added to the embedded server's data
directory and the objects it added to the bucket; and the S3 requests on the bucket by kind,
read from SeaweedFS's own Prometheus metrics (``weed server -metricsPort``), scraped before and
after each call, not from tannery.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import safetensors
import safetensors.torch
import torch

from .bench_replicas import BUCKET, shared_backend
from .bucket_requests import MeteredSeaweedFS, counted, data_files, fmt_requests
from .harness import (CaseResult, Options, Samples, Subprocess, Table, alternate, cpu_seconds, fmt_ratio, fmt_time,
                      free_memory, load_average, scratch, tannery_server)

ELEMENTS = 16
EXPERTS = 8
COUNTS, QUICK_COUNTS = [100, 1_000, 10_000], [100, 1_000]
READS = 20  # one-entry reads per round
TRANSPORTS = ("grpc", "local")
PREFIX = "small-entries"  # the replica's blobs in the bucket
BASE_STORE = "safetensors save_file + fsync"
BASE_READ = "safetensors safe_open + get_tensor"
BASE_FETCH = "safetensors load_file"
CPU = ("server cpu", "client cpu", "SeaweedFS cpu")


def entry_names(count: int) -> list[str]:
    return [f"layers.{i // EXPERTS}.experts.{i % EXPERTS}.w" for i in range(count)]


def make_tensors(count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of 16 random values, each its own storage (safetensors wants that)."""
    values = torch.randn(count, ELEMENTS, generator=torch.Generator().manual_seed(seed))
    return {name: values[i].clone() for i, name in enumerate(entry_names(count))}


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Backend:
    """A tannery server under test, its clients by transport, and how to count what it stores."""

    label: str
    server: Subprocess
    clients: dict[str, Any]
    data_dir: Path | None = None
    seaweed: MeteredSeaweedFS | None = None
    #: Set when SeaweedFS's metrics cannot be read: objects are still counted.
    no_metrics: str = ""

    def cpu(self) -> dict[str, float]:
        out = {"server cpu": cpu_seconds(self.server.pid), "client cpu": time.process_time()}
        if self.seaweed is not None:
            out["SeaweedFS cpu"] = cpu_seconds(self.seaweed.pid)
        return out

    def requests(self):
        """The bucket's S3 requests so far by kind, once they stay still; None without a bucket."""
        if self.seaweed is None or self.no_metrics:
            return None
        return self.seaweed.settled_requests(BUCKET)

    def stored(self) -> int:
        if self.seaweed is not None:
            return self.seaweed.objects(BUCKET, PREFIX + "/")
        assert self.data_dir is not None
        return data_files(self.data_dir)


@dataclass
class Log:
    """What rounds record beside their quantities: bucket requests and every call's time."""

    requests: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    calls: dict[str, list[float]] = field(default_factory=dict)

    def median_requests(self, name: str) -> dict[str, float] | None:
        rounds = self.requests.get(name)
        if not rounds:
            return None
        kinds = {kind for r in rounds for kind in r}
        return {kind: statistics.median(r.get(kind, 0) for r in rounds) for kind in kinds}


def metered(backend: Backend, call: Callable[[], Any], log: Log, name: str, count_stored: bool = False
            ) -> dict[str, float]:
    """One timed call with the server's, client's and SeaweedFS's CPU, bucket requests and (if
    asked) what it stored counted around it; a listing is done outside the scrapes."""
    stored = backend.stored() if count_stored else 0
    requests, cpu = backend.requests(), backend.cpu()
    started = time.perf_counter()
    result = call()
    took = time.perf_counter() - started
    cpu_after, requests_after = backend.cpu(), backend.requests()
    del result
    out = {"time": took, **{k: cpu_after[k] - cpu[k] for k in cpu}}
    if requests is not None:
        log.requests.setdefault(name, []).append(counted(requests, requests_after))
    if count_stored:
        out["stored"] = backend.stored() - stored
    return out


def baseline_store(directory: Path, count: int, serial: list[int]) -> Callable[[], dict[str, float]]:
    def measure() -> dict[str, float]:
        serial[0] += 1
        tensors = make_tensors(count, serial[0])
        path = directory / f"{count}-{serial[0]}.safetensors"
        cpu, started = time.process_time(), time.perf_counter()
        safetensors.torch.save_file(tensors, str(path))
        fsync_path(path)
        fsync_path(directory)
        return {"time": time.perf_counter() - started, "client cpu": time.process_time() - cpu}
    return measure


def tannery_store(backend: Backend, transport: str, count: int, serial: list[int], log: Log, name: str
                  ) -> Callable[[], dict[str, float]]:
    def measure() -> dict[str, float]:
        serial[0] += 1
        tensors = make_tensors(count, serial[0])
        archive = f"store-{count}-{backend.label}-{transport}-{serial[0]}"
        return metered(backend, lambda: backend.clients[transport].store(archive, tensors), log, name, True)
    return measure


def read_round(read: Callable[[str], torch.Tensor], names: list[str], seed: int, log: Log, name: str,
               backend: Backend | None) -> Callable[[], float]:
    """``READS`` one-entry reads of random entries (the same sequence for every competitor)."""
    rng = random.Random(seed)

    def measure() -> float:
        picks = [rng.choice(names) for _ in range(READS)]
        requests = backend.requests() if backend is not None else None
        times = []
        for entry in picks:
            started = time.perf_counter()
            read(entry)
            times.append(time.perf_counter() - started)
        if requests is not None:
            log.requests.setdefault(name, []).append(counted(requests, backend.requests(), READS))
        log.calls.setdefault(name, []).extend(times)
        return statistics.median(times)
    return measure


def _cpu_cell(quantities: dict[str, Samples], key: str) -> str:
    return f"{quantities[key].median:.2f}" if key in quantities else "–"


def _skipped_row(table: Table, reason: str) -> None:
    table.add("–", "replica", f"skipped: {reason}", *["–"] * (len(table.columns) - 3))


def _start_replica(stack: ExitStack, tmp: Path) -> Backend:
    seaweed, env = shared_backend(stack, tmp, MeteredSeaweedFS, prefix=PREFIX)
    server = stack.enter_context(tannery_server(tmp / "replica", env=env, data_port="off"))
    backend = Backend("replica", server, {}, seaweed=seaweed)
    try:
        seaweed.requests(BUCKET)
    except OSError as exc:
        backend.no_metrics = f"SeaweedFS's metrics could not be read ({exc}): bucket requests not counted"
    return backend


def run(options: Options) -> CaseResult:
    counts = QUICK_COUNTS if options.quick else COUNTS
    reps = options.reps or 3  # as in replicas: a 10,000-entry Store through the replica takes ~50 s
    result = CaseResult("small-entries", "Small entries: archives of thousands of 64-byte tensors",
                        __doc__.split("\n\n", 1)[1].strip())
    import tannery

    store_table = Table("Store", ["entries", "backend", "competitor", "median", "spread", "per entry",
                                  "× safetensors", "server CPU s", "client CPU s", "SeaweedFS CPU s",
                                  "files / objects added", "bucket requests"])
    read_table = Table("One-entry read", ["entries", "backend", "competitor", "median per read",
                                          "spread (round medians)", "× safetensors", f"vs {counts[0]} entries",
                                          "bucket requests per read"])
    fetch_table = Table("Whole fetch", ["entries", "backend", "competitor", "median", "spread", "× safetensors",
                                        "server CPU s", "client CPU s", "SeaweedFS CPU s", "bucket requests"])
    data: dict[str, Any] = {"counts": counts, "reps": reps, "reads per round": READS, "store": {}, "read": {},
                            "fetch": {}, "requests": {}}
    log = Log()
    read_medians: dict[str, float] = {}
    with ExitStack() as stack:
        tmp = stack.enter_context(scratch(options, "small-entries"))
        backends = [Backend("embedded", stack.enter_context(tannery_server(tmp / "embedded")), {},
                            data_dir=tmp / "embedded")]
        skipped = ""
        try:
            backends.append(_start_replica(stack, tmp))
        except Exception as exc:  # no PostgreSQL, no weed, a start that failed: the embedded half still runs
            skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            result.notes.append(f"The replica half was skipped: PostgreSQL or SeaweedFS could not start ({skipped}).")
        for backend in backends:
            for transport in TRANSPORTS:
                backend.clients[transport] = tannery.Client(backend.server.target, transport=transport)
                stack.callback(backend.clients[transport].close)
            if backend.no_metrics:
                result.notes.append(backend.no_metrics + ".")
        files = tmp / "safetensors"
        files.mkdir()
        serial = [0]
        for count in counts:
            print(f"  {count} entries: Store (load {load_average()})", flush=True)
            stores = {BASE_STORE: baseline_store(files, count, serial)}
            for backend in backends:
                for transport in TRANSPORTS:
                    name = f"{backend.label} {transport}"
                    stores[name] = tannery_store(backend, transport, count, serial, log, f"store {count} {name}")
            stores = options.select(stores, BASE_STORE)
            timed_stores = alternate(stores, reps, between=free_memory)

            # The archive and the file that the reads read: the same tensors.
            tensors = make_tensors(count, 1_000_000 + count)
            archive, path = f"read-{count}", files / f"read-{count}.safetensors"
            safetensors.torch.save_file(tensors, str(path))
            names = entry_names(count)
            one = names[count // 2]
            for backend in backends:
                backend.clients["grpc"].store(archive, tensors)
                for transport, client in backend.clients.items():
                    assert torch.equal(client.archive(archive).tensor(one, (ELEMENTS,), torch.float32), tensors[one])
                    assert torch.equal(client.fetch(archive, names=[one]).find(one), tensors[one])
                    whole = client.fetch(archive)
                    assert len(whole) == count and all(torch.equal(whole.find(n), t) for n, t in tensors.items())
                    del whole

            def by_safetensors(entry: str) -> torch.Tensor:
                with safetensors.safe_open(path, "pt") as f:
                    return f.get_tensor(entry)

            print(f"  {count} entries: one-entry reads (load {load_average()})", flush=True)
            reads: dict[str, Callable[[], float]] = {
                BASE_READ: read_round(by_safetensors, names, count, log, f"read {count} {BASE_READ}", None)}
            for backend in backends:
                for transport, client in backend.clients.items():
                    for how, read in (
                            ("archive().tensor", lambda e, c=client: c.archive(archive).tensor(
                                e, (ELEMENTS,), torch.float32)),
                            ("fetch(names=[one])", lambda e, c=client: c.fetch(archive, names=[e]).find(e))):
                        name = f"{backend.label} {transport} {how}"
                        reads[name] = read_round(read, names, count, log, f"read {count} {name}", backend)
            reads = options.select(reads, BASE_READ)
            timed_reads = alternate(reads, reps)

            print(f"  {count} entries: whole fetch (load {load_average()})", flush=True)
            fetches: dict[str, Callable[[], dict[str, float]]] = {BASE_FETCH: _baseline_fetch(path)}
            for backend in backends:
                for transport, client in backend.clients.items():
                    name = f"{backend.label} {transport}"
                    fetches[name] = (lambda b=backend, c=client, n=name: metered(
                        b, lambda: c.fetch(archive), log, f"fetch {count} {n}"))
            fetches = options.select(fetches, BASE_FETCH)
            timed_fetches = alternate(fetches, reps, between=free_memory)

            _store_rows(store_table, count, timed_stores, log)
            _read_rows(read_table, count, timed_reads, log, read_medians, counts[0])
            _fetch_rows(fetch_table, count, timed_fetches, log)
            if count == counts[-1]:
                _headline(result, count, timed_stores, timed_fetches, log)
            for key, timings in (("store", timed_stores), ("read", timed_reads), ("fetch", timed_fetches)):
                data[key][str(count)] = {n: {q: s.values for q, s in qs.items()} for n, qs in timings.items()}
            del tensors
            free_memory()
    if skipped:
        for table in (store_table, read_table, fetch_table):
            _skipped_row(table, skipped)
    data["requests"] = log.requests
    data["read calls"] = log.calls
    data["replica"] = f"skipped: {skipped}" if skipped else "measured"
    _notes(result, store_table, read_table, fetch_table, reps)
    result.tables += [store_table, read_table, fetch_table]
    result.data = data
    return result


def _baseline_fetch(path: Path) -> Callable[[], dict[str, float]]:
    def measure() -> dict[str, float]:
        cpu, started = time.process_time(), time.perf_counter()
        loaded = safetensors.torch.load_file(path)
        took, used = time.perf_counter() - started, time.process_time() - cpu
        del loaded
        return {"time": took, "client cpu": used}
    return measure


def _split(name: str) -> tuple[str, str]:
    """(backend, competitor) of a round's name."""
    backend, _, rest = name.partition(" ")
    return (backend, f"tannery {rest}") if backend in ("embedded", "replica") else ("local file", name)


def _store_rows(table: Table, count: int, timings: dict[str, dict[str, Samples]], log: Log) -> None:
    base = timings[BASE_STORE]["time"].median
    for name, q in timings.items():
        backend, competitor = _split(name)
        median = q["time"].median
        stored = "–" if "stored" not in q else f"{q['stored'].median:.0f} {'objects' if backend == 'replica' else 'files'}"
        table.add(count, backend, competitor, fmt_time(median), q["time"].spread(), fmt_time(median / count),
                  fmt_ratio(median / base), _cpu_cell(q, "server cpu"), _cpu_cell(q, "client cpu"),
                  _cpu_cell(q, "SeaweedFS cpu"), stored, fmt_requests(log.median_requests(f"store {count} {name}")))


def _read_rows(table: Table, count: int, timings: dict[str, dict[str, Samples]], log: Log,
               medians: dict[str, float], first: int) -> None:
    base = statistics.median(log.calls[f"read {count} {BASE_READ}"])
    for name, q in timings.items():
        backend, competitor = _split(name)
        median = statistics.median(log.calls[f"read {count} {name}"])
        if count == first:
            medians[name] = median
        growth = fmt_ratio(median / medians[name]) if name in medians else "–"
        table.add(count, backend, competitor, fmt_time(median), q["time"].spread(), fmt_ratio(median / base),
                  growth, fmt_requests(log.median_requests(f"read {count} {name}")))


def _fetch_rows(table: Table, count: int, timings: dict[str, dict[str, Samples]], log: Log) -> None:
    base = timings[BASE_FETCH]["time"].median
    for name, q in timings.items():
        backend, competitor = _split(name)
        median = q["time"].median
        table.add(count, backend, competitor, fmt_time(median), q["time"].spread(), fmt_ratio(median / base),
                  _cpu_cell(q, "server cpu"), _cpu_cell(q, "client cpu"), _cpu_cell(q, "SeaweedFS cpu"),
                  fmt_requests(log.median_requests(f"fetch {count} {name}")))


def _headline(result: CaseResult, count: int, stores: dict[str, dict[str, Samples]],
              fetches: dict[str, dict[str, Samples]], log: Log) -> None:
    """One note per backend and transport: the largest archive's figures against safetensors'."""
    base_store, base_fetch = stores[BASE_STORE]["time"].median, fetches[BASE_FETCH]["time"].median
    base_read = statistics.median(log.calls[f"read {count} {BASE_READ}"])
    for name in stores:
        if name == BASE_STORE or name not in fetches:
            continue
        reads = {how: log.calls.get(f"read {count} {name} {how}")
                 for how in ("archive().tensor", "fetch(names=[one])")}
        read_text = ", ".join(f"{how} {fmt_ratio(statistics.median(calls) / base_read)}"
                              for how, calls in reads.items() if calls)
        result.notes.append(
            f"{count} entries, {name}: Store {fmt_ratio(stores[name]['time'].median / base_store)} safetensors' "
            f"time ({stores[name]['stored'].median:.0f} {'objects' if name.startswith('replica') else 'files'} "
            f"added); one-entry read {read_text}; "
            f"whole fetch {fmt_ratio(fetches[name]['time'].median / base_fetch)}.")


def _notes(result: CaseResult, store: Table, read: Table, fetch: Table, reps: int) -> None:
    store.note = (f"Medians of {reps} alternating repetitions, each storing new values; spread: fastest – slowest. "
                  "× safetensors: the competitor's median time over `save_file` + fsync's (lower is better). CPU "
                  "seconds per Store (medians; resolution 10 ms). Files / objects added: regular files the Store "
                  "added to the embedded server's data directory (its catalog and `tmp/` aside), objects it added "
                  "under the replica's prefix in the bucket. Bucket requests: S3 requests during the Store, total "
                  "then by kind, from SeaweedFS's metrics (medians of the repetitions; SeaweedFS counts a HEAD as "
                  "a GET, hence GET/HEAD).")
    read.note = (f"{READS} calls a round, each of an entry drawn at random, {reps} alternating rounds: the median of "
                 "every call, and the lowest and highest round medians. `archive().tensor`: a fresh "
                 "`client.archive(name)` and one `.tensor(one, (16,), float32)` per call (open + read); "
                 "`fetch(names=[one])`: one Fetch. × safetensors: over `safe_open` + `get_tensor`'s median. "
                 "vs the smallest archive: this median over the same competitor's at the smallest count.")
    fetch.note = (f"Medians of {reps} alternating repetitions; `client.fetch(name)` (every entry, in memory) "
                  "against `safetensors.torch.load_file(path)`; × safetensors as above; CPU seconds and bucket "
                  "requests per whole fetch.")
