"""torch.distributed.checkpoint through tannery against DCP's own FileSystemWriter/Reader.

Two ranks (spawned processes, the gloo backend on the CPU) save a state dict of float32
DTensors sharded on dim 0 (1 GiB in all; 128 MiB with ``--quick``) with ``dcp.save``, then
load it back into the same placement with ``dcp.load``: once through ``tannery.dcp.Writer``
and ``Reader`` (a tannery server on a data directory of the same disk; the client's
default transport, which takes the same-host socket), once through ``FileSystemWriter`` and
``FileSystemReader`` on a directory of that disk. Competitors alternate; each save writes
a new checkpoint (the tannery archive is deleted between repetitions, the directory
removed), and the page cache is left as it is (both read what they just wrote). Times are
the slowest rank's, from the barrier before the call to the barrier after it.

Then each saves again with ``dcp.async_save`` (DCP's default staging: a CPU copy of the state
dict; the thread checkpointer, on a gloo group of its own) and loads that checkpoint to check
it: the time the training loop is blocked is from the call to its return, the total until
the future completes (the loop idles meanwhile); CPU seconds are the rank process's, over
the whole save.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

from .harness import GiB, MiB, CaseResult, Options, Table, fmt_rate, fmt_size, load_average, scratch, tannery_server

WORLD = 2
ENTRIES = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, total: int, reps: int, target: str, directory: str, results) -> None:
    """One rank: build its shards, then time save and load with each competitor, alternating."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tannery
    import tannery.dcp

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = total // ENTRIES // 4 // 1024
    generator = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": distribute_tensor(torch.randn(rows, 1024, generator=generator), mesh, [Shard(0)])
             for i in range(ENTRIES)}
    target_state = {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]) for k in state}
    client = tannery.Client(target)
    group = dist.new_group(backend="gloo")  # async saves' collectives, apart from the loop's

    def timed(call) -> float:
        dist.barrier()
        began = time.perf_counter()
        call()
        dist.barrier()
        return time.perf_counter() - began

    def timed_async(writer) -> tuple[float, float, float]:
        """(blocked, total, CPU seconds) of one async_save."""
        dist.barrier()
        cpu, began = time.process_time(), time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
        blocked = time.perf_counter() - began
        future.result()
        total, cpu = time.perf_counter() - began, time.process_time() - cpu
        dist.barrier()
        return blocked, total, cpu

    def check_loaded() -> None:
        for key, value in state.items():  # every byte came back
            assert torch.equal(target_state[key].to_local(), value.to_local()), key
            target_state[key].to_local().zero_()

    times: dict[str, list[float]] = {}
    for rep in range(reps):
        for name in ("tannery", "FileSystem"):
            if name == "tannery":
                archive = f"bench/dcp-{rep}"
                writer = lambda: tannery.dcp.Writer(client, archive)  # noqa: E731
                reader = lambda: tannery.dcp.Reader(client, archive)  # noqa: E731
            else:
                path = Path(directory) / f"dcp-{rep}"
                writer = lambda: dcp.FileSystemWriter(path)  # noqa: E731
                reader = lambda: dcp.FileSystemReader(path)  # noqa: E731
            load = lambda: dcp.load(target_state, storage_reader=reader())  # noqa: E731

            def remove() -> None:
                dist.barrier()
                if rank == 0:
                    if name == "tannery":
                        client.delete(archive)
                    else:
                        shutil.rmtree(path, ignore_errors=True)
                dist.barrier()

            cpu = time.process_time()
            times.setdefault(f"{name} save", []).append(timed(lambda: dcp.save(state, storage_writer=writer())))
            times.setdefault(f"{name} save cpu", []).append(time.process_time() - cpu)
            times.setdefault(f"{name} load", []).append(timed(load))
            check_loaded()
            remove()
            blocked, total, cpu = timed_async(writer())
            for key, value in (("blocked", blocked), ("total", total), ("cpu", cpu)):
                times.setdefault(f"{name} async {key}", []).append(value)
            load()
            check_loaded()
            remove()
    client.close()
    results.put((rank, times))
    dist.destroy_process_group()


def run(options: Options) -> CaseResult:
    total = options.sizes[-1] if options.sizes else (128 * MiB if options.quick else GiB)
    reps = options.repetitions(total)
    result = CaseResult("dcp", f"torch.distributed.checkpoint of {fmt_size(total)} across {WORLD} ranks",
                        __doc__.split("\n\n", 1)[1].strip())
    with scratch(options, "dcp") as tmp, tannery_server(tmp / "data", data_port="off") as server:
        print(f"  {fmt_size(total)}, {reps} repetitions (load {load_average()})", flush=True)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        directory = tmp / "filesystem"
        directory.mkdir()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(rank, port, total, reps, server.target, str(directory), results))
                 for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        per_rank = dict(results.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join(60)
    slowest = {key: [max(per_rank[r][key][i] for r in per_rank) for i in range(reps)] for key in per_rank[0]}
    table = Table("Save and load, slowest rank", ["call", "competitor", "median", "spread", "rate", "vs FileSystem"],
                  note=f"Medians of {reps} alternating repetitions; ratio: FileSystem's median time over "
                       "tannery's (higher is better).")
    medians = {key: sorted(values)[len(values) // 2] for key, values in slowest.items()}
    for call in ("save", "load"):
        for name in ("FileSystem", "tannery"):
            values = slowest[f"{name} {call}"]
            ratio = medians[f"FileSystem {call}"] / medians[f"{name} {call}"]
            table.add(call, name if name == "tannery" else "DCP FileSystemWriter/Reader", f"{medians[f'{name} {call}']:.2f} s",
                      f"{min(values):.2f}–{max(values):.2f} s", fmt_rate(total, medians[f"{name} {call}"]),
                      f"{ratio:.2f}x")
        result.data[call] = {"tannery": medians[f"tannery {call}"], "filesystem": medians[f"FileSystem {call}"]}
    result.tables.append(table)
    result.tables.append(_async_table(slowest, medians, reps))
    result.data["async_save"] = {name: {key: medians[f"{name} async {key}"] for key in ("blocked", "total", "cpu")}
                                 for name in ("tannery", "FileSystem")}
    result.notes.append(f"load average at the end: {load_average()}")
    return result


def _async_table(slowest: dict[str, list[float]], medians: dict[str, float], reps: int) -> Table:
    """async_save against save, each competitor's own: blocked and total time, CPU seconds."""
    table = Table("async_save: the training loop blocked, slowest rank",
                  ["competitor", "save", "async blocked", "async total", "blocked / save", "total / save",
                   "CPU s, save / async", "total vs FileSystem"],
                  note=f"Medians of {reps} repetitions; save: dcp.save, barrier to barrier; blocked: from the "
                       "async_save call to its return; total: until its future completes; CPU: the rank "
                       "process's seconds over the save (the slowest rank's); vs FileSystem: its async total over "
                       "this one's (higher is better). Goal: blocked / save at most 0.25.")
    for name in ("FileSystem", "tannery"):
        save = medians[f"{name} save"]
        blocked, total = medians[f"{name} async blocked"], medians[f"{name} async total"]
        values = slowest[f"{name} async blocked"]
        table.add(name if name == "tannery" else "DCP FileSystemWriter", f"{save:.2f} s",
                  f"{blocked:.3f} s ({min(values):.3f}–{max(values):.3f})", f"{total:.2f} s",
                  f"{blocked / save:.2f}", f"{total / save:.2f}",
                  f"{medians[f'{name} save cpu']:.2f} / {medians[f'{name} async cpu']:.2f}",
                  f"{medians['FileSystem async total'] / total:.2f}x")
    return table
