"""The RL-like rows of the ``weight-sync`` case: versions as RL post-training makes them, sent
as deltas, against a gloo broadcast of the whole model.

A bf16 model of 256 MiB and 1 GiB (16 tensors) is the cast of an fp32 master (weights of
scale 0.02); each version is one AdamW step (lr 1e-6, random-normal gradients) on the
master, cast to bf16 again. The trainer pushes versions 0 (whole) and 1 (the first delta,
whose density is higher) to K = 3 fresh workers, unmeasured; then version 2 is measured:
from ``push`` to the last worker holding it. Beside it: the change density, the tensor
bytes the channel carried (``Pushed.streamed_bytes``) and the payload bytes the server took
in and sent out for the version, read from its metrics
(``tannery_channel_payload_bytes_total``), and CPU seconds per GiB of the model delivered
(K x size) for the server, the workers and the trainer.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

from .harness import GiB, MiB, Samples, Table, cpu_seconds, fmt_ratio, fmt_size, fmt_time, free_memory, free_port

COUNT = 16
K = 3
DTYPE = "bfloat16"
TRANSPORTS = ("local", "tcp")
GOAL = 0.5  # at most this many times a gloo broadcast of the whole model


class Trainer:
    """An fp32 master of SIZE bytes of bf16, stepped by AdamW at lr 1e-6."""

    def __init__(self, size: int, seed: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        rows = size // COUNT // 2 // 1024
        self.master = [0.02 * torch.randn(rows, 1024, generator=generator) for _ in range(COUNT)]
        self.optimizer = torch.optim.AdamW(self.master, lr=1e-6)
        self.generator = generator

    def state(self) -> dict[str, Any]:
        import torch

        return {f"layers.{i}.weight": t.to(torch.bfloat16) for i, t in enumerate(self.master)}

    def step(self) -> dict[str, Any]:
        import torch

        for tensor in self.master:
            tensor.grad = torch.randn(tensor.shape, generator=self.generator)
        self.optimizer.step()
        return self.state()


def density(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The fraction of elements whose bits changed."""
    import torch

    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(before.values(), after.values()))
    return changed / sum(t.numel() for t in after.values())


