"""A SeaweedFS whose S3 requests and objects are counted from outside the server that makes them.

``weed server -metricsPort N`` serves Prometheus metrics on loopback; its counter
``SeaweedFS_s3_request_total`` counts the S3 gateway's requests by kind (label ``type``: PUT,
GET, DELETE, LIST...; SeaweedFS counts a HEAD as a GET), status and bucket. Scraped before
and after a call, it tells how many requests of each kind the call made, whoever made them.
SeaweedFS counts a request once its handler has returned, which may be just after the client
has its answer, so the scrape after a call waits until the counter stays still. Objects are
counted by listing.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections import Counter
from pathlib import Path

from tests.s3_harness import SeaweedFS

METRIC = "SeaweedFS_s3_request_total"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class MeteredSeaweedFS(SeaweedFS):
    """``tests.s3_harness.SeaweedFS`` with its Prometheus metrics on a free loopback port."""

    metrics_port: int = 0

    def command(self) -> list[str]:
        if not self.metrics_port:  # chosen once, distinct from the ports the harness picked
            taken = {self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc,
                     self.s3, self.s3_grpc}
            while not self.metrics_port or self.metrics_port in taken:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    self.metrics_port = probe.getsockname()[1]
        return [*super().command(), f"-metricsPort={self.metrics_port}"]

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def requests(self, bucket: str) -> Counter[str]:
        """S3 requests on ``bucket`` so far, by kind (all statuses)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        counts: Counter[str] = Counter()
        for line in text.splitlines():
            if not line.startswith(METRIC + "{"):
                continue
            labels, _, value = line.rpartition(" ")
            named = dict(_LABEL.findall(labels))
            if named.get("bucket") == bucket:
                counts[named.get("type", "?")] += int(float(value))
        return counts

    def settled_requests(self, bucket: str, pause: float = 0.05, limit: float = 2.0) -> Counter[str]:
        """:meth:`requests` once two scrapes ``pause`` apart agree (at most ``limit`` seconds):
        the requests of a call just answered are all counted."""
        last, deadline = self.requests(bucket), time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(pause)
            now = self.requests(bucket)
            if now == last:
                break
            last = now
        return last

    def objects(self, bucket: str, prefix: str) -> int:
        """Objects under ``prefix`` in ``bucket`` now (a listing: LIST requests of its own)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sum(page.get("KeyCount", 0) for page in pages)


def counted(before: Counter[str], after: Counter[str], per: int = 1) -> dict[str, float]:
    """Requests between two scrapes, by kind, divided by ``per`` (calls)."""
    return {kind: (after[kind] - before.get(kind, 0)) / per for kind in after if after[kind] > before.get(kind, 0)}


#: How the table names SeaweedFS's kinds (it counts a HEAD as a GET).
SHOWN = {"GET": "GET/HEAD"}


def fmt_requests(kinds: dict[str, float] | None) -> str:
    """``20000: PUT 10000, HEAD 10000`` (total first, then by kind, most first); ``–`` for none."""
    if kinds is None:
        return "–"
    kinds = {kind: n for kind, n in kinds.items() if n}
    if not kinds:
        return "0"
    ordered = sorted(kinds.items(), key=lambda item: (-item[1], item[0]))
    return f"{sum(kinds.values()):g}: " + ", ".join(f"{SHOWN.get(kind, kind)} {n:g}" for kind, n in ordered)


def data_files(data_dir: Path) -> int:
    """Regular files in an embedded server's data directory but its catalog's and ``tmp/``
    (today: one per blob, under ``blobs/``)."""
    count = 0
    for path in data_dir.rglob("*"):
        top = path.relative_to(data_dir).parts[0]
        if top != "tmp" and not top.startswith("catalog.sqlite3") and path.is_file():
            count += 1
    return count
