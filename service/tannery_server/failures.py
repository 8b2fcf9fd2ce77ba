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


class Failure(Exception):
    """A call that cannot succeed; the message names the problem and is sent to the client."""

    code = grpc.StatusCode.UNKNOWN
    #: Value of the ``tannery-error`` trailing metadata, if any.
    kind: str | None = None


class Malformed(Failure):
    """A malformed request: a bad name, an unknown dtype, a broken stream of messages."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class BadPayload(Malformed):
    """The tannic codec refused a payload."""

    kind = "format"


class LimitExceeded(Failure):
    """A configured limit, or a full disk."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Missing(Failure):
    """An archive, an entry or a prefix that is not there."""

    code = grpc.StatusCode.NOT_FOUND


class NameTaken(Failure):
    """An archive name in use (and no ``replace``)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Mismatch(Failure):
    """An archive entry is not what the request asked for (the archive issue's messages)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    kind = "archive"


class AliasRefused(Failure):
    """A write aliases forbid: a compare-and-set Tag whose alias moved, an alias where an archive
    is needed (or the reverse), an aliased archive deleted without ``force``."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    kind = "alias"


class Cancelled(Failure):
    """The client cancelled the call, or its deadline passed, before it was done."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(Failure):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(Failure):
    """Storage that cannot answer now (an I/O error, a locked database): worth a retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Internal(Failure):
    """A bug: the server logged the traceback."""

    code = grpc.StatusCode.INTERNAL


class DataLoss(Failure):
    """A stored blob is missing or no longer matches its digest."""

    code = grpc.StatusCode.DATA_LOSS


def trailing_metadata(failure: Failure) -> tuple[tuple[str, str], ...]:
    return (("tannery-error", failure.kind),) if failure.kind else ()
