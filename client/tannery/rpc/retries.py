"""Retrying what is safe to retry, shared by ``tannery.Client`` and ``tannery.aio.Client``.

A call that ends UNAVAILABLE (the server could not be reached, restarted, or the connection
broke mid-call, on gRPC or on a data path) is tried again after a bounded, jittered pause,
up to ``retries`` times (``retries=``, else ``TANNERY_RETRIES``, else 5; 0 turns retrying
off). Every retry is logged at INFO on the ``tannery.client`` logger. What is retried:

- every read (Describe, List, DataPaths) and Union, whose repeat has the same effect (a
  Union that already happened answers OK, as an identical Store does);
- Store, sent again from its start: the server stores nothing of a call that did not
  finish, and answers an identical Store of an archive that is already there with OK;
- Delete: an archive already gone when a retry arrives was deleted by the attempt whose
  answer was lost, so that retry reports it deleted (``Deleted.already_gone``), but only when
  that attempt was seen to reach the server (the Delete's initial metadata ``tannery-received``,
  sent before anything is deleted, had come); else the retry's NotFound stands;
- Resolve and ListAliases as reads; Tag as it is (a Tag whose lost attempt moved the alias
  finds it there and answers OK, ``expect`` or not); Untag as Delete (``Untagged.already_gone``);
- Watch, reopened: its first answer (the alias's target then) is handed on only when it
  differs from the last one seen (:mod:`tannery.calls.watches`);
- Fetch, resumed after the entries already received whole (:func:`resumed_request`): no
  entry is fetched twice into the result; the one cut off midway comes again whole. The rest
  is asked of the version of the archive the first attempt read: if it was replaced
  meanwhile, the Fetch fails (ArchiveError: fetch again), never mixing two versions.

gRPC's own retry policy (a service config) is not used: it cannot replay a Store larger than
its buffer, nor resume a Fetch, nor log. What to do is decided here; the one loop that
does it is the call core's (:mod:`tannery.calls.core`), which both clients drive.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tannery_protocol import errors
from tannery_protocol.names import owned
from tannery_protocol.v1 import archives_pb2

log = logging.getLogger("tannery.client")

#: Retries after the first attempt unless ``retries=`` or ``TANNERY_RETRIES`` say otherwise.
DEFAULT_RETRIES = 5
ENV = "TANNERY_RETRIES"


def _uniform(low: float, high: float) -> float:
    import random  # not at import: a command that is never retried needs none

    return random.uniform(low, high)


class Contact:
    """Whether the server has answered a client yet: the client sets ``reached`` on its first answer."""

    def __init__(self) -> None:
        self.reached = False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call that ended UNAVAILABLE is tried again.

    The pause before retry ``n`` (from 0) is ``min(max_delay, first_delay * 2**n)`` times a
    random factor in [0.5, 1): the default 5 retries wait 6 to 12.5 s in all, which covers a
    server or replica restarting, and clients that failed together do not retry together.

    ``until_reached`` retries only once the server has answered the client (``contact``): a
    server never reached is an error at once. The command line asks for it at a terminal, where
    waiting for a server that was never started only delays the answer; a script riding out a
    restart keeps every retry. A policy with it belongs to one client (its ``contact``).
    """

    retries: int = DEFAULT_RETRIES
    first_delay: float = 0.5
    max_delay: float = 5.0
    until_reached: bool = False
    contact: Contact = field(default_factory=Contact, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries {self.retries} must be 0 (no retries) or more")

    @staticmethod
    def resolve(retries: "int | RetryPolicy | None", env: Mapping[str, str] | None = None) -> "RetryPolicy":
        """The policy of ``retries=`` if given, else of ``TANNERY_RETRIES``, else the default;
        ValueError naming the setting that is not a whole number of 0 or more. A policy given
        is taken as it is."""
        if isinstance(retries, RetryPolicy):
            return retries
        if retries is not None:
            if isinstance(retries, bool) or not isinstance(retries, int):
                raise TypeError(f"retries is an int (0 for none), not {type(retries).__name__}")
            return RetryPolicy(retries)
        raw = (os.environ if env is None else env).get(ENV, "").strip()
        if not raw:
            return RetryPolicy()
        try:
            count = int(raw)
        except ValueError:
            count = -1
        if count < 0:
            raise ValueError(f"{ENV}={raw!r} is not a number of retries: give 0 (no retries) or more")
        return RetryPolicy(count)

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first)."""
        return min(self.max_delay, self.first_delay * 2 ** retry) * _uniform(0.5, 1.0)

    def next_delay(self, retry: int, what: str, error: BaseException) -> float:
        """The pause before retry ``retry`` of ``what`` after ``error``, logged; ``error``
        itself (re-raised by the caller) when it is not to be retried or no retry is left."""
        if not retryable(error) or retry >= self.retries or (self.until_reached and not self.contact.reached):
            if retry and retryable(error):
                _note_gave_up(error, retry)
            raise error
        pause = self.delay(retry)
        log.info("%s: %s; retry %d of %d in %.2f s", what, error, retry + 1, self.retries, pause,
                 extra={"call": what, "error": error, "retry": retry + 1, "retries": self.retries, "pause": pause})
        return pause


def retryable(error: BaseException) -> bool:
    """Whether a call that raised ``error`` may be tried again: the server was unreachable or
    the connection broke (UNAVAILABLE, on gRPC or on a data path)."""
    return isinstance(error, errors.Unavailable) and getattr(error, "retryable", True)


def _note_gave_up(error: BaseException, retries: int) -> None:
    """Add to the message of the error that ends the retries how many were made."""
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} (gave up after {retries} {'retry' if retries == 1 else 'retries'})",
                      *error.args[1:])


def call_name(request: object) -> str:
    """How a retry's log line names a unary call: its RPC, and the archive it is about."""
    rpc = type(request).__name__.removesuffix("Request")
    archive = getattr(request, "archive", None) or getattr(request, "target", None)
    return f"{rpc} of {archive!r}" if archive else rpc


def resumed_request(request: archives_pb2.FetchRequest, done: Sequence[str],
                    listed: Sequence[str] | None, version: str = "") -> archives_pb2.FetchRequest | None:
    """The Fetch that gets the rest of ``request`` once the entries ``done`` came whole; None
    when nothing is left. It is pinned to ``version`` of the archive, the one the first
    attempt read (its initial metadata): the server refuses it (FAILED_PRECONDITION, "fetch
    again") if the archive was replaced meanwhile, so an answer never mixes two versions. A
    server from before versions names none: the rest is then asked by name alone.

    A request by name keeps its asks (shape, dtype, cast, rows) but those done, in order, and
    its ``batched_entries``. A
    request by prefix becomes one by name: the entries it owns among ``listed`` (the
    archive's names, from a Describe) but those done, in name order as the server sends them.
    """
    finished = set(done)
    if request.entries:
        rest = [ask for ask in request.entries if ask.name not in finished]
    else:
        assert listed is not None, "a Fetch by prefix resumes from the archive's names"
        rest = [archives_pb2.EntryAsk(name=name) for name in sorted(owned(request.prefix, listed))
                if name not in finished]
    if not rest:
        return None
    return archives_pb2.FetchRequest(archive=request.archive, entries=rest, batched_entries=request.batched_entries,
                                     version=version or request.version)


__all__ = ["DEFAULT_RETRIES", "ENV", "Contact", "RetryPolicy", "call_name", "resumed_request", "retryable"]
