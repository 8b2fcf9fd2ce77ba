"""Calls, bytes and latency by RPC, read from the metrics the server keeps (:mod:`..metrics`),
and the rates of the last minute from samples taken every few seconds while the page is on."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..workers import stop_task

#: Seconds between two samples, and samples kept (the rates' window, the plot's span).
INTERVAL = 5.0
KEPT = 60
#: Window of the rates the table shows, seconds.
RATE_WINDOW = 60.0


@dataclass
class MethodTraffic:
    """One RPC's totals since start, its rates over the last minute, and its latency."""

    method: str
    calls: int = 0
    errors: int = 0
    received: float = 0.0
    sent: float = 0.0
    seconds: float = 0.0
    #: Latency quantiles estimated from the histogram's buckets (upper bounds), seconds.
    p50: float | None = None
    p95: float | None = None
    calls_per_second: float = 0.0
    bytes_per_second: float = 0.0

    @property
    def mean_seconds(self) -> float | None:
        return self.seconds / self.calls if self.calls else None


def read_totals(metrics: Any) -> dict[str, MethodTraffic]:
    """Every RPC's totals now, from ``metrics`` (a :class:`~..metrics.ServerMetrics`): its call
    families only, so that a load of the page (and its sampling) never counts the catalog."""
    methods: dict[str, MethodTraffic] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}

    def of(method: str) -> MethodTraffic:
        return methods.setdefault(method, MethodTraffic(method))

    for family in metrics.call_families():
        for sample in family.samples:
            method = sample.labels.get("method")
            if method is None:
                continue
            if sample.name == "tannery_calls_total":
                of(method).calls += int(sample.value)
                if sample.labels.get("code") != "OK":
                    of(method).errors += int(sample.value)
            elif sample.name == "tannery_received_bytes_total":
                of(method).received += sample.value
            elif sample.name == "tannery_sent_bytes_total":
                of(method).sent += sample.value
            elif sample.name == "tannery_data_path_bytes_total":  # payload bytes moved beside gRPC, by direction
                if sample.labels.get("direction") == "in":
                    of(method).received += sample.value
                else:
                    of(method).sent += sample.value
            elif sample.name == "tannery_call_duration_seconds_sum":
                of(method).seconds += sample.value
            elif sample.name == "tannery_call_duration_seconds_bucket":
                buckets.setdefault(method, []).append((float(sample.labels["le"]), sample.value))
    for method, rows in buckets.items():
        rows.sort()
        of(method).p50 = _quantile(rows, 0.5)
        of(method).p95 = _quantile(rows, 0.95)
    return methods


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the first bucket holding quantile ``q`` (cumulative counts)."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


class Traffic:
    """Samples of the totals every :data:`INTERVAL` seconds; the rates and the plot come from them."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.samples: deque[tuple[float, dict[str, MethodTraffic]]] = deque(maxlen=KEPT)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.metrics is not None:
            self.sample()
            self._task = asyncio.create_task(self._run(), name="tannery-web-traffic")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            self.sample()

    def sample(self) -> None:
        self.samples.append((time.monotonic(), read_totals(self.metrics)))

    def now(self) -> list[MethodTraffic]:
        """Every RPC's totals and latency now, with its rates over the last minute (by name)."""
        if self.metrics is None:
            return []
        now, totals = time.monotonic(), read_totals(self.metrics)
        base = next(((t, s) for t, s in self.samples if now - t <= RATE_WINDOW), None)
        if base is not None and now - base[0] > 0.5:
            span = now - base[0]
            for method, row in totals.items():
                before = base[1].get(method, MethodTraffic(method))
                row.calls_per_second = (row.calls - before.calls) / span
                row.bytes_per_second = (row.received + row.sent - before.received - before.sent) / span
        return sorted(totals.values(), key=lambda row: row.method)

    def history(self) -> list[tuple[float, float]]:
        """Bytes per second of all RPCs between consecutive samples: (seconds ago, rate)."""
        points = []
        now = time.monotonic()
        samples = list(self.samples)
        for (t0, s0), (t1, s1) in zip(samples, samples[1:]):
            moved = sum(r.received + r.sent for r in s1.values()) - sum(r.received + r.sent for r in s0.values())
            points.append((now - t1, moved / max(t1 - t0, 1e-9)))
        return points


__all__ = ["MethodTraffic", "Traffic", "read_totals"]