def channel_bytes(metrics_url: str) -> dict[str, float]:
    """The server's channel payload bytes so far, by direction (every transport summed)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {"in": 0.0, "out": 0.0}
    for match in re.finditer(r'^tannery_channel_payload_bytes_total\{([^}]*)\} (\S+)$', text, re.M):
        direction = re.search(r'direction="(\w+)"', match.group(1)).group(1)
        found[direction] = found.get(direction, 0.0) + float(match.group(2))
    return found


def metrics_url(server: Any) -> str:
    for line in server.lines:
        if match := re.search(r"metrics (http://[^\s\"]+/metrics)", line):
            return match.group(1)
    raise RuntimeError("the server's start line names no metrics address")


def tannery_round(server: Any, transport: str, size: int, rep: int) -> dict[str, float]:
    import tannery
    from tannery.weights import Publisher

    from .bench_weight_sync import Worker

    name = f"bench/rl-{transport}-{size}-{rep}"
    env = {"TANNERY_TRANSPORT": transport, "TANNERY_BENCH_DTYPE": DTYPE}
    trainer = Trainer(size, seed=rep)
    workers = [Worker("tannery", str(size), str(COUNT), server.target, name, env=env) for _ in range(K)]
    try:
        for worker in workers:
            worker.wait_ready()
        with tannery.Client(server.target, transport=transport) as client:
            publisher = Publisher(client, name, keep=False)
            publisher.push(trainer.state(), 0)  # whole: warms the workers up
            publisher.push(trainer.step(), 1)  # the first delta: not measured
            before = [worker.version(1)["cpu"] for worker in workers]
            previous, state = trainer.state(), trainer.step()
            url = metrics_url(server)
            moved = channel_bytes(url)
            server_cpu, trainer_cpu = cpu_seconds(server.pid), time.process_time()
            started = time.time()
            pushed = publisher.push(state, 2)
            lines = [worker.version(2) for worker in workers]
            elapsed = max(line["t"] for line in lines) - started
            after = channel_bytes(url)
            outcome = {"seconds": elapsed, "server": cpu_seconds(server.pid) - server_cpu,
                       "workers": sum(line["cpu"] - cpu for line, cpu in zip(lines, before)),
                       "trainer": time.process_time() - trainer_cpu, "density": density(previous, state),
                       "streamed": pushed.streamed_bytes if pushed.delta else float("nan"),
                       "in": after["in"] - moved["in"], "out": after["out"] - moved["out"], "push": pushed.seconds}
            client.delete(f"{name}/v2", force=True)
        return outcome
    finally:
        for worker in workers:
            worker.close()


def gloo_round(size: int) -> dict[str, float]:
    from .bench_weight_sync import Worker

    port = free_port()
    env = {"TANNERY_BENCH_DTYPE": DTYPE}
    ranks = [Worker("gloo", str(size), str(COUNT), str(rank), str(K + 1), str(port), env=env) for rank in range(K + 1)]
    try:
        for rank in ranks:
            rank.wait_ready()
        ranks[0].tell("round")  # warm-up, not measured
        before = [rank.version(0)["cpu"] for rank in ranks]
        ranks[0].tell("round")
        lines = [rank.version(1) for rank in ranks]
        ranks[0].tell("stop")
        return {"seconds": max(line["t"] for line in lines[1:]) - lines[0]["started"], "server": 0.0,
                "workers": sum(line["cpu"] - cpu for line, cpu in zip(lines[1:], before[1:])),
                "trainer": lines[0]["cpu"] - before[0]}
    finally:
        for rank in ranks:
            rank.close()


def run(server: Any, sizes: list[int], reps: int, result: Any) -> tuple[Table, Table]:
    """Measure the RL-like rows; their goals go into ``result``."""
    competitors = [f"tannery {t}" for t in TRANSPORTS] + ["gloo broadcast"]
    times = Table(f"RL-like versions (bf16, one AdamW step at lr 1e-6) to K = {K} workers: time from push to "
                  "every worker holding version 2 (median, and range)",
                  ["size", "density", *competitors, *(f"{t} / gloo" for t in TRANSPORTS),
                   "channel bytes per version (of the model)", "server in / out per version (of the model)",
                   "push returns (stored, alias moved)"])
    cpu = Table("RL-like versions: CPU seconds per GiB delivered (K x size)",
                ["size", "competitor", "server cpu-s/GiB", "workers cpu-s/GiB", "trainer cpu-s/GiB"])
    for size in sizes:
        print(f"    RL-like {fmt_size(size)} to {K} workers", flush=True)
        outcomes: dict[str, list[dict[str, float]]] = {name: [] for name in competitors}
        for rep in range(reps):
            shift = rep % len(competitors)
            for name in competitors[shift:] + competitors[:shift]:
                free_memory()
                outcomes[name].append(gloo_round(size) if name.startswith("gloo")
                                      else tannery_round(server, name.split()[1], size, rep))
        med = {name: {key: sorted(o[key] for o in got)[len(got) // 2] for key in got[0]}
               for name, got in outcomes.items()}
        samples = {name: Samples([o["seconds"] for o in got]) for name, got in outcomes.items()}
        gloo = samples["gloo broadcast"].median
        ratios = {t: samples[f"tannery {t}"].median / gloo for t in TRANSPORTS}
        local = med["tannery local"]
        times.add(fmt_size(size), f"{local['density']:.2%}",
                  *(f"{fmt_time(samples[n].median)} ({samples[n].spread()})" for n in competitors),
                  *(fmt_ratio(r) for r in ratios.values()), f"{local['streamed'] / size:.1%}",
                  " ; ".join(f"{t}: {med[f'tannery {t}']['in'] / size:.1%} / {med[f'tannery {t}']['out'] / size:.1%}"
                             for t in TRANSPORTS),
                  " ; ".join(f"{t}: {fmt_time(med[f'tannery {t}']['push'])}" for t in TRANSPORTS))
        delivered = K * size / GiB
        for name, got in med.items():
            cpu.add(fmt_size(size), name, f"{got['server'] / delivered:.2f}" if name.startswith("tannery") else "-",
                    f"{got['workers'] / delivered:.2f}", f"{got['trainer'] / (size / GiB):.2f}")
        for transport in TRANSPORTS:
            result.target(f"RL-like tannery {transport} / gloo, {fmt_size(size)} to {K} workers", ratios[transport],
                          GOAL, higher_is_better=False)
        result.target(f"RL-like channel bytes per version, {fmt_size(size)} (of the model)",
                      local["streamed"] / size, 0.10, higher_is_better=False)
        result.data[f"rl/{size}"] = outcomes
    return times, cpu


__all__ = ["run"]
