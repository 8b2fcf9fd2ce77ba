"""The exceptions of tannery's public API.

Local failures raise :class:`FormatError` (bad tannic data) and :class:`ArchiveError`
(an archive that does not hold what is asked of it), both ValueErrors. The client
raises the same two for the server's answers of the same kind, and one of the
:class:`ServiceError` subclasses for the rest, so no raw ``grpc.RpcError`` escapes.
"""

from __future__ import annotations


class FormatError(ValueError):
    """A payload or a file that is not valid tannic data (raised by :mod:`.codec` and what reads
    through it; defined here so that naming the errors imports no codec)."""


class ArchiveError(ValueError):
    """An archive does not hold what is asked of it; the message names the entry."""


class ServiceError(Exception):
    """A failure the tannery service reported; the message is the server's."""


class NotFound(ServiceError, LookupError):
    """No archive or entry of that name."""


class AlreadyExists(ServiceError):
    """An archive of that name exists and replacing it was not asked; the message says how
    to (:data:`REPLACE_REMEDY`)."""


#: What an AlreadyExists message adds, in parentheses, to the server's: the keyword that replaces.
REPLACE_REMEDY = "give replace=True to replace it"


class AliasError(ServiceError):
    """A write aliases forbid (FAILED_PRECONDITION, ``tannery-error: alias``): a tag with ``expect``
    whose alias points elsewhere now (the message names its current target), an alias where an
    archive is needed or the reverse, a delete of an archive an alias points at (without ``force``)."""


class InvalidArgument(ServiceError, ValueError):
    """A request the server refuses as malformed (a bad name, a limit exceeded)."""


class ResourceExhausted(ServiceError):
    """The server is out of room (disk full) or a limit was reached."""


class PermissionDenied(ServiceError):
    """The token is valid but its role does not allow the call."""


class Unauthenticated(ServiceError):
    """No token, or a wrong one, on a server that requires tokens."""


class Unavailable(ServiceError):
    """The server cannot be reached, or is shutting down."""


class DataLoss(ServiceError):
    """A stored blob no longer matches its digest; the server refused to serve it."""


class Cancelled(ServiceError):
    """The call was cancelled, or a channel subscriber was dropped."""


__all__ = [
    "REPLACE_REMEDY",
    "AliasError",
    "AlreadyExists",
    "ArchiveError",
    "Cancelled",
    "DataLoss",
    "FormatError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServiceError",
    "Unauthenticated",
    "Unavailable",
]
