"""Codec speed, side by side with pytannic 0.1.5, torch.save and safetensors (issues 2 and 7).

Each method turns a float32 tensor into bytes and back. Fast calls are repeated to last
~20 ms per sample. ``python -m tests.benchmarks --cases codec``.
"""

from __future__ import annotations

import io
from typing import Callable

import safetensors.torch
import torch
from pytannic.torch import tensors as pytannic

from tannery_protocol import framing
from tannery.dataplane import gathering
from tannery import torch as tt

from .harness import (GiB, CaseResult, Options, Table, alternate, fmt_ratio, fmt_size, fmt_time, free_memory,
                      repeat_timed)

MIB = 1 << 20
INTRO = (
    "A float32 tensor to its bytes and back, in one process, each method alternating with the others: "
    "pytannic 0.1.5's `serialize` + `deserialize` (the baseline: four full copies), tannery's "
    "`serialize` + `deserialize` with bytes in and out, the path the service uses (`serialize_parts`, the parts "
    "gathered into one bytearray as a receiver does, `deserialize` of it in place: one copy in all), the same "
    "through the Reframer in 1 MiB chunks, `torch.save`/`torch.load` to bytes, and `safetensors.torch.save`/`load` "
    "bytes. `torch.set_num_threads(1)`.")
CHUNK = MIB  # a receiver's message size (gRPC's default maximum is 4 MiB)
#: Speed-ups over pytannic: issue 2 (1.5x bytes, 3.5x the service path) and issue 7 (3x).
TARGETS = {"serialize + deserialize, bytes": 3.0, "service path: parts, gather, in place": 3.5}


def pytannic_round_trip(t: torch.Tensor) -> torch.Tensor:
    return pytannic.deserialize(pytannic.serialize(t))


def bytes_round_trip(t: torch.Tensor) -> torch.Tensor:
    return tt.deserialize(tt.serialize(t))


def service_round_trip(t: torch.Tensor) -> torch.Tensor:
    """What the service does: send the parts, gather them into one bytearray, view it in place."""
    received = bytearray().join(tt.serialize_parts(t))
    return tt.deserialize(received)


def reframer_round_trip(t: torch.Tensor) -> torch.Tensor:
    """The same, the receiver getting 1 MiB chunks and gathering them with the Reframer."""
    reframer = gathering.Reframer()
    payloads = []
    for part in tt.serialize_parts(t):
        view = memoryview(part).cast("B")
        for start in range(0, len(view), CHUNK):
            payloads.extend(reframer.feed(view[start : start + CHUNK]))
    reframer.close()
    (payload,) = payloads
    return tt.deserialize(payload)


def torch_save_load(t: torch.Tensor) -> torch.Tensor:
    out = io.BytesIO()
    torch.save(t, out)
    return torch.load(io.BytesIO(out.getvalue()))


def safetensors_save_load(t: torch.Tensor) -> torch.Tensor:
    return safetensors.torch.load(safetensors.torch.save({"t": t}))["t"]


ROUND_TRIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "pytannic serialize + deserialize (baseline)": pytannic_round_trip,
    "serialize + deserialize, bytes": bytes_round_trip,
    "service path: parts, gather, in place": service_round_trip,
    "service path through the Reframer, 1 MiB chunks": reframer_round_trip,
    "torch.save + torch.load, bytes": torch_save_load,
    "safetensors save + load, bytes": safetensors_save_load,
}
BASELINE = next(iter(ROUND_TRIPS))


def check(t: torch.Tensor) -> None:
    """Every method round-trips the tensor exactly before it is timed."""
    for name, fn in ROUND_TRIPS.items():
        back = fn(t)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), name


def run(options: Options) -> CaseResult:
    sizes = options.pick_sizes([MIB, 16 * MIB, 256 * MIB, GiB], [MIB, 64 * MIB])
    result = CaseResult("codec", "Codec: tensor → payload → tensor, in memory", INTRO)
    torch.set_num_threads(1)  # the codec is single-threaded; keep torch's copies comparable
    table = Table("Round trips (float32)", ["size", "method", "median", "spread (min – max)", "speed-up over pytannic"],
                  note="Speed-up: pytannic's median time over the method's, in the same run.")
    ratios: dict[tuple[int, str], float] = {}
    series: dict[str, list] = {}
    for size in sizes:
        t = torch.randn(size // 4, dtype=torch.float32)
        check(t)
        rounds = {name: (lambda fn=fn: repeat_timed(lambda: fn(t))) for name, fn in ROUND_TRIPS.items()}
        timings = {name: q["time"] for name, q in alternate(rounds, options.repetitions(size)).items()}
        base = timings[BASELINE].median
        for name, samples in timings.items():
            ratio = base / samples.median
            ratios[size, name] = ratio
            table.add(fmt_size(size), name, fmt_time(samples.median), samples.spread(), fmt_ratio(ratio))
            series.setdefault(name, []).append([size, size / samples.median, size / samples.high, size / samples.low])
        del t, timings, rounds
        free_memory()
    result.tables.append(table)
    largest = max(sizes)
    for name, goal in TARGETS.items():
        result.target(f"{name} at {fmt_size(largest)}, speed-up over pytannic", ratios[largest, name], goal)
    if len(sizes) > 1:
        no_copy, growth = no_copy_table(min(sizes), largest, options.repetitions())
        result.tables.append(no_copy)
        for name, g in growth.items():
            result.target(f"{name}: time at {fmt_size(largest)} over time at {fmt_size(min(sizes))} "
                          "(no copy: the same time)", g, 2.0, higher_is_better=False)
    result.data = {"series": series, "sizes": sizes, "baseline": BASELINE}
    return result


def no_copy_table(small: int, large: int, reps: int) -> tuple[Table, dict[str, float]]:
    """serialize_parts alone and deserialize(bytearray) alone: their time must not grow with the size."""
    medians: dict[int, dict[str, float]] = {}
    for size in (small, large):
        t = torch.randn(size // 4, dtype=torch.float32)
        received = bytearray(tt.serialize(t))
        rounds = {
            "serialize_parts alone": lambda: repeat_timed(lambda: tt.serialize_parts(t)),
            "deserialize(bytearray) alone": lambda: repeat_timed(lambda: tt.deserialize(received)),
        }
        medians[size] = {name: q["time"].median for name, q in alternate(rounds, reps).items()}
        del t, received, rounds
        free_memory()
    table = Table("No copy: time against size", ["operation", f"{fmt_size(small)}", f"{fmt_size(large)}",
                                                  f"{fmt_size(large)} / {fmt_size(small)}"])
    growth = {}
    for name in medians[small]:
        a, b = medians[small][name], medians[large][name]
        growth[name] = b / a
        table.add(name, fmt_time(a), fmt_time(b), f"{b / a:.2f}")
    return table, growth
