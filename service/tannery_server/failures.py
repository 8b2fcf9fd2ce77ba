"""The failures a call can end with, each tied to the gRPC status it is answered with.

Validation and the servicers raise these; the storage's own errors and refusals
(:mod:`.storage.errors`, plain exceptions) become these in :mod:`.storage_failures`. The
servicers turn them into statuses (with the ``tannery-error`` trailing metadata the protocol
defines) in one place. Their names are the
server's own (``Missing``, ``Malformed``, ``NameTaken``), distinct from the client's
exceptions (``tannery.NotFound``, ``tannery.InvalidArgument``, ``tannery.AlreadyExists``).
"""

from __future__ import annotations

import grpc

Code = grpc.StatusCode


class Failure(Exception):
    """A call that cannot succeed; the message names the problem and is sent to the client.

    A kind of failure names its status and, where the protocol gives one, the value of the
    ``tannery-error`` trailing metadata in its class line: ``class Missing(Failure, code=...)``."""

    code = Code.UNKNOWN
    #: Value of the ``tannery-error`` trailing metadata, if any.
    kind: str | None = None

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, kind: str | None = None, **rest: object) -> None:
        super().__init_subclass__(**rest)
        cls.code = code or cls.code
        cls.kind = kind or cls.kind


class Malformed(Failure, code=Code.INVALID_ARGUMENT):
    """A malformed request: a bad name, an unknown dtype, a broken stream of messages."""


class BadPayload(Malformed, kind="format"):
    """The tannic codec refused a payload."""


class LimitExceeded(Failure, code=Code.RESOURCE_EXHAUSTED):
    """A configured limit, or a full disk."""


class Missing(Failure, code=Code.NOT_FOUND):
    """An archive, an entry or a prefix that is not there."""


class NameTaken(Failure, code=Code.ALREADY_EXISTS):
    """An archive name in use (and no ``replace``)."""


class Mismatch(Failure, code=Code.FAILED_PRECONDITION, kind="archive"):
    """An archive entry is not what the request asked for (the archive issue's messages)."""


class Replaced(Failure, code=Code.FAILED_PRECONDITION, kind="replaced"):
    """A resumed Fetch's archive was replaced since the Fetch began: the rest is not sent (it
    would mix two versions); the remedy is to fetch again."""


class AliasRefused(Failure, code=Code.FAILED_PRECONDITION, kind="alias"):
    """A write aliases forbid: a compare-and-set Tag whose alias moved, an alias where an archive
    is needed (or the reverse), an aliased archive deleted without ``force``."""


class Cancelled(Failure, code=Code.CANCELLED):
    """The client cancelled the call, or its deadline passed, before it was done."""


class DeadlineExceeded(Failure, code=Code.DEADLINE_EXCEEDED):
    """The call's deadline passed."""


class Unavailable(Failure, code=Code.UNAVAILABLE):
    """Storage that cannot answer now (an I/O error, a locked database): worth a retry."""


class Unimplemented(Failure, code=Code.UNIMPLEMENTED):
    """A call this server does not serve as configured (its relays are off)."""


class Internal(Failure, code=Code.INTERNAL):
    """A bug: the server logged the traceback."""


class DataLoss(Failure, code=Code.DATA_LOSS):
    """A stored blob is missing or no longer matches its digest."""


def trailing_metadata(failure: Failure) -> tuple[tuple[str, str], ...]:
    return (("tannery-error", failure.kind),) if failure.kind else ()
