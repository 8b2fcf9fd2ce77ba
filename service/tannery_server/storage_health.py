"""The gRPC health service follows the storage: NOT_SERVING while the catalog or the blob
store does not answer, SERVING again once it does (no restart).

A load balancer that checks health stops sending calls to a replica whose PostgreSQL or
bucket is away; the calls that still arrive are answered UNAVAILABLE naming which one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from grpc_health.v1 import health, health_pb2

from .storage import StorageBase
from .workers import stop_task

log = logging.getLogger("tannery_server.health")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StorageHealth:
    """Checks the storage every ``interval`` seconds and sets the health of ``services``."""

    def __init__(self, storage: StorageBase, servicer: health.aio.HealthServicer, services: Sequence[str],
                 interval: float) -> None:
        self.storage = storage
        self.servicer = servicer
        self.services = ["", *services]
        self.interval = interval
        #: Why the storage is not answering (None while it is).
        self.problem: str | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="tannery-storage-health")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def check_once(self) -> None:
        """One check, and the health set by its outcome when it changed."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.storage.check), timeout=max(self.interval, 5.0))
        except Exception as exc:  # StorageUnavailable names it; a hang is a failure too
            problem = str(exc) or f"storage check timed out after {max(self.interval, 5.0):.0f} s"
            if problem != self.problem:
                log.warning("storage unavailable, health NOT_SERVING: %s", problem)
            if self.problem is None:
                await self._set(NOT_SERVING)
            self.problem = problem
            return
        if self.problem is not None:
            log.info("storage answers again, health SERVING")
            self.problem = None
            await self._set(SERVING)

    async def _set(self, status) -> None:
        for name in self.services:
            await self.servicer.set(name, status)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_once()
