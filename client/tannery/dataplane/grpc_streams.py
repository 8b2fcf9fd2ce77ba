"""Client-streaming calls (Store, Publish) on gRPC, sync and asyncio: every workaround in one place.

The call core (:mod:`tannery.calls.core`) asks for a client-streaming call with a
:class:`~tannery.rpc.waits.Send` (its messages on the gRPC stream) or an
:class:`~tannery.rpc.waits.Upload` (one message, the payloads on a data connection); the two
clients make it here, and here alone gRPC's quirks are worked around:

- **The sending thread.** The sync API consumes a request iterator on a thread of its own,
  which outlives the call briefly (after a refused call, up to 0.1 s); a program that exits
  meanwhile aborts inside gRPC's C++ code ("terminate called without an active exception").
  Policy: after every client-streaming call of ``tannery.Client``, whatever its outcome, the
  thread that took *this* call's messages is joined (at most :data:`JOIN_SECONDS`); other
  threads' calls are theirs to wait for.
- **The swallowed exception.** That thread swallows an exception raised while making a
  message (the call ends CANCELLED): :class:`_Guarded` keeps it, and the caller sees it.
- **The overwritten status** (grpc/grpc#36066). grpc.aio replaces a call's status with
  INTERNAL ("Failed execute_batch") when the server ends a client-streaming call while the
  client is still writing: :class:`_FinalStatus` keeps the status the call first ended
  with, and a write that fails because the call is over only stops the writing.
- **The event loop.** A message that may wait (for its entry's digest) is made on a worker
  thread (:func:`_made_in_thread`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Coroutine

import grpc

from tannery.rpc.connection import rpc_error, service_error

#: Seconds to wait for gRPC's thread that sent a call's messages to end.
JOIN_SECONDS = 2.0


# -- sync -------------------------------------------------------------------------------------


class _Guarded:
    """An iterator of messages that remembers the thread that takes them and the exception it
    raised: gRPC's sending thread swallows it (the call ends CANCELLED), the caller should see it."""

    def __init__(self, messages: Iterator[bytes]) -> None:
        self._messages = messages
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def __iter__(self) -> "_Guarded":
        return self

    def __next__(self) -> bytes:
        self.thread = threading.current_thread()
        try:
            return next(self._messages)
        except StopIteration:
            raise
        except BaseException as error:
            self.error = error
            raise

    def join(self) -> None:
        """Wait (bounded) for the thread that took the messages to end."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(JOIN_SECONDS)


def send(method: Any, messages: Iterable[bytes], options: dict[str, Any], target: str) -> Any:
    """A client-streaming call of ``messages``: its answer, or the tannery exception of its
    failure (the exception that stopped the messages first)."""
    sent = _Guarded(iter(messages))
    try:
        return method(sent, **options)
    except grpc.RpcError as error:
        sent.join()
        if sent.error is not None:
            raise sent.error from None
        raise rpc_error(error, target) from None
    finally:
        sent.join()


class _Upload:
    """A client-streaming call opened with ``first``, its payloads sent elsewhere
    (:class:`~tannery.rpc.waits.Upload`): ``last(sent)`` ends its messages once :meth:`finish`
    is told what was sent (nothing after a failed transfer)."""

    call: Any

    def __init__(self, first: bytes, last: Callable[[Any], bytes] | None, target: str, finished: Any) -> None:
        self._first, self._last, self._target = first, last, target
        self._sent: Any = None
        self._finished = finished

    def _closing(self) -> list[bytes]:
        return [self._last(self._sent)] if self._sent is not None and self._last is not None else []

    def initial_metadata(self) -> Any:
        return self.call.initial_metadata()

    def finish(self, sent: Any) -> None:
        self._sent = sent
        self._finished.set()

    def cancel(self) -> None:
        self.call.cancel()


class SyncUpload(_Upload):
    """An upload in the sync API: its messages taken by gRPC's thread, which :meth:`close` joins."""

    def __init__(self, method: Any, first: bytes, last: Callable[[Any], bytes] | None, options: dict[str, Any],
                 target: str) -> None:
        super().__init__(first, last, target, threading.Event())
        self._messages = _Guarded(self._stream())
        self.call = method.future(self._messages, **options)

    def _stream(self) -> Iterator[bytes]:
        yield self._first
        self._finished.wait()
        yield from self._closing()

    def result(self) -> Any:
        return self.call.result()

    def error(self, error: BaseException) -> Exception:
        return rpc_error(error, self._target)

    def close(self) -> None:
        self._messages.join()


# -- asyncio ----------------------------------------------------------------------------------


def _result_now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that completes without waiting (a finished call's status)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the call's status is not there yet")


class _FinalStatus:
    """The status a call ended with, taken the moment it ended (grpc/grpc#36066: grpc.aio
    overwrites it with INTERNAL when a write fails after the server ended the call)."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self.status: tuple[grpc.StatusCode, str, Any] | None = None
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.aio.Call) -> None:
        try:
            self.status = (_result_now(call.code()), _result_now(call.details()), _result_now(call.trailing_metadata()))
        except RuntimeError:
            self.status = None

    def error(self, error: BaseException, target: str) -> Exception:
        if self.status is not None and self.status[0] is not grpc.StatusCode.INTERNAL:
            return service_error(*self.status, target)
        return rpc_error(error, target)


async def aio_send(method: Any, messages: Iterable[bytes] | AsyncIterable[bytes], options: dict[str, Any],
                   target: str, off_loop: bool = False) -> Any:
    """:func:`send` in asyncio: write ``messages``, then the server's answer or its status."""
    if off_loop and not isinstance(messages, AsyncIterable):
        messages = _made_in_thread(iter(messages))
    call = method(**options)
    final = _FinalStatus(call)
    try:
        ended = await _write_all(call, messages)
    except BaseException:
        call.cancel()  # the messages failed (or we were cancelled): the call ends, the error stands
        raise
    try:
        if not ended:
            await call.done_writing()
        return await call
    except grpc.aio.AioRpcError as error:
        raise final.error(error, target) from None
    except asyncio.InvalidStateError:  # done_writing on a call that just ended
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise final.error(error, target) from None


class AioUpload(_Upload):
    """An upload in asyncio, its status kept as it ended (:class:`_FinalStatus`)."""

    def __init__(self, method: Any, first: bytes, last: Callable[[Any], bytes] | None, options: dict[str, Any],
                 target: str) -> None:
        super().__init__(first, last, target, asyncio.Event())
        self.call = method(self._stream(), **options)
        self._final = _FinalStatus(self.call)

    async def _stream(self) -> AsyncIterator[bytes]:
        yield self._first
        await self._finished.wait()
        for message in self._closing():
            yield message

    async def result(self) -> Any:
        return await self.call

    def error(self, error: BaseException) -> Exception:
        return self._final.error(error, self._target)

    def close(self) -> None:
        pass


async def each(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    """The items of an iterable or an async iterable."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _made_in_thread(messages: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``messages``, each made on a worker thread (one at a time), the generator closed there too."""
    try:
        while (message := await asyncio.to_thread(next, messages, None)) is not None:
            yield message
    finally:
        try:
            await asyncio.to_thread(messages.close)
        except ValueError:
            pass  # cancelled while the worker still makes a message: it ends that one, then it is dropped


async def _write_all(call: Any, messages: Iterable[bytes] | AsyncIterable[bytes]) -> bool:
    """Write every message; True if the call ended first (its status says why)."""
    async for message in each(messages):
        try:
            await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return True
    return False


__all__ = ["AioUpload", "JOIN_SECONDS", "SyncUpload", "aio_send", "each", "send"]
