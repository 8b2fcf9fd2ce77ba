"""How a failure reads on the command line: one line on stderr, never a traceback."""

from __future__ import annotations

from typing import Any


#: The packages of the ``client`` extra, which a server-only install (the image) lacks.
CLIENT_EXTRA = ("torch", "safetensors", "rich")


class CommandError(Exception):
    """A failure the command explains itself (a bad file, a bad option value)."""


def error_message(exc: BaseException, target: str | None = None) -> str:
    """One line that says what failed: the server's message for its errors, the file for
    OS errors, the target for a server that cannot be reached."""
    from ..errors import Unavailable

    if missing_extra(exc):
        return (f"{exc.name} is not installed: the client commands need the client extra "  # type: ignore[attr-defined]
                '(pip install "tannery[client]")')
    if isinstance(exc, Unavailable):
        message = str(exc).replace(f" (server {target})", "")
        text = f"cannot reach the server at {target}: {message}" if target else message
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    elif isinstance(exc, (CommandError, ValueError, LookupError)) or _is_service_error(exc):
        text = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError) and exc.args:  # KeyError's str() quotes its argument
            text = str(exc.args[0])
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return one_line(text)


def missing_extra(exc: BaseException) -> bool:
    """Whether ``exc`` is the import of a package of the client extra that is not installed."""
    return isinstance(exc, ModuleNotFoundError) and exc.name in CLIENT_EXTRA


def _is_service_error(exc: BaseException) -> bool:
    from ..errors import ServiceError

    return isinstance(exc, ServiceError)


def one_line(text: Any) -> str:
    """``text`` with its lines joined, so an error is one line."""
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def hint(exc: BaseException, using_tls: bool) -> str:
    """A short suggestion for the failures whose remedy is a flag, or ""."""
    from ..errors import Unauthenticated, Unavailable

    if isinstance(exc, Unauthenticated):
        return " (give --token, or set TANNERY_TOKEN)"
    if isinstance(exc, Unavailable):
        text = str(exc)
        if not using_tls and "Socket closed" in text:
            return " (if the server uses TLS, give --tls-ca CA.pem or --tls)"
        if using_tls and "Socket closed" in text:
            return " (if the server asks for a client certificate, give --tls-cert and --tls-key)"
        if using_tls and "WRONG_VERSION_NUMBER" in text:
            return " (the server does not seem to use TLS: leave out --tls)"
    return ""
