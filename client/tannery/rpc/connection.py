"""How a client reaches a server, shared by ``tannery.Client`` and ``tannery.aio.Client``.

:class:`Connection` resolves the settings (arguments first, then ``TANNERY_*`` variables),
builds the channel credentials and options, and carries the token as call metadata;
:func:`service_error` turns a failed call's status into the tannery exception of the
public API, with the server's message.

Environment: ``TANNERY_TARGET`` (default ``localhost:50051``), ``TANNERY_TOKEN``, and
``TANNERY_TLS_CA`` (the CA that signed the server's certificate), ``TANNERY_CLIENT_CERT``
and ``TANNERY_CLIENT_KEY`` (a client certificate for mutual TLS): paths; any of them, or
``TANNERY_TLS=1``, turns TLS on when ``tls`` is not given. The client's certificate has
names of its own because the server reads ``TANNERY_TLS_CERT``/``_KEY`` as *its* certificate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import grpc

from tannery_protocol import errors

DEFAULT_TARGET = "localhost:50051"
#: Bytes of payload per message sent (Store, Publish). 1 MiB, not the 2 MiB the server sends:
#: grpcio's cost per byte received grows with the message, and here the server receives.
DEFAULT_CHUNK_SIZE = 1 << 20
#: The most a message may carry and stay under gRPC's default 4 MiB limit.
MAX_CHUNK_SIZE = 3 << 20
#: Trailing metadata the server adds to say which kind of refusal a status is.
ERROR_KIND = "tannery-error"
#: How Store and Fetch may move their bytes (``transport=``; :mod:`tannery.dataplane.transports`).
TRANSPORTS = ("auto", "local", "tcp", "grpc")


def check_transport(transport: str | None, where: str = "transport") -> str:
    """The transport asked for (``TANNERY_TRANSPORT``, else auto); ValueError naming the choices."""
    chosen = transport or os.environ.get("TANNERY_TRANSPORT") or "auto"
    if chosen not in TRANSPORTS:
        raise ValueError(f"{where} {chosen!r} is not one of {', '.join(TRANSPORTS)} (TANNERY_TRANSPORT, "
                         "--transport or transport=)")
    return chosen


@dataclass(frozen=True)
class TLS:
    """TLS settings: the CA that signed the server's certificate (None: the system's roots),
    and a client certificate and key for mutual TLS. ``server_name`` overrides the name
    the server's certificate must carry (for a target given as an IP address)."""

    ca: str | os.PathLike[str] | None = None
    cert: str | os.PathLike[str] | None = None
    key: str | os.PathLike[str] | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: a client certificate needs its key, and a key its certificate (cert= and key=)")

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials; OSError naming the file that cannot be read."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "ca"), private_key=_read(self.key, "key"),
            certificate_chain=_read(self.cert, "cert"),
        )

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "TLS | None":
        """TLS from ``TANNERY_TLS_CA``, ``TANNERY_CLIENT_CERT`` and ``TANNERY_CLIENT_KEY`` (or
        ``TANNERY_TLS=1`` for the system's roots), None when none is set."""
        values = {field: env.get(name) or None for field, name in ENV_TLS.items()}
        if any(values.values()) or env.get("TANNERY_TLS", "").lower() in ("1", "true", "yes", "on"):
            return TLS(**values)
        return None


TLSLike = Union[TLS, bool, None]
#: The client's TLS settings by ``TLS`` field.
ENV_TLS = {"ca": "TANNERY_TLS_CA", "cert": "TANNERY_CLIENT_CERT", "key": "TANNERY_CLIENT_KEY"}


def _read(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(e.errno, f"TLS {what} file {str(path)!r}: {e.strerror}") from None


class Connection:
    """Resolved settings of a client: target, credentials, metadata, chunk size, timeout."""

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        tls: TLSLike = None,
        chunk_size: int | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.target = target or env.get("TANNERY_TARGET") or DEFAULT_TARGET
        token = token if token is not None else env.get("TANNERY_TOKEN") or None
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        if tls is None:
            tls = TLS.from_env(env)
        elif tls is True:
            tls = TLS()
        elif tls is not False and not isinstance(tls, TLS):
            raise TypeError(f"tls is None, a bool or a tannery.TLS, not {type(tls).__name__}")
        self.tls: TLS | None = tls or None
        self.chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
        if not 1 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size {self.chunk_size} is not in 1..{MAX_CHUNK_SIZE} bytes")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout {timeout} must be positive (or None for no limit)")
        self.timeout = timeout

    def options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            # Fetch messages carry up to the server's chunk size (at most 3 MiB) plus framing.
            ("grpc.max_receive_message_length", 8 << 20),
        ]
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        if self.target.startswith("dns:"):
            # Every address the name resolves to (the replicas of a scaled-out store), calls
            # spread over them in turn; gRPC's default would pick the first and stay there.
            options.append(("grpc.lb_policy_name", "round_robin"))
        return options

    def channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.target, options=self.options())
        return grpc.secure_channel(self.target, self.tls.credentials(), options=self.options())

    def aio_channel(self) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(self.target, options=self.options())
        return grpc.aio.secure_channel(self.target, self.tls.credentials(), options=self.options())

    def __repr__(self) -> str:
        tls = "insecure" if self.tls is None else "tls"
        return f"{self.target!r}, {tls}{', token' if self.metadata else ''}"


