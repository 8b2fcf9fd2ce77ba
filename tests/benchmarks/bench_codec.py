"""Codec speed, side by side with pytannic (issue 2, "Speed"): ratios measured in one run.

Each repetition runs every method once, in an order that rotates from one repetition to
the next, so drift (other processes, thermal state) spreads over all of them. Reported: the
median time, the spread (min to max), and the median speed-up over pytannic's
``serialize`` + ``deserialize``.

    .venv/bin/python -m tests.benchmarks.bench_codec [--sizes 1 256] [--reps 7]

Prints a markdown table and writes it to ``bench-results/codec.md``.
"""

from __future__ import annotations

import argparse
import gc
import io
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
from pytannic.torch import tensors as pytannic

from tannery import codec
from tannery import torch as tt

MIB = 1 << 20
CHUNK = MIB  # a receiver's message size (gRPC's default maximum is 4 MiB)
TARGETS = {"serialize + deserialize, bytes": 1.5, "service path: parts, gather, in place": 3.5}


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
    reframer = codec.Reframer()
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


@dataclass
class Timing:
    samples: list[float]  # seconds per call

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def spread(self) -> str:
        return f"{fmt(min(self.samples))} – {fmt(max(self.samples))}"


def fmt(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def calls_per_sample(fn: Callable[[], object]) -> int:
    """Enough calls that one sample lasts ~20 ms (one call for anything slower)."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, min(10_000, int(0.02 / max(once, 1e-7))))


def compare(methods: dict[str, Callable[[], object]], reps: int) -> dict[str, Timing]:
    """Time every method ``reps`` times, rotating the order each repetition."""
    names = list(methods)
    numbers = {name: calls_per_sample(methods[name]) for name in names}
    timings = {name: Timing([]) for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn, number = methods[name], numbers[name]
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                for _ in range(number):
                    result = fn()
                    del result
                elapsed = time.perf_counter() - start
            finally:
                gc.enable()
            timings[name].samples.append(elapsed / number)
    return timings


def check(t: torch.Tensor) -> None:
    """Every method round-trips the tensor exactly before it is timed."""
    for name, fn in ROUND_TRIPS.items():
        back = fn(t)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), name


def round_trip_table(sizes: list[int], reps: int) -> tuple[list[str], dict[tuple[int, str], float]]:
    lines = [
        "| size | method (float32) | median | spread (min – max) | speed-up over pytannic |",
        "|---|---|---|---|---|",
    ]
    ratios = {}
    for size in sizes:
        t = torch.randn(size // 4, dtype=torch.float32)
        check(t)
        timings = compare({name: (lambda fn=fn: fn(t)) for name, fn in ROUND_TRIPS.items()}, reps)
        base = timings[BASELINE].median
        for name, timing in timings.items():
            ratio = base / timing.median
            ratios[size, name] = ratio
            lines.append(f"| {size // MIB} MiB | {name} | {fmt(timing.median)} | {timing.spread()} | {ratio:.2f}x |")
        del t, timings
        gc.collect()
    return lines, ratios


def no_copy_table(sizes: list[int], reps: int) -> tuple[list[str], dict[str, float]]:
    """serialize_parts alone and deserialize(bytearray) alone: their time must not grow with the size."""
    per_size: dict[int, dict[str, Timing]] = {}
    for size in sizes:
        t = torch.randn(size // 4, dtype=torch.float32)
        received = bytearray(tt.serialize(t))
        methods = {
            "serialize_parts alone": lambda: tt.serialize_parts(t),
            "deserialize(bytearray) alone": lambda: tt.deserialize(received),
        }
        per_size[size] = compare(methods, reps)
        del t, received, methods
        gc.collect()
    small, large = min(sizes), max(sizes)
    lines = [
        f"| operation | {small // MIB} MiB median | {large // MIB} MiB median | {large // MIB} MiB / {small // MIB} MiB |",
        "|---|---|---|---|",
    ]
    growth = {}
    for name in per_size[small]:
        a, b = per_size[small][name].median, per_size[large][name].median
        growth[name] = b / a
        lines.append(f"| {name} | {fmt(a)} | {fmt(b)} | {b / a:.2f} |")
    return lines, growth


def environment() -> str:
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("torch", "numpy", "pytannic", "safetensors"))
    return (
        f"Python {platform.python_version()}, {versions}; {platform.machine()}, "
        f"{len(__import__('os').sched_getaffinity(0))} CPUs available"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 256], help="tensor sizes in MiB (default 1 256)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each method (default 7)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/codec.md"))
    args = parser.parse_args(argv)
    sizes = sorted({s * MIB for s in args.sizes})
    torch.set_num_threads(1)  # the codec is single-threaded; keep torch's copies comparable

    round_trips, ratios = round_trip_table(sizes, args.reps)
    no_copy, growth = no_copy_table(sizes, args.reps) if len(sizes) > 1 else ([], {})
    largest = max(sizes)
    verdicts = [
        f"- {name} at {largest // MIB} MiB: {ratios[largest, name]:.2f}x (target ≥ {target}x): "
        f"{'met' if ratios[largest, name] >= target else 'MISSED'}"
        for name, target in TARGETS.items()
    ] + [
        f"- {name}: {g:.2f}x the time for {largest // min(sizes)}x the bytes (target: the same time, no copy): "
        f"{'met' if g < 2 else 'MISSED'}"
        for name, g in growth.items()
    ]
    report = "\n".join(
        [
            "# Codec benchmark",
            "",
            f"{environment()}; torch.set_num_threads(1); {args.reps} repetitions, order rotated each repetition.",
            "",
            "## Round trips (tensor → payload → tensor)",
            "",
            *round_trips,
            "",
            *(["## No copy: time against size", "", *no_copy, ""] if no_copy else []),
            "## Targets (issue 2)",
            "",
            *verdicts,
            "",
            f"Peak RSS of the run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB.",
            "",
        ]
    )
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
