"""The server: storage opened, services registered, run until SIGTERM/SIGINT, then drained.

:func:`start` builds and starts a server and returns a :class:`RunningServer` (what the
tests use in-process); :func:`serve` runs one until a signal (what ``tannery serve`` does).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tannery.v1 import archives_pb2, channels_pb2

from . import archives
from .calllog import CallLogInterceptor
from .config import Config
from .storage import Storage

log = logging.getLogger("tannery_server")

ARCHIVES = archives_pb2.DESCRIPTOR.services_by_name["Archives"].full_name
CHANNELS = channels_pb2.DESCRIPTOR.services_by_name["Channels"].full_name


@dataclass
class RunningServer:
    """A started server; :meth:`stop` drains it and closes its storage."""

    server: grpc.aio.Server
    port: int
    config: Config
    storage: Storage
    health: health.aio.HealthServicer
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


def _register_channels(server: grpc.aio.Server, config: Config, enders: list) -> bool:
    try:
        from .channels import ChannelsServicer
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.channels":
            raise
        log.warning("the Channels service is not installed (no %s.channels); serving Archives only", __package__)
        return False
    from tannery.v1 import channels_pb2_grpc

    servicer = ChannelsServicer(config)
    channels_pb2_grpc.add_ChannelsServicer_to_server(servicer, server)
    enders.append(servicer.close)
    return True


async def start(config: Config) -> RunningServer:
    """Open storage, build the server with every service, bind, start; health SERVING."""
    storage = await asyncio.to_thread(Storage.open_local, config.data_dir)
    closers: list = []
    enders: list = []
    try:
        server = grpc.aio.server(interceptors=[CallLogInterceptor()])
        archives_servicer = archives.ArchivesServicer(storage, config)
        archives.add_to_server(archives_servicer, server)
        closers.append(archives_servicer.close)
        services = [ARCHIVES]
        if _register_channels(server, config, enders):
            services.append(CHANNELS)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}")
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
    running = RunningServer(server, port, config, storage, health_servicer, closers, enders)
    log.info("serving on %s (data directory %s)", running.target, config.data_dir.resolve())
    return running


def tune_malloc() -> bool:
    """Keep chunk-sized buffers in glibc's heap instead of fresh mmaps.

    Every message is a new buffer of about a chunk (1 MiB). By default glibc maps such a
    buffer and unmaps it when freed (or trims the heap), so the next one page-faults
    again: measured, a third of the server's CPU in Fetch. With these two settings freed
    chunks are reused. Returns False where glibc is not the allocator.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 128 << 20))


async def serve(config: Config) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully."""
    # A write past RLIMIT_FSIZE must fail with EFBIG (answered RESOURCE_EXHAUSTED), not kill us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    tune_malloc()
    running = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: finishing calls in flight (grace %.1f s)", config.grace_seconds)
    finally:
        await running.stop()


def run(config: Config) -> None:
    asyncio.run(serve(config))
