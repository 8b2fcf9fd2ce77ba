"""Prometheus metrics over HTTP: calls, bytes, durations, what the store holds, channel subscribers.

Each server has its own registry (so servers in one process do not mix their numbers):

- ``tannery_calls_total{method, code}`` and ``tannery_call_duration_seconds{method}``,
  counted once per call by :meth:`ServerMetrics.observe_call`, an observer of the call log;
  ``tannery_received_bytes_total{method}`` and ``tannery_sent_bytes_total{method}``, counted
  as the call ends and, for calls still running (a Subscribe of hours), at each scrape with
  what they moved so far (:meth:`ServerMetrics.call_started`, a starter of the call log);
- ``tannery_channel_payloads_total{direction, transport}`` and
  ``tannery_channel_payload_bytes_total{direction, transport}``: each whole channel payload as it
  moves (in: received from a publisher here, by its transport ``grpc``, ``tcp`` or ``local``,
  or from another replica, ``nats``; out: handed to a subscriber here, once per subscriber, by
  the subscriber's transport), told by the hub (:meth:`ServerMetrics.observe_traffic`);
- ``tannery_archives``, ``tannery_archive_bytes``, ``tannery_blobs`` and
  ``tannery_stored_bytes``, read from the catalog at each scrape (one small query, on a
  thread of its own so the scrape never waits for the event loop);
- ``tannery_channel_subscribers``, ``tannery_channels`` and
  ``tannery_channel_dropped_subscribers_total``, read from the channel hub;
- with ``--nats``: ``tannery_nats_connected``, ``tannery_nats_payloads_total{direction}`` and
  ``tannery_nats_bytes_total{direction}`` (out: published here, in: from other replicas,
  relayed here), ``tannery_nats_incomplete_payloads_total`` and
  ``tannery_nats_dropped_subscribers_total``, read from the channel fabric;
- ``tannery_data_handshake_failures_total{listener, reason}``: connections to a data path
  (listener ``local``, the same-host socket, or ``tcp``, the data port) ended before a valid
  ticket, by reason (``timeout``, ``oversized``, ``peer_limit``, ``listener_limit``,
  ``bad_ticket``, ``malformed``, ``closed``), read from the data paths (:mod:`.dataplane.handshakes`);
- for shared storage: ``tannery_collection_failures_total`` (failed removals of unreferenced
  blobs) and ``tannery_collection_stuck_blobs`` (those waiting to be tried again);
- with a bucket: ``tannery_upload_memory_bytes`` (payloads held in memory on their way, at
  most ``--upload-memory``) and ``tannery_upload_spills_total`` (those spilled to a file);
- the process and Python collectors of ``prometheus_client`` (CPU, memory, file descriptors, GC).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .calllog import CallRecord
from .config import Config
from .storage import Storage

log = logging.getLogger("tannery_server.metrics")

#: Call durations from a millisecond (a Describe) to ten minutes (a large Store or a Subscribe).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
#: Seconds a scrape waits for the catalog's totals before leaving them out.
CATALOG_TIMEOUT = 5.0
#: The (direction, transport) pairs of the channel traffic counters, all shown from the start.
#: The methods whose data-path bytes come in (received); every other method's go out (sent).
RECEIVING = frozenset({"Store", "Publish"})
CHANNEL_TRAFFIC = (("in", "grpc"), ("in", "tcp"), ("in", "local"), ("in", "nats"),
                   ("out", "grpc"), ("out", "tcp"), ("out", "local"))


class _CatalogCollector:
    """Gauges of what the catalog holds, queried when scraped."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        # One thread, so one SQLite reader connection, whichever HTTP thread scrapes.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tannery-metrics")
        self._closed = False

    def collect(self) -> Iterator[Metric]:
        if self._closed:
            return
        try:
            totals = self._executor.submit(self.storage.catalog.totals).result(CATALOG_TIMEOUT)
        except Exception as exc:  # a scrape must not fail for this; the gap shows on the graphs
            log.warning("metrics: cannot read the catalog's totals: %s", exc)
            return
        yield GaugeMetricFamily("tannery_archives", "Archives in the store.", value=totals.archives)
        yield GaugeMetricFamily("tannery_archive_bytes", "Payload bytes of all archives (an entry shared by "
                                "two archives counts twice).", value=totals.archive_bytes)
        yield GaugeMetricFamily("tannery_blobs", "Distinct payloads stored.", value=totals.blobs)
        yield GaugeMetricFamily("tannery_stored_bytes", "Bytes of the distinct payloads stored (what the blob "
                                "files hold).", value=totals.blob_bytes)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True)


