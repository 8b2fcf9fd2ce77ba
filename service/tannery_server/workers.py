"""The worker threads a servicer's blocking work (files, SQLite, sockets) runs on, and the end of a
background task of the event loop (:func:`stop_task`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Workers:
    """A pool of threads, run from the event loop."""

    def __init__(self, threads: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def start(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` begun on a worker thread; its future."""
        loop = asyncio.get_running_loop()
        try:
            return loop.run_in_executor(self._executor, fn, *args)
        except RuntimeError:
            # Closed: a call cancelled at shutdown still releases its pins and files (on the
            # loop's default threads) after the pool stopped taking work.
            return loop.run_in_executor(None, fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.start(fn, *args)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)


async def settle(future: asyncio.Future | None) -> None:
    """Wait until a worker thread's ``future`` is over, its failure taken (the call's own
    failure, or its cancellation, is what the client hears about)."""
    if future is None:
        return
    if not future.done():
        await asyncio.wait([future])
    if not future.cancelled():
        future.exception()


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (a background loop of the server's: a health check, the traffic sampler)
    and wait until it has ended; nothing when there is none."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
