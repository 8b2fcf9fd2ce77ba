"""A watched alias, whichever client holds it: the Watch call read to its end, the latest
target kept.

:meth:`Watched.pump` reads the call (on a thread of its own in ``tannery.Client``, a task in
``tannery.aio.Client``) and keeps only the newest target not yet taken, so a caller that
takes them slowly gets the latest, never a backlog. A call cut off by UNAVAILABLE (a server
restarting, a replica gone) is opened again as :mod:`tannery.rpc.retries` says; its first answer,
the alias's target then, is handed on only when it differs from the last one seen.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import grpc

from tannery_protocol.v1 import archives_pb2
from tannery.rpc.connection import Calls, rpc_error
from tannery.records import Alias, _time
from tannery.rpc.retries import RetryPolicy
from tannery.rpc.waits import END, Read, Sleep, Steps


class Watched:
    """The moves of ``alias`` as a Watch call brings them; ``notify()`` is called (from the
    pump) whenever :meth:`take` may have something new."""

    def __init__(self, calls: Calls, alias: str, policy: RetryPolicy, notify: Callable[[], None]) -> None:
        self.alias = alias
        self.closed = False
        #: Set once the pump is over (closed, failed or ended by the server).
        self.over = False
        self._calls, self._policy, self._notify = calls, policy, notify
        self._call: Any = None
        self._latest: Alias | None = None  # not taken yet
        self._seen: str | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the pump and the taker may be two threads

    def pump(self) -> Steps[None]:
        """Read the call until it is closed or fails; reopen it after an UNAVAILABLE."""
        retry = 0
        request = archives_pb2.WatchRequest(alias=self.alias)
        try:
            while not self.closed:
                self._call = self._calls.methods.watch(request, **self._calls.options(timeout=False))
                if self.closed:  # closed while it opened
                    self._call.cancel()
                    return
                try:
                    while (message := (yield Read(self._call))) is not END:
                        retry = 0
                        self._arrived(message)
                    return  # the server never ends a watch OK; an old one might: over
                except grpc.RpcError as error:
                    if self.closed:
                        return
                    failure = rpc_error(error, self._calls.target)
                try:
                    pause = self._policy.next_delay(retry, f"Watch of {self.alias!r}", failure)
                except BaseException as given_up:
                    self._error = given_up
                    return
                retry += 1
                yield Sleep(pause)
        finally:
            self.over = True
            self._notify()

    def _arrived(self, message: archives_pb2.WatchResponse) -> None:
        self._policy.contact.reached = True
        if message.archive == self._seen:  # a reopened call's first answer: nothing moved
            return
        self._seen = message.archive
        with self._lock:
            self._latest = Alias(self.alias, message.archive, _time(message.moved))
        self._notify()

    def take(self) -> Alias | object | None:
        """The newest target not taken yet; :data:`~tannery.rpc.waits.END` when the watch is over
        (its error raised, if it failed); None when there is nothing new yet."""
        with self._lock:
            latest, self._latest = self._latest, None
        if latest is not None and not self.closed:
            return latest
        if self.closed or self.over:
            if self._error is not None and not self.closed:
                error, self._error = self._error, None
                raise error
            return END
        return None

    def close(self) -> None:
        """End the watch: the call is cancelled (the server stops reading the alias for it)."""
        self.closed = True
        if self._call is not None:
            self._call.cancel()


__all__ = ["Watched"]