class _CollectionCollector:
    """Failed blob collections (a shared store's sweeper, :class:`~.storage.collect_backoff.CollectBackoff`)."""

    def __init__(self, backoff: object) -> None:
        self.backoff = backoff

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("tannery_collection_failures", "Removals of unreferenced blobs that failed "
                                  "(each is logged, naming the blob; the blob is tried again with backoff).",
                                  value=getattr(self.backoff, "failures_total", 0))
        yield GaugeMetricFamily("tannery_collection_stuck_blobs", "Unreferenced blobs whose last removal failed, "
                                "waiting to be tried again.", value=len(self.backoff.stuck()))  # type: ignore[attr-defined]


class _UploadMemoryCollector:
    """What a bucket store holds in memory for payloads on their way (:class:`~.storage.upload_memory.MemoryBudget`)."""

    def __init__(self, memory: object) -> None:
        self.memory = memory

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("tannery_upload_memory_bytes", "Bytes of payloads held in memory on their way to "
                                "the bucket (at most --upload-memory).", value=getattr(self.memory, "used", 0))
        yield CounterMetricFamily("tannery_upload_spills", "Payloads spilled to a local file for want of upload "
                                  "memory.", value=getattr(self.memory, "spills", 0))


class _HubCollector:
    """Channel subscribers now, and those dropped for falling behind, read from the hub."""

    def __init__(self, hub: object) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("tannery_channels", "Channels with a subscriber or publisher attached.",
                                value=len(getattr(self.hub, "channels", ())))
        yield GaugeMetricFamily("tannery_channel_subscribers", "Subscribe calls attached to a channel now.",
                                value=getattr(self.hub, "subscribers", 0))
        yield CounterMetricFamily("tannery_channel_dropped_subscribers", "Subscribers dropped because their "
                                  "buffer stayed full longer than the channel timeout.",
                                  value=getattr(self.hub, "dropped_subscribers", 0))


class _FabricCollector:
    """The NATS fabric's connection state and traffic (:mod:`.nats_fabric`)."""

    def __init__(self, fabric: object) -> None:
        self.fabric = fabric

    def collect(self) -> Iterator[Metric]:
        stats = self.fabric.stats()  # type: ignore[attr-defined]
        yield GaugeMetricFamily("tannery_nats_connected", "1 while this replica is connected to NATS, else 0.",
                                value=1 if stats["connected"] else 0)
        payloads = CounterMetricFamily("tannery_nats_payloads", "Channel payloads through NATS: out, published "
                                       "on this replica; in, from other replicas, relayed here.", labels=["direction"])
        nbytes = CounterMetricFamily("tannery_nats_bytes", "Payload bytes of those payloads.", labels=["direction"])
        for direction in ("out", "in"):
            payloads.add_metric([direction], stats[f"payloads_{direction}"])
            nbytes.add_metric([direction], stats[f"bytes_{direction}"])
        yield payloads
        yield nbytes
        yield CounterMetricFamily("tannery_nats_incomplete_payloads", "Payloads from other replicas dropped "
                                  "incomplete (their replica died, lost NATS or abandoned them).",
                                  value=stats["incomplete"])
        yield CounterMetricFamily("tannery_nats_dropped_subscribers", "Subscribers ended for a cross-replica "
                                  "reason: NATS lost, chunks lost, or payloads from other replicas arriving faster "
                                  "than they took them.", value=stats["dropped"])


