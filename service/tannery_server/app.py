"""The server: storage opened, services registered, run until SIGTERM/SIGINT, then drained.

:func:`start` builds and starts a server and returns a :class:`RunningServer` (what the
tests use in-process); :func:`serve` runs one until a signal (what ``tannery serve`` does).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import signal
import socket
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tannery_protocol.v1 import archives_pb2, channels_pb2

from . import archives, tls
from .auth import AuthInterceptor, Tokens, load_tokens
from .calllog import CallLogInterceptor
from .config import Config
from .dataplane.listeners import DataPaths
from .storage import Storage
from .storage.factory import describe, open_storage
from .storage_health import StorageHealth

log = logging.getLogger("tannery_server")

ARCHIVES = archives_pb2.DESCRIPTOR.services_by_name["Archives"].full_name
CHANNELS = channels_pb2.DESCRIPTOR.services_by_name["Channels"].full_name
#: gRPC turns SO_REUSEPORT on by default, which lets a second server bind a port beside a
#: running one (and clients reach either at random): off, so a busy port fails the start.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class AddressInUse(OSError):
    """The gRPC port is taken by another process: the start-up error, with its remedy."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"cannot listen on {host}:{port}: the port is already in use by another "
                         "process (another tannery server?); choose another with --port or TANNERY_PORT")

    def __str__(self) -> str:
        return self.strerror


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails with EADDRINUSE (as gRPC binds: SO_REUSEADDR, no SO_REUSEPORT).

    Port 0 is never in use; an address that does not resolve is not "in use" (gRPC's own
    error says what is wrong with it).
    """
    if port == 0:
        return False
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def metrics_url(host: str, port: int, tls: bool = False) -> str:
    """The address of the metrics endpoint, as Prometheus scrapes it (https with ``tls``)."""
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening port to ``server``; the port bound (the one picked when ``port`` is 0).

    A busy port raises :class:`AddressInUse` before gRPC tries it (so no gRPC error line
    is logged) or, when it was taken in between, after: grpcio 1.85 raises RuntimeError
    for a port it cannot bind, older versions returned 0. Any other failure to bind is an
    OSError naming the address.
    """
    if port_in_use(host, port):
        raise AddressInUse(host, port)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        if port_in_use(host, port):
            raise AddressInUse(host, port) from None
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if bound == 0:
        if port_in_use(host, port):
            raise AddressInUse(host, port)
        raise OSError(f"cannot listen on {address}")
    return bound


