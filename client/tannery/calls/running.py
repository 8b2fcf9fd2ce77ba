"""How the call core's steps are run: the one difference between the two clients, side by side.

Every call is written once as steps (:mod:`tannery.rpc.waits`, :mod:`tannery.calls.core`).
``tannery.Client`` runs them with :func:`run` and :func:`iterate`, waiting for each by
blocking; ``tannery.aio.Client`` with :func:`run_async` and :func:`drive_async`, by awaiting:
gRPC's asyncio API, and worker threads (``asyncio.to_thread``) for what blocks (a data
connection's bytes). The weight followers run theirs the same two ways. What to do, and what
an outcome means, is never decided here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Callable

import grpc

from tannery_protocol._lazy import lazy_module
from tannery.rpc.waits import END, Acquire, Blocking, Driven, Read, Rpc, Send, Sleep, Status, Steps, Upload, Wait

# Imported by the first streaming call (a thread per call): catalog calls (tannery ls) need none.
grpc_streams = lazy_module("tannery.dataplane.grpc_streams")

# -- by blocking ------------------------------------------------------------------------------


def run(steps: Steps[Any]) -> Any:
    """The result of the core's ``steps``, each wait waited here."""
    driven = Driven(steps)
    for item in _drive(driven):
        raise TypeError(f"the steps of a call gave an item: {item!r}")
    return driven.value


def iterate(steps: Steps[Any]) -> Iterator[Any]:
    """The items of the core's ``steps`` (a Fetch's entries); leaving early ends them."""
    return _drive(Driven(steps))


def _drive(driven: Driven) -> Iterator[Any]:
    try:
        for step in driven:
            if not isinstance(step, Wait):
                yield step
                continue
            try:
                driven.answer(_BLOCKING[type(step)](step.fn, *step.args, **step.kwargs))
            except BaseException as error:
                driven.fail(error)
    finally:
        driven.close()


def _status(call: Any, timeout: float) -> tuple[Any, Any, Any] | None:
    deadline = time.monotonic() + timeout
    while not call.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return (call.code(), call.details(), call.trailing_metadata()) if call.done() else None


def _send(method: Any, messages: Iterable[bytes], options: dict[str, Any], target: str, off_loop: bool = False) -> Any:
    return grpc_streams.send(method, messages, options, target)


#: How each wait of :mod:`tannery.rpc.waits` is waited for: by blocking.
_BLOCKING: dict[type, Callable[..., Any]] = {
    Rpc: lambda fn, *args, **kwargs: fn(*args, **kwargs),
    Blocking: lambda fn, *args: fn(*args),
    Read: lambda call: next(call, END),
    Status: _status,
    Sleep: time.sleep,
    Acquire: lambda lock: lock.acquire(),
    Send: _send,
    Upload: lambda *args: grpc_streams.SyncUpload(*args),
}

# -- by awaiting ------------------------------------------------------------------------------


async def run_async(steps: Steps[Any]) -> Any:
    """The result of the core's ``steps``, each wait awaited here."""
    driven = Driven(steps)
    async for item in drive_async(driven):
        raise TypeError(f"the steps of a call gave an item: {item!r}")
    return driven.value


async def drive_async(driven: Driven) -> AsyncIterator[Any]:
    """The items of the core's steps (a Fetch's entries); leaving early (``aclose``) ends them."""
    try:
        for step in driven:
            if isinstance(step, Wait):
                try:
                    driven.answer(await _AWAITING[type(step)](step.fn, *step.args, **step.kwargs))
                except BaseException as error:
                    driven.fail(error)
            else:
                yield step
    finally:
        driven.close()


async def _read(call: Any) -> Any:
    message = await call.read()
    return END if message is grpc.aio.EOF else message


async def _status_async(call: Any, timeout: float) -> tuple[Any, Any, Any] | None:
    try:
        code = await (call.code() if call.done() else asyncio.wait_for(call.code(), timeout))
    except asyncio.TimeoutError:
        return None
    return code, await call.details(), await call.trailing_metadata()


async def _upload(*args: Any) -> Any:
    return grpc_streams.AioUpload(*args)


#: How each wait of :mod:`tannery.rpc.waits` is waited for: each gives an awaitable.
_AWAITING: dict[type, Callable[..., Any]] = {
    Rpc: lambda fn, *args, **kwargs: fn(*args, **kwargs),
    Blocking: asyncio.to_thread,
    Read: _read,
    Status: _status_async,
    Sleep: asyncio.sleep,
    Acquire: lambda lock: lock.acquire(),
    Send: lambda *args, **kwargs: grpc_streams.aio_send(*args, **kwargs),
    Upload: _upload,
}


__all__ = ["drive_async", "iterate", "run", "run_async"]