class _HandshakeCollector:
    """Data-path handshakes refused or timed out, by listener and reason, read from the data paths."""

    def __init__(self, data_paths: object) -> None:
        self.data_paths = data_paths

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "tannery_data_handshake_failures", "Connections to a data path (listener local: the same-host socket; "
            "tcp: the data port) ended before a valid ticket, by reason: timeout (no valid ticket within the "
            "handshake deadline), oversized (a frame announced over the handshake limit), peer_limit and "
            "listener_limit (ended to make room: its peer or its listener had too many handshakes in progress), "
            "bad_ticket (refused: unknown, expired or for the other path), malformed (not a hello, or bad TLS), "
            "closed (the peer went away).", labels=["listener", "reason"])
        counts = self.data_paths.handshake_failures.snapshot()  # type: ignore[attr-defined]
        for (listener, reason), count in sorted(counts.items()):
            failures.add_metric([listener, reason], count)
        yield failures


class _LiveCalls:
    """Adds what the calls still running have received and sent so far to the byte counters.

    It yields nothing; registered before those counters, it runs first in every scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self.metrics.count_running_calls()
        return iter(())


class ServerMetrics:
    """The metrics of one server and, once :meth:`serve` is called, their HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        #: The records of the calls running, by id: (record, received and sent bytes counted so far).
        self._running: dict[int, tuple[CallRecord, int, int]] = {}
        self._running_lock = threading.Lock()
        self.registry.register(_LiveCalls(self))
        self.calls = Counter("tannery_calls", "Calls handled, by method and status code.", ["method", "code"],
                             registry=self.registry)
        self.received = Counter("tannery_received_bytes", "Bytes of request messages received, by method "
                                "(a call still running counts what it received by the scrape).",
                                ["method"], registry=self.registry)
        self.sent = Counter("tannery_sent_bytes", "Bytes of response messages sent, by method (a call still "
                            "running counts what it sent by the scrape).", ["method"], registry=self.registry)
        self.data_path = Counter("tannery_data_path_bytes", "Payload bytes moved on a data path beside gRPC (the "
                                 "same-host socket, local, or the direct data connection, tcp), by method, "
                                 "transport and direction (in: received, a Store's or a Publish's; out: sent, a "
                                 "Fetch's or a Subscribe's); what gRPC messages carry is in the received and sent "
                                 "bytes.", ["method", "transport", "direction"], registry=self.registry)
        self.channel_payloads = Counter(
            "tannery_channel_payloads", "Whole channel payloads as they move, by direction and transport: in, each "
            "payload once its last byte has arrived from a publisher on this server (transport grpc, tcp or local: "
            "the publisher's) or once it came whole from another replica through NATS (nats, the same payloads as "
            "tannery_nats_payloads_total{direction=\"in\"}); out, each payload once per subscriber on this server, "
            "when its last piece is handed to that subscriber's transport (grpc, tcp, or local: passed as a memory "
            "file). Payloads cut off before their end are not counted; payloads sent to other replicas are "
            "tannery_nats_payloads_total{direction=\"out\"}.",
            ["direction", "transport"], registry=self.registry)
        self.channel_bytes = Counter(
            "tannery_channel_payload_bytes", "Bytes of those payloads (each one's whole size, header and tensor "
            "bytes, counted when it is counted in tannery_channel_payloads_total; local: the size of the memory "
            "file passed, though no payload byte crosses the socket).",
            ["direction", "transport"], registry=self.registry)
        for direction, transport in CHANNEL_TRAFFIC:
            self.channel_payloads.labels(direction, transport)
            self.channel_bytes.labels(direction, transport)
        self.duration = Histogram("tannery_call_duration_seconds", "Call durations, by method.", ["method"],
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self._catalog: _CatalogCollector | None = None
        self._http = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def call_started(self, record: CallRecord) -> None:
        """Follow a call's bytes while it runs (a :data:`~tannery_server.calllog.CallStarter`)."""
        with self._running_lock:
            self._running[id(record)] = (record, 0, 0)

    def count_running_calls(self) -> None:
        """Add to the byte counters what the calls still running moved since the last count."""
        with self._running_lock:
            for key, (record, received, sent) in list(self._running.items()):
                now_received, now_sent = record.received, record.sent
                self.received.labels(record.method).inc(now_received - received)
                self.sent.labels(record.method).inc(now_sent - sent)
                self._running[key] = (record, now_received, now_sent)

    def call_families(self) -> Iterator[Metric]:
        """The families of the calls alone (counts, bytes, durations), the running calls' bytes
        counted in: what the web page's traffic table reads every few seconds, without the
        scrape's catalog totals or process figures."""
        self.count_running_calls()
        for family in (self.calls, self.received, self.sent, self.data_path, self.duration):
            yield from family.collect()

    def observe_call(self, record: CallRecord, status: str, duration: float) -> None:
        """Count one finished call (a :data:`~tannery_server.calllog.CallObserver`)."""
        self.calls.labels(record.method, status).inc()
        with self._running_lock:
            _, received, sent = self._running.pop(id(record), (record, 0, 0))
            self.received.labels(record.method).inc(record.received - received)
            self.sent.labels(record.method).inc(record.sent - sent)
        transport = record.fields.get("transport")
        if transport is not None:
            direction = "in" if record.method in RECEIVING else "out"
            self.data_path.labels(record.method, transport, direction).inc(record.fields.get("data_bytes", 0))
        self.duration.labels(record.method).observe(duration)

    def observe_traffic(self, direction: str, transport: str, nbytes: int) -> None:
        """Count one whole channel payload moving (a :data:`~tannery_server.hub.Traffic`)."""
        self.channel_payloads.labels(direction, transport).inc()
        self.channel_bytes.labels(direction, transport).inc(nbytes)

    def watch_storage(self, storage: Storage) -> None:
        self._catalog = _CatalogCollector(storage)
        self.registry.register(self._catalog)
        backoff = getattr(storage, "backoff", None)
        if backoff is not None:
            self.registry.register(_CollectionCollector(backoff))
        blobs = getattr(storage, "blobs", None)
        memory = getattr(getattr(blobs, "inner", blobs), "memory", None)  # a bucket's, behind a cache or not
        if memory is not None:
            self.registry.register(_UploadMemoryCollector(memory))

    def watch_data_paths(self, data_paths: object) -> None:
        """The data paths' handshake failures (a :class:`~.dataplane.listeners.DataPaths`)."""
        self.registry.register(_HandshakeCollector(data_paths))

    def watch_hub(self, hub: object) -> None:
        self.registry.register(_HubCollector(hub))

    def watch_fabric(self, fabric: object) -> None:
        """The channel fabric's numbers, when it has any (NATS)."""
        if fabric.stats():  # type: ignore[attr-defined]
            self.registry.register(_FabricCollector(fabric))

    def serve(self, host: str, port: int, tls: Config | None = None) -> int:
        """Start the HTTP endpoint (``/metrics``) on ``host:port``; returns the port (``port`` 0 picks one).
        With ``tls`` (a config with a certificate), HTTPS with its certificate and key, and client
        certificates of its client CA required when it has one (as gRPC asks for them)."""
        options = {} if tls is None else {
            "certfile": str(tls.tls_cert), "keyfile": str(tls.tls_key),
            "client_cafile": str(tls.tls_client_ca) if tls.tls_client_ca else None,
            "client_auth_required": tls.tls_client_ca is not None}
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry, **options)
        self.port = self._http.server_port
        return self.port

    def close(self) -> None:
        """Stop the endpoint, then stop reading the catalog (before the storage closes)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._catalog is not None:
            self._catalog.close()


__all__ = ["DURATION_BUCKETS", "ServerMetrics"]
