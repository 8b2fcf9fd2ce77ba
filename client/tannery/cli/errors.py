"""How a failure reads on the command line: what happened on one line, and, when there is
something to do about it, what to do on a second (``hint: ...``); never a traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


#: The packages of the ``client`` extra, which a server-only install (the image) lacks.
CLIENT_EXTRA = ("torch", "safetensors", "rich")


class CommandError(Exception):
    """A failure the command explains itself (a bad file, a bad option value); ``hint`` says
    what to do about it, when there is something to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Where:
    """What a failure's remedy depends on: the server (and where its address came from:
    ``--target``, ``TANNERY_TARGET`` or the default) and whether TLS was asked for."""

    target: str
    target_from: str = "default"
    using_tls: bool = False
    command: str = ""


#: Pieces of gRPC's connection errors, and how the error line says them.
_REASONS = (
    ("Connection refused", "connection refused"),
    ("Domain name not found", "no such host"),
    ("DNS resolution failed", "the host name does not resolve"),
    ("WRONG_VERSION_NUMBER", "the TLS handshake failed"),
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate is not trusted"),
    ("Ssl handshake failed", "the TLS handshake failed"),
    ("Socket closed", "the server closed the connection"),
    ("Connection reset", "the connection was reset"),
    ("No route to host", "no route to host"),
    ("Network is unreachable", "the network is unreachable"),
    ("Deadline Exceeded", "timed out"),
    ("Timeout occurred", "timed out"),
    ("failed to connect to all addresses", "no connection"),
    ("Failed to parse", "a malformed address: HOST:PORT expected"),
)

#: What to do about a DATA_LOSS: the server refused bytes that no longer match their digest.
DATA_LOSS_REMEDY = ("the server's stored copy is damaged: run 'tannery scrub' on the server side to find the damaged "
                    "blobs and the archives using them, then push those archives again")


def error_message(exc: BaseException, target: str | None = None) -> str:
    """One line that says what failed: the server's message for its errors, the file for
    OS errors, the target and a short reason for a server that cannot be reached."""
    from tannery_protocol.errors import AlreadyExists, Unavailable

    if missing_extra(exc):
        return f"{exc.name} is not installed, and this command needs it"  # type: ignore[attr-defined]
    if isinstance(exc, Unavailable):
        message = str(exc).replace(f" (server {target})", "")
        reason = connection_failure(message)
        if reason is None:
            text = f"the server at {target} is unavailable: {message}" if target else message
        else:
            text = f"cannot reach the server at {target} ({reason})" if target else reason
    elif isinstance(exc, AlreadyExists):
        from tannery_protocol.errors import REPLACE_REMEDY

        text = str(exc).replace(f" ({REPLACE_REMEDY})", "")  # the command's remedy is a flag
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    elif isinstance(exc, (CommandError, ValueError, LookupError)) or _is_service_error(exc):
        text = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError) and exc.args:  # KeyError's str() quotes its argument
            text = str(exc.args[0])
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return one_line(text)


def connection_failure(message: str) -> str | None:
    """A short reason for gRPC's message of a connection that failed, or None when the message
    is not about reaching the server (a server that answered UNAVAILABLE itself)."""
    for piece, reason in _REASONS:
        if piece in message:
            return reason
    return None


def missing_extra(exc: BaseException) -> bool:
    """Whether ``exc`` is the import of a package of the client extra that is not installed."""
    return isinstance(exc, ModuleNotFoundError) and exc.name in CLIENT_EXTRA


def _is_service_error(exc: BaseException) -> bool:
    from tannery_protocol.errors import ServiceError

    return isinstance(exc, ServiceError)


def one_line(text: Any) -> str:
    """``text`` with its lines joined, so an error is one line."""
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def remedy(exc: BaseException, where: Where) -> str | None:
    """What to do about ``exc``, in one line, or None when there is nothing the user can do
    from the command line (the message says it all)."""
    from tannery_protocol.errors import AlreadyExists, DataLoss, NotFound, PermissionDenied, Unauthenticated, Unavailable

    if isinstance(exc, CommandError):
        return exc.hint
    if missing_extra(exc):
        return ('install the client extra: pip install ".[client]" in a clone of tannery, or the wheel make dist '
                'builds with [client] (README: "Install without make")')
    if isinstance(exc, Unauthenticated):
        return "give the server's token with --token TOKEN (or set TANNERY_TOKEN)"
    if isinstance(exc, PermissionDenied):
        return "use a token with the write role (--token TOKEN, or TANNERY_TOKEN)"
    if isinstance(exc, AlreadyExists):
        other = {"push": "another name with --as", "union": "another TARGET"}.get(where.command)
        return f"give --replace to replace it, or choose {other}" if other else None
    if isinstance(exc, NotFound) and str(exc).startswith("archive "):
        return "tannery ls lists the archives on the server"
    if isinstance(exc, DataLoss):
        return DATA_LOSS_REMEDY
    if isinstance(exc, Unavailable):
        return _unreachable_remedy(str(exc), where)
    return None


def _unreachable_remedy(text: str, where: Where) -> str | None:
    """The remedy for a server that cannot be reached: TLS flags when the handshake says so,
    otherwise where the address came from and how to start or name a server."""
    if text.startswith("transport '") and "is not available" in text:
        return "give --transport auto (or unset TANNERY_TRANSPORT) to take the path that reaches the server"
    if text.startswith("the data connection"):
        return "try again, or give --transport grpc to move the bytes over gRPC"
    if connection_failure(text) is None:
        return "try again in a moment; the server's log says why it is unavailable"
    if "Failed to parse" in text:
        return "give the server's address as HOST:PORT, e.g. --target localhost:50051 (or TANNERY_TARGET)"
    if not where.using_tls and "Socket closed" in text:
        return "if the server uses TLS, give --tls-ca CA.pem (or --tls for a publicly trusted certificate)"
    if where.using_tls and "Socket closed" in text:
        return "if the server asks for a client certificate, give --tls-cert CERT.pem and --tls-key KEY.pem"
    if where.using_tls and "WRONG_VERSION_NUMBER" in text:
        return "the server does not seem to use TLS: leave out --tls and the --tls-* options"
    source = {"--target": "given by --target", "TANNERY_TARGET": "from TANNERY_TARGET"}.get(where.target_from, "the default")
    return (f"is a server running at {where.target} ({source})? Start one with 'tannery serve', "
            "or give its address with --target HOST:PORT (or TANNERY_TARGET)")
