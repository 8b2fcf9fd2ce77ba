"""A worker process of the ``weight-sync`` benchmark: holds a state dict of COUNT float32
tensors (SIZE bytes in all) and receives new weights into it, one way or another, printing a
JSON line per version received: its number, the wall time (``time.time()``, comparable across
processes on one host) and this process's CPU seconds so far.

    python -m tests.benchmarks.weight_sync_worker tannery SIZE COUNT TARGET NAME    (TANNERY_TRANSPORT)
    python -m tests.benchmarks.weight_sync_worker safetensors SIZE COUNT            (a path per stdin line)
    python -m tests.benchmarks.weight_sync_worker gloo SIZE COUNT RANK WORLD PORT   (rank 0 is the trainer:
                                                                                     "round" per stdin line)

TANNERY_BENCH_DTYPE (float32 by default; bfloat16 for the RL-like rows) is the state dict's dtype.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch


def state_dict(size: int, count: int, fill: bool = False, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """COUNT tensors of SIZE/COUNT bytes each (of ``dtype``, else TANNERY_BENCH_DTYPE, else
    float32), named like a model's layers."""
    kind = getattr(torch, dtype or os.environ.get("TANNERY_BENCH_DTYPE", "float32"))
    rows = size // count // torch.empty(0, dtype=kind).element_size() // 1024
    make = (lambda: torch.empty(rows, 1024).uniform_().to(kind)) if fill else (lambda: torch.zeros(rows, 1024, dtype=kind))
    return {f"layers.{i}.weight": make() for i in range(count)}


def report(version: int, **more: Any) -> None:
    print(json.dumps({"version": version, "t": time.time(), "cpu": time.process_time(), **more}), flush=True)


def tannery_worker(size: int, count: int, target: str, name: str) -> None:
    """Follow ``name``; TANNERY_RELAY (on/off, unset: the follower's default) says whether this
    worker relays, TANNERY_BENCH_DIGEST=1 adds the SHA-256 of the whole state to each line, and
    TANNERY_BENCH_WAIT=1 makes it start following only once a line comes on stdin."""
    import tannery

    state = state_dict(size, count)
    relay = {"on": True, "off": False}.get(os.environ.get("TANNERY_RELAY", ""))
    print(json.dumps({"ready": True}), flush=True)
    if os.environ.get("TANNERY_BENCH_WAIT") == "1":  # follow once told (the tests choose the order of joining)
        sys.stdin.readline()
    with tannery.Client(target) as client, tannery.weights.Follower(client, name, state, relay=relay) as follower:
        for applied in follower:
            t = time.time()
            more = {"sha": state_digest(state)} if os.environ.get("TANNERY_BENCH_DIGEST") == "1" else {}
            report(applied.version, seconds=applied.seconds, delta=applied.delta, via=applied.via, t=t, **more)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of every tensor's bytes, in key order."""
    import hashlib

    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def safetensors_worker(size: int, count: int) -> None:
    import safetensors.torch

    state = state_dict(size, count)
    print(json.dumps({"ready": True}), flush=True)
    for version, line in enumerate(sys.stdin):
        loaded = safetensors.torch.load_file(line.strip())
        with torch.no_grad():
            for key, tensor in state.items():
                tensor.copy_(loaded[key])
        del loaded
        report(version)


def gloo_worker(size: int, count: int, rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    state = state_dict(size, count, fill=rank == 0)
    master = os.environ.get("TANNERY_GLOO_MASTER", "127.0.0.1")  # rank 0's address (another namespace's)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    print(json.dumps({"ready": True}), flush=True)
    go = torch.zeros(1)
    version = 0
    while True:
        if rank == 0:
            line = sys.stdin.readline().strip()
            go.fill_(1.0 if line == "round" else 0.0)
        dist.barrier()
        started = time.time()
        dist.broadcast(go, 0)
        if not go.item():
            break
        for tensor in state.values():
            dist.broadcast(tensor, 0)
        report(version, started=started)
        version += 1
    dist.destroy_process_group()


def main() -> None:
    mode, size, count, *rest = sys.argv[1:]
    if mode == "tannery":
        tannery_worker(int(size), int(count), rest[0], rest[1])
    elif mode == "safetensors":
        safetensors_worker(int(size), int(count))
    else:
        gloo_worker(int(size), int(count), int(rest[0]), int(rest[1]), int(rest[2]))


if __name__ == "__main__":
    main()