class Calls:
    """A client's calls: the RPC table on its channel (:class:`tannery.rpc.requests.Methods`, sync
    or aio) and the options each call is made with. What the call core and the transports use."""

    def __init__(self, connection: Connection, methods: Any) -> None:
        self.connection = connection
        self.methods = methods

    @property
    def target(self) -> str:
        return self.connection.target

    def options(self, *, timeout: bool = True, metadata: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        """A call's token (and ``metadata``), and the client's timeout unless ``timeout`` is False."""
        return {"metadata": (*self.connection.metadata, *metadata),
                "timeout": self.connection.timeout if timeout else None}


_ERRORS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.ArchiveError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
}


def service_error(
    code: grpc.StatusCode | None, details: str | None, trailing: Sequence[tuple[str, object]] | None, target: str
) -> Exception:
    """The tannery exception for a call that ended with ``code``, carrying the server's message.

    INVALID_ARGUMENT with ``tannery-error: format`` is a :class:`~tannery_protocol.errors.FormatError`;
    FAILED_PRECONDITION an :class:`~tannery_protocol.errors.ArchiveError` (with ``tannery-error: alias``,
    an :class:`~tannery_protocol.errors.AliasError`); a status with no class of
    its own (DEADLINE_EXCEEDED, INTERNAL, ...) a :class:`~tannery_protocol.errors.ServiceError`
    whose message starts with the status. Each carries ``.code``, the status's name.
    """
    code = code or grpc.StatusCode.UNKNOWN
    message = details or code.name.lower().replace("_", " ")
    kind = next((value for key, value in trailing or () if key == ERROR_KIND), None)
    if code is grpc.StatusCode.INVALID_ARGUMENT and kind == "format":
        error: Exception = errors.FormatError(message)
    elif code is grpc.StatusCode.FAILED_PRECONDITION and kind == "alias":
        error = errors.AliasError(message)
    elif code in _ERRORS:
        if code is grpc.StatusCode.UNAVAILABLE:
            message = f"{message} (server {target})"
        elif code is grpc.StatusCode.ALREADY_EXISTS:
            message = f"{message} ({errors.REPLACE_REMEDY})"
        error = _ERRORS[code](message)
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        error = errors.ServiceError(f"DEADLINE_EXCEEDED: {message} (the client's timeout)")
    else:
        error = errors.ServiceError(f"{code.name}: {message}")
    error.code = code.name  # type: ignore[attr-defined]
    return error


def received(error: grpc.RpcError) -> bool:
    """Whether a failed call had reached the server: its initial metadata, which a Delete sends
    before it deletes anything, came (``tannery-received``)."""
    from tannery_protocol.wire import RECEIVED_KEY  # on a failure only: a call that succeeds needs none

    try:
        metadata = error.initial_metadata() if callable(getattr(error, "initial_metadata", None)) else None
    except Exception:  # noqa: BLE001: an error without it reached nothing we saw
        return False
    return any(key == RECEIVED_KEY for key, _value in metadata or ())


def rpc_error(error: grpc.RpcError, target: str) -> Exception:
    """:func:`service_error` for a failed call's ``grpc.RpcError`` (sync, or aio's ``AioRpcError``)."""
    if not callable(getattr(error, "code", None)):
        return service_error(grpc.StatusCode.UNKNOWN, str(error), (), target)
    return service_error(error.code(), error.details(), error.trailing_metadata(), target)


__all__ = ["Calls", "Connection", "DEFAULT_CHUNK_SIZE", "DEFAULT_TARGET", "TLS", "TLSLike", "received", "rpc_error",
           "service_error"]
