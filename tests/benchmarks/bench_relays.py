"""Relays: one version to K workers on simulated hosts, each behind a 1 Gbit/s link.

Every host is a network namespace of this machine behind a veth shaped by ``tc tbf`` (1 Gbit/s
each way, :mod:`tests.netns`): host 0 runs the tannery server and the trainer, hosts 1..K a
weight worker each (``tannery.weights.Follower`` over TCP; the same-host socket is off, so the
shaped links are the only path). A state dict of 16 float32 tensors (64 MiB) goes to K = 1, 4
and 8 workers (``--quick``: 1 and 4), side by side in one run:

- **relays (chain)**: followers relay (the default), the server's plan a chain: it sends each
  version to the first worker, which passes each piece on to the next as it lands;
- **star (relays off)**: every worker subscribes to the server, which sends K copies;
- **gloo broadcast**: ``torch.distributed.broadcast`` from rank 0 in host 0 to the K workers.

Measured: from the trainer's ``push`` to the moment the last worker holds the version (wall
clocks of one machine), over several versions; the server's egress per version on the channel
(its ``tannery_channel_payload_bytes_total``) in models; and the workers' CPU seconds per GiB
delivered. Then one delta version (1% of elements changed) through the chain at the largest K.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.netns import Hosts, unavailable

from .harness import GiB, MiB, CaseResult, Options, Samples, Table, cpu_seconds, fmt_size, fmt_time, scratch
from .relay_fleet import GLOO_PORT, Fleet

SIZE, COUNT, RATE = 64 * MiB, 16, "1gbit"
WORKERS, QUICK_WORKERS = [1, 4, 8], [1, 4]
CHAIN, STAR, GLOO = "relays (chain)", "star (relays off)", "gloo broadcast"


def _versions(fleet: Fleet, workers: list[Any], first: int, reps: int, delta: bool = False) -> list[dict[str, float]]:
    """Push ``reps`` versions from ``first`` on; per version: seconds to the last worker, server
    egress in bytes, the workers' CPU seconds and the server's."""
    outcomes = []
    assert fleet.server is not None
    for version in range(first, first + reps):
        before = [line["cpu"] for line in fleet.applied(version - 1, workers)]
        sent, server_cpu = fleet.egress(), cpu_seconds(fleet.server.process.pid)
        pushed = fleet.push(version, delta=delta)
        lines = fleet.applied(version, workers)
        outcomes.append({"seconds": max(line["t"] for line in lines) - pushed["started"],
                         "egress": fleet.egress() - sent, "server": cpu_seconds(fleet.server.process.pid) - server_cpu,
                         "workers": sum(line["cpu"] - cpu for line, cpu in zip(lines, before)),
                         "via": sum(line.get("via") == "channel" for line in lines) / len(lines)})
    return outcomes


def _tannery(hosts: Hosts, directory: Path, k: int, relay: bool, reps: int, delta: bool) -> dict[str, Any]:
    with Fleet(hosts, directory, SIZE, count=COUNT, name=f"bench/{'chain' if relay else 'star'}") as fleet:
        fleet.push(0)
        workers = fleet.chain(list(range(1, k + 1)), relay=relay, digest=False)
        time.sleep(1.0)
        fleet.push(1)  # warms the path up: not measured
        fleet.applied(1, workers)
        found = {"whole": _versions(fleet, workers, 2, reps)}
        if delta:
            found["delta"] = _versions(fleet, workers, 2 + reps, 1, delta=True)
        return found


def _gloo(hosts: Hosts, k: int, reps: int) -> list[float]:
    from .bench_weight_sync import Worker

    env = {"TANNERY_GLOO_MASTER": hosts.address(0), "TANNERY_BENCH_DTYPE": "float32", "OMP_NUM_THREADS": "1"}
    ranks = [Worker("gloo", str(SIZE), str(COUNT), str(rank), str(k + 1), str(GLOO_PORT),
                    env={**env, "GLOO_SOCKET_IFNAME": hosts.interface(rank)}, prefix=hosts.command(rank, []))
             for rank in range(k + 1)]
    try:
        for rank in ranks:
            rank.wait_ready()
        seconds = []
        for version in range(reps + 1):  # the first warms up
            ranks[0].tell("round")
            lines = [rank.version(version) for rank in ranks]
            if version:
                seconds.append(max(line["t"] for line in lines[1:]) - lines[0]["started"])
        ranks[0].tell("stop")
        return seconds
    finally:
        for rank in ranks:
            rank.close()


def run(options: Options) -> CaseResult:
    result = CaseResult("relays", "Relays: one version to K workers behind 1 Gbit/s links",
                        __doc__.split("\n", 1)[1].strip())
    why = unavailable()
    if why is not None:
        result.notes.append(f"Skipped: no network namespaces here ({why}).")
        return result
    counts = QUICK_WORKERS if options.quick else WORKERS
    reps = options.reps or 3
    times = Table("Time from push to the last worker holding the version (median, and range), and server egress "
                  "per version", ["K", CHAIN, STAR, GLOO, "chain / chain at K = 1", "chain / gloo",
                                  "egress chain", "egress star", "workers CPU-s/GiB chain", "star", "server CPU-s/GiB chain",
                                  "star"])
    data: dict[str, Any] = {}
    result.data = data
    base = None
    for k in counts:
        print(f"    64 MiB to {k} workers", flush=True)
        with scratch(options, "relays") as directory, Hosts(k + 1, rate=RATE) as hosts:
            chain = _tannery(hosts, directory / "chain", k, True, reps, delta=k == counts[-1])
            star = _tannery(hosts, directory / "star", k, False, reps, delta=False)
            gloo = _gloo(hosts, k, reps)
        data[str(k)] = {"chain": chain, "star": star, "gloo": gloo}
        med = {name: Samples([o["seconds"] for o in got["whole"]]) for name, got in (("chain", chain), ("star", star))}
        gloo_med = Samples(gloo)
        base = base if base is not None else med["chain"].median
        delivered = k * SIZE / GiB

        def per(got: dict[str, Any], key: str, scale: float) -> str:
            return f"{sorted(o[key] for o in got['whole'])[len(got['whole']) // 2] / scale:.2f}"

        times.add(k, f"{fmt_time(med['chain'].median)} ({med['chain'].spread()})",
                  f"{fmt_time(med['star'].median)} ({med['star'].spread()})",
                  f"{fmt_time(gloo_med.median)} ({gloo_med.spread()})",
                  f"{med['chain'].median / base:.2f}x", f"{med['chain'].median / gloo_med.median:.2f}x",
                  f"{per(chain, 'egress', SIZE)}x", f"{per(star, 'egress', SIZE)}x",
                  per(chain, "workers", delivered), per(star, "workers", delivered),
                  per(chain, "server", delivered), per(star, "server", delivered))
        if k == counts[-1]:
            result.target(f"relays: time at K = {k} / time at K = 1", med["chain"].median / base, 1.5,
                          higher_is_better=False)
            result.target(f"relays: server egress per version at K = {k}, in models",
                          float(per(chain, "egress", SIZE)), 1.2, higher_is_better=False)
            delta = chain["delta"][0]
            result.notes.append(f"A delta version (1% of elements changed) through the chain to {k} workers: "
                                f"{fmt_time(delta['seconds'])} to the last, server egress "
                                f"{delta['egress'] / SIZE:.3f}x the model, {delta['via']:.0%} of workers from the channel.")
    result.tables.append(times)
    result.notes.append(f"{fmt_size(SIZE)} in {COUNT} float32 tensors; every host's link {RATE} each way (tc tbf). "
                        "All hosts share this machine's CPUs: the workers' CPU-s/GiB says what a faster machine frees. "
                        "Every process of every competitor runs with OMP_NUM_THREADS=1 (each namespace stands for a "
                        "host of its own; torch's thread pool spinning on the shared cores otherwise doubles a "
                        "worker's user time).")
    return result