@dataclass
class RunningServer:
    """A started server; :meth:`stop` drains it and closes its storage."""

    server: grpc.aio.Server
    port: int
    config: Config
    storage: Storage
    health: health.aio.HealthServicer
    #: Port of the metrics endpoint (None when metrics are off).
    metrics_port: int | None = None
    #: The Channels servicer (its ``hub`` holds the channels), None when not installed.
    channels: Any = None
    #: The aliases watched (:class:`~.watching.AliasWatches`).
    watches: Any = None
    #: The read-only web page (:class:`~.web.server.WebServer`), None when off.
    web: Any = None
    _closers: list[Callable[[], Awaitable[Any] | Any]] = field(default_factory=list)
    #: Run while calls drain: they end calls that would otherwise never finish (subscriptions).
    _enders: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)
    _stopped: bool = False

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace`` seconds, close storage."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        draining = asyncio.create_task(self.server.stop(self.config.grace_seconds if grace is None else grace))
        for end in self._enders:
            await end()
        await draining
        for close in reversed(self._closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result
        self.storage.close()
        log.info("stopped")


def _register_channels(server: grpc.aio.Server, config: Config, enders: list, data_paths: DataPaths | None = None):
    """The Channels servicer, registered (None when this build has no Channels service)."""
    try:
        from .channels import ChannelsServicer, add_to_server
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.channels":
            raise
        log.warning("the Channels service is not installed (no %s.channels); serving Archives only", __package__)
        return None
    servicer = ChannelsServicer(config, data_paths)
    add_to_server(servicer, server)  # undecodable requests are INVALID_ARGUMENT, not UNKNOWN
    enders.append(servicer.close)
    return servicer


def _security_summary(config: Config, tokens: Tokens, where: str) -> str:
    """How the server is protected, for the start-up line; warns about what is open."""
    if config.tls_client_ca is not None:
        transport = "mutual TLS"
    elif config.tls_cert is not None:
        transport = "TLS"
    else:
        transport = "plaintext"
    if tokens:
        access = f"{tokens.count('write')} write and {tokens.count('read')} read tokens"
        if config.tls_cert is None:
            log.warning("tokens are configured without TLS: they cross the network in clear text "
                        "(set TANNERY_TLS_CERT and TANNERY_TLS_KEY)")
    else:
        access = "no tokens"
        who = "any client with a certificate of the client CA" if config.tls_client_ca else "anyone who reaches " + where
        log.warning("no tokens configured: the server is open, %s may read, write and delete archives "
                    "(set TANNERY_TOKENS_FILE or TANNERY_TOKENS)", who)
    return f"{transport}, {access}"


async def start(config: Config) -> RunningServer:
    """Check the security settings, open storage, build the server with every service, bind,
    start metrics, start; health SERVING. A bad tokens or TLS file raises ValueError first."""
    tokens = load_tokens(config.tokens_file, config.tokens)
    credentials = tls.server_credentials(config)
    storage = await asyncio.to_thread(open_storage, config)
    closers: list = []
    enders: list = []
    metrics_port = None
    try:
        metrics = None
        observers, starters = [], []
        if config.serves_metrics or config.web_port is not None:  # the web page shows them too
            from .metrics import ServerMetrics  # prometheus_client is loaded only when asked for

            metrics = ServerMetrics()
            closers.append(metrics.close)
            metrics.watch_storage(storage)
            observers.append(metrics.observe_call)
            starters.append(metrics.call_started)
        interceptors: list = [CallLogInterceptor(observers, starters)]
        if tokens:
            interceptors.append(AuthInterceptor(tokens))  # inside the call log: refusals are logged and counted
        server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        data_paths = DataPaths(config)
        data_paths.start()
        closers.append(data_paths.close)
        if metrics is not None:
            metrics.watch_data_paths(data_paths)
        archives_servicer = archives.ArchivesServicer(storage, config, data_paths, tokens)
        archives.add_to_server(archives_servicer, server)
        closers.append(archives_servicer.close)
        enders.append(archives_servicer.watches.close)  # watch streams never end by themselves
        services = [ARCHIVES]
        channels_servicer = _register_channels(server, config, enders, data_paths)
        if channels_servicer is not None:
            await channels_servicer.start()  # with --nats: connected, or OSError naming NATS
            services.append(CHANNELS)
            # Alias moves travel between replicas with the channels' fabric (a no-op without one).
            archives_servicer.watches.announce = channels_servicer.fabric.announce
            # A Publish may store what it relays (store_as): a publisher's bytes written once.
            channels_servicer.published_store = archives_servicer.published_store
            channels_servicer.fabric.alias_moved = archives_servicer.watches.poke
            if metrics is not None:
                metrics.watch_hub(channels_servicer.hub)
                channels_servicer.hub.traffic = metrics.observe_traffic
                metrics.watch_fabric(channels_servicer.fabric)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if config.reflection:
            reflection.enable_server_reflection(
                [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                server,
            )
        port = bind(server, config.host, config.port, credentials)
        if config.serves_metrics:
            metrics_host = config.metrics_host or config.host
            try:
                metrics_port = metrics.serve(metrics_host, config.metrics_port,
                                             config if config.metrics_over_tls else None)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve metrics on {metrics_host}:{config.metrics_port}: "
                              f"{exc.strerror or exc} (choose another port with --metrics-port or "
                              "TANNERY_METRICS_PORT: auto for a free one, or off for none)") from None
            log.info("metrics on %s", metrics_url(metrics_host, metrics_port, config.metrics_over_tls))
        web_server = None
        if config.web_port is not None:
            from .web.server import start_web  # aiohttp and jinja2 are loaded only when asked for

            web_server = await start_web(config, storage, tokens, f"{config.host}:{port}", metrics, channels_servicer)
            closers.append(web_server.close)
        await server.start()
    except BaseException:
        for close in [*enders, *reversed(closers)]:
            result = close()
            if asyncio.iscoroutine(result):
                await result
        storage.close()
        raise
    for name in ("", *services):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    watcher = StorageHealth(storage, health_servicer, services, config.health_check_seconds)
    watcher.start()
    closers.append(watcher.close)  # closers run in reverse: the watcher stops first
    running = RunningServer(server, port, config, storage, health_servicer, metrics_port, channels_servicer,
                            archives_servicer.watches, web_server, closers, enders)
    security = _security_summary(config, tokens, running.target)
    metrics_at = (metrics_url(config.metrics_host or config.host, metrics_port, config.metrics_over_tls)
                  if metrics_port else "off")
    web_at = f", web page {web_server.url}" if web_server is not None else ""  # every address listened on
    log.info("serving on %s (gRPC), %s, metrics %s%s; %s; %s", running.target, data_paths.describe(), metrics_at,
             web_at, security, describe(config))
    return running


def tune_malloc() -> bool:
    """Keep chunk-sized buffers in glibc's heap instead of fresh mmaps.

    Every message is a new buffer of about a chunk (1 to 3 MiB). By default glibc maps such a
    buffer and unmaps it when freed (or trims the heap), so the next one page-faults
    again (what that cost: docs/benchmarks.md, "Server memory"). With these
    two settings freed chunks are reused. And at most two heaps (arenas): by default glibc
    gives threads up to 8 per core, each keeping what its thread freed, so the buffers of a
    bucket's many reading and uploading threads piled up (a 2 GiB Store and Fetch through a
    replica on S3 peaked at 370 MiB anonymous memory, 243 MiB with two arenas, no slower:
    docs/benchmarks.md, "Server memory"). Returns False where glibc is not
    the allocator.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return (bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 128 << 20))
            and bool(mallopt(m_arena_max, 2)))


async def serve(config: Config) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully."""
    # A write past RLIMIT_FSIZE must fail with EFBIG (answered RESOURCE_EXHAUSTED), not kill us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    tune_malloc()
    # Handlers first: a SIGTERM that arrives while storage opens stops the server once it is
    # up, gracefully, instead of killing it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start(config)
    try:
        await stop.wait()
        log.info("shutting down: finishing calls in flight (grace %.1f s)", config.grace_seconds)
    finally:
        await running.stop()


def run(config: Config) -> None:
    asyncio.run(serve(config))
