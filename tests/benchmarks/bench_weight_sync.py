"""Weight sync: a trainer's new weights into K worker processes, time until every worker holds them.

A state dict of 16 float32 tensors (256 MiB and 1 GiB; ``--quick``: 64 MiB) goes from this
process (the trainer) to K = 1, 3 and 7 worker processes (``--quick``: 1 and 3), each holding
a state dict of the same shapes that it copies the new weights into. Measured: from the
trainer's first step to the moment the last worker has the whole version (wall clocks of
one host), over fresh workers each repetition (a first version, not measured, warms them):

- **tannery** (``tannery.weights``): ``Publisher.push`` into a tannery server in its own
  process, ``Follower`` in each worker, on the same-host path (``local``), the TCP data port
  (``tcp``) and gRPC (``grpc``), the trainer and the workers on the same transport;
- **gloo**, the baseline of every ratio: ``torch.distributed.broadcast`` of the 16 tensors
  from rank 0 (a process of its own) to the K workers, straight into their tensors;
- **safetensors file**: ``save_file`` once (page cache, no fsync), then ``load_file`` and
  ``copy_`` in each worker, told the path through a pipe.

Beside the times: CPU seconds per GiB delivered (K times the size) of the server, of the
workers together and of the trainer; and the server's peak RSS during the round.

Then the RL-like rows (:mod:`.weight_sync_rl`): bf16 versions one AdamW step apart, sent as
deltas, against a gloo broadcast of the whole bf16 model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import weight_sync_rl
from .harness import (GiB, MiB, CaseResult, Options, PeakRss, Samples, Table, cpu_seconds, fmt_ratio, fmt_size,
                      fmt_time, free_memory, free_port, load_average, proc_status, scratch, tannery_server)

COUNT = 16
SIZES, QUICK_SIZES = [256 * MiB, 1 * GiB], [64 * MiB]
WORKERS, QUICK_WORKERS = [1, 3, 7], [1, 3]
TRANSPORTS = ("local", "tcp", "grpc")
GLOO = "gloo broadcast"
FILE = "safetensors file"
GOALS = {"local": 1.0, "tcp": 1.5}  # at most this many times gloo's time, at K = 3 and 7


class Worker:
    """A worker process; its JSON lines are read on a thread of its own."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, prefix: Sequence[str] = (),
                 module: str = "tests.benchmarks.weight_sync_worker") -> None:
        self.process = subprocess.Popen([*prefix, sys.executable, "-m", module, *args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, **(env or {})})
        self.lines: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.arrived = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self.ready.set()
                continue
            with self.arrived:
                self.lines.append(message)
                self.arrived.notify_all()
        self.ready.set()
        with self.arrived:
            self.arrived.notify_all()

    def wait_ready(self, timeout: float = 120) -> None:
        if not self.ready.wait(timeout) or self.process.poll() is not None:
            raise RuntimeError(f"worker {self.process.args} did not start: {self.process.stderr.read()}")

    def version(self, version: int, timeout: float = 300) -> dict[str, Any]:
        """The line of ``version`` (waited for)."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while not any(line["version"] == version for line in self.lines):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.process.args} never got version {version}: "
                                       f"{self.process.stderr.read()[-2000:]}")
                self.arrived.wait(1)
            return next(line for line in self.lines if line["version"] == version)

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _close(workers: list[Worker]) -> None:
    for worker in workers:
        worker.close()


#: One repetition of a competitor: (seconds to every worker, server/worker/trainer CPU seconds, server peak RSS).
Outcome = tuple[float, float, float, float, int]


def tannery_round(server: Any, transport: str, size: int, k: int, state: dict, rep: int) -> Outcome:
    """Version 0 (random, not measured), then version 1, ``state``: every byte new, so no delta."""
    import torch

    import tannery
    from tannery.weights import Publisher

    name = f"bench/{transport}-{size}-{k}-{rep}"
    env = {"TANNERY_TRANSPORT": transport}
    workers = [Worker("tannery", str(size), str(COUNT), server.target, name, env=env) for _ in range(k)]
    try:
        for worker in workers:
            worker.wait_ready()
        with tannery.Client(server.target, transport=transport) as client:
            publisher = Publisher(client, name, keep=False)
            publisher.push({key: torch.rand_like(t) for key, t in state.items()}, 0)  # warms up: not measured
            before = [worker.version(0)["cpu"] for worker in workers]
            server_cpu, trainer_cpu = cpu_seconds(server.pid), time.process_time()
            with PeakRss(server.pid) as peak:
                started = time.time()
                publisher.push(state, 1)
                lines = [worker.version(1) for worker in workers]
            elapsed = max(line["t"] for line in lines) - started
            outcome = (elapsed, cpu_seconds(server.pid) - server_cpu,
                       sum(line["cpu"] - cpu for line, cpu in zip(lines, before)),
                       time.process_time() - trainer_cpu, peak.anon)
            client.delete(f"{name}/v1", force=True)
        return outcome
    finally:
        _close(workers)


def gloo_round(size: int, k: int) -> Outcome:
    port = free_port()
    ranks = [Worker("gloo", str(size), str(COUNT), str(rank), str(k + 1), str(port)) for rank in range(k + 1)]
    try:
        for rank in ranks:
            rank.wait_ready()
        ranks[0].tell("round")  # warm-up, not measured
        for rank in ranks:
            rank.version(0)
        before = [rank.version(0)["cpu"] for rank in ranks]
        ranks[0].tell("round")
        lines = [rank.version(1) for rank in ranks]
        elapsed = max(line["t"] for line in lines[1:]) - lines[0]["started"]
        ranks[0].tell("stop")
        return (elapsed, 0.0, sum(line["cpu"] - cpu for line, cpu in zip(lines[1:], before[1:])),
                lines[0]["cpu"] - before[0], 0)
    finally:
        _close(ranks)


def file_round(directory: Path, size: int, k: int, state: dict) -> Outcome:
    import safetensors.torch

    workers = [Worker("safetensors", str(size), str(COUNT)) for _ in range(k)]
    try:
        for worker in workers:
            worker.wait_ready()
        outcomes = []
        for version in (0, 1):
            path = directory / f"v{version}.safetensors"
            before = [worker.lines[-1]["cpu"] if worker.lines else 0.0 for worker in workers]
            trainer_cpu = time.process_time()
            started = time.time()
            safetensors.torch.save_file(state, path)
            for worker in workers:
                worker.tell(str(path))
            lines = [worker.version(version) for worker in workers]
            outcomes.append((max(line["t"] for line in lines) - started, 0.0,
                             sum(line["cpu"] - cpu for line, cpu in zip(lines, before)),
                             time.process_time() - trainer_cpu, 0))
            path.unlink()
        return outcomes[1]
    finally:
        _close(workers)


RL_SIZES, QUICK_RL_SIZES = [256 * MiB, 1 * GiB], [64 * MiB]


def run(options: Options, whole: bool = True) -> CaseResult:
    import torch

    from .weight_sync_worker import state_dict

    result = CaseResult("weight-sync", "Weight sync: a trainer to K workers", __doc__.split("\n", 1)[1].strip())
    sizes = options.pick_sizes(SIZES, QUICK_SIZES)
    counts = QUICK_WORKERS if options.quick else WORKERS
    reps = options.reps or (2 if options.quick else 3)
    competitors = [f"tannery {t}" for t in TRANSPORTS] + [GLOO, FILE]
    times = Table("Time from push to every worker holding the version (median, and range)",
                  ["size", "K", *competitors, *(f"{t} / gloo" for t in TRANSPORTS)])
    cpu = Table("CPU seconds per GiB delivered (K x size): server / workers / trainer; server peak RSS",
                ["size", "K", "competitor", "server cpu-s/GiB", "workers cpu-s/GiB", "trainer cpu-s/GiB",
                 "server peak RSS (anonymous)"])
    data: dict[str, Any] = {}
    result.data = data
    with scratch(options, "weight-sync") as directory, tannery_server(directory / "data") as server:
        server_rss = proc_status(server.pid).get("RssAnon", 0)
        for size in sizes if whole else []:
            torch.manual_seed(0)
            state = state_dict(size, COUNT, fill=True)
            for k in counts:
                print(f"    {fmt_size(size)} to {k} workers (load average {load_average()})", flush=True)
                rounds: dict[str, Callable[[int], Outcome]] = {
                    **{f"tannery {t}": (lambda rep, t=t: tannery_round(server, t, size, k, state, rep))
                       for t in TRANSPORTS},
                    GLOO: lambda rep: gloo_round(size, k),
                    FILE: lambda rep: file_round(directory, size, k, state),
                }
                outcomes: dict[str, list[Outcome]] = {name: [] for name in competitors}
                for rep in range(reps):
                    shift = rep % len(competitors)
                    for name in competitors[shift:] + competitors[:shift]:
                        free_memory()
                        outcomes[name].append(rounds[name](rep))
                samples = {name: Samples([o[0] for o in got]) for name, got in outcomes.items()}
                gloo = samples[GLOO].median
                ratios = {t: samples[f"tannery {t}"].median / gloo for t in TRANSPORTS}
                times.add(fmt_size(size), k, *(f"{fmt_time(samples[n].median)} ({samples[n].spread()})"
                                               for n in competitors), *(fmt_ratio(r) for r in ratios.values()))
                delivered = k * size / GiB
                for name, got in outcomes.items():
                    med = lambda i: sorted(o[i] for o in got)[len(got) // 2]  # noqa: E731
                    rss = max(o[4] for o in got)
                    cpu.add(fmt_size(size), k, name, f"{med(1) / delivered:.2f}" if name.startswith("tannery") else "-",
                            f"{med(2) / delivered:.2f}", f"{med(3) / (size / GiB):.2f}",
                            f"{rss / MiB:.0f} MiB (at rest {server_rss / MiB:.0f})" if rss else "-")
                data[f"{size}/{k}"] = {name: [list(o) for o in got] for name, got in outcomes.items()}
                if k in (3, 7):
                    for transport, goal in GOALS.items():
                        result.target(f"tannery {transport} / gloo, {fmt_size(size)} to {k} workers",
                                      ratios[transport], goal, higher_is_better=False)
            del state
        if whole:
            result.tables += [times, cpu]
        result.tables += weight_sync_rl.run(server, options.pick_sizes(RL_SIZES, QUICK_RL_SIZES), reps, result)
    result.notes.append("Each repetition starts fresh workers; a first version (not measured) warms them. The "
                        "tannery server runs in its own process with its defaults (SQLite catalog, files), the "
                        "publisher with keep=False (each push deletes the version before).")
    return result


def main() -> None:
    from .harness import environment

    options = Options(quick="--quick" in sys.argv)
    outcome = run(options, whole="--rl" not in sys.argv)  # --rl: the RL-like rows alone
    print(outcome.markdown(environment()))


if __name__ == "__main__":
    main()
