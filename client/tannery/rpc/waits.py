"""What the call core asks its client to wait for: the one difference between the two clients.

Every call is written once (:mod:`tannery.calls.core`, :mod:`tannery.dataplane.transports`) as a generator of
*steps*. A step that is a :class:`Wait` names something to wait for, and the generator is sent
its value (or thrown its exception); any other step is an item for the caller (an entry of
``fetch_iter``). ``tannery.Client`` waits for each by blocking, ``tannery.aio.Client`` by
awaiting (:mod:`tannery.client`, :mod:`tannery.aio`); what to do, and what the outcome means,
is never decided there.

The waits:

- :class:`Sleep`: a pause (before a retry);
- :class:`Blocking`: a function that blocks (sockets, mapping files): called, or run on a
  worker thread;
- :class:`Rpc`: a gRPC step that gives its value in the sync API and an awaitable in
  asyncio's (a unary call, ``initial_metadata``, a streaming upload's answer);
- :class:`Read`: a server-streaming call's next message, :data:`END` after its last;
- :class:`Status`: a call's ``(code, details, trailing metadata)`` once it has ended, or
  None when it has not within ``timeout`` seconds;
- :class:`Acquire`: a lock of the client's (released without waiting);
- :class:`Send`: a client-streaming call (Store or Publish on gRPC) of ``messages``: its answer;
- :class:`Upload`: a client-streaming call opened with one message, whose payloads go on a
  data connection: an :class:`Uploading` (the call, its last message, its answer).
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Protocol, TypeVar, Union

T = TypeVar("T")

#: What :class:`Read` gives after a stream's last message.
END = object()


class Wait:
    """Something the core waits for; the client waits its own way and sends back the value."""

    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn: Any = None, *args: Any, **kwargs: Any) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs


class Sleep(Wait):
    """``Sleep(seconds)``."""


class Blocking(Wait):
    """``Blocking(fn, *args)``: ``fn(*args)``, which blocks."""


class Rpc(Wait):
    """``Rpc(fn, *args, **kwargs)``: a gRPC step, ``fn(*args, **kwargs)`` (awaited in asyncio)."""


class Read(Wait):
    """``Read(call)``: the call's next message, or :data:`END`."""


class Status(Wait):
    """``Status(call, timeout)``: ``(code, details, trailing metadata)`` of the ended call, or None."""


class Acquire(Wait):
    """``Acquire(lock)``: the lock, held (the core releases it)."""


class Send(Wait):
    """``Send(method, messages, options, off_loop=False)``: the answer of a client-streaming
    call (tannery exceptions for its failure); ``off_loop``: each message is made on a
    worker thread in asyncio (making one may wait for a digest)."""


class Upload(Wait):
    """``Upload(method, first, last, options)``: a client-streaming call opened with message
    ``first``; ``last(sent)`` is its final one once :meth:`Uploading.finish` is told what was
    sent. The value is an :class:`Uploading`."""


class Uploading(Protocol):
    """A call that :class:`Upload` opened."""

    call: Any

    def initial_metadata(self) -> Any: ...  # an Rpc step
    def result(self) -> Any: ...  # an Rpc step: the answer
    def finish(self, sent: Any) -> None: ...  # the last message (None: none), then the end of the stream
    def cancel(self) -> None: ...
    def error(self, error: BaseException) -> Exception: ...  # the tannery exception of the call's failure
    def close(self) -> None: ...  # what outlives the call (gRPC's sending thread) is done


#: The steps of a call: waits (and items of a stream) out, values in, its result at the end.
Steps = Generator[Union[Wait, Any], Any, T]


class Driven:
    """A generator of steps being driven: iterating gives its steps (waits, and items of a
    stream) until it is over, its result then in :attr:`value`; :meth:`answer` or :meth:`fail`
    says what came of a wait."""

    def __init__(self, steps: Steps[Any]) -> None:
        self._steps = steps
        self._send: Callable[[Any], Any] = steps.send
        self._value: Any = None
        self.value: Any = None

    def __iter__(self) -> "Driven":
        return self

    def __next__(self) -> Any:
        try:
            step = self._send(self._value)
        except StopIteration as done:
            self.value = done.value
            raise StopIteration from None
        self._send, self._value = self._steps.send, None
        return step

    def answer(self, value: Any) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._send, self._value = self._steps.throw, error

    def close(self) -> None:
        """End the steps where they stand (their ``finally`` blocks run): the caller left early."""
        self._steps.close()


__all__ = ["Acquire", "Blocking", "Driven", "END", "Read", "Rpc", "Send", "Sleep", "Status", "Steps",
           "Upload", "Uploading", "Wait"]
