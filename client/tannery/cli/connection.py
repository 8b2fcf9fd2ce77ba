"""The global options every client subcommand takes (server, token, TLS, --quiet) and the
client they make. Each option falls back to its ``TANNERY_*`` environment variable."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .errors import CommandError

DEFAULT_TARGET = "localhost:50051"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def add_global_options(parser: argparse.ArgumentParser, *, on_subcommand: bool) -> None:
    """The options of every client subcommand. They are accepted before the subcommand
    (``tannery --target h:1 ls``) and after it (``tannery ls --target h:1``); on subcommands
    their defaults are suppressed, so one given before is not reset after."""
    default: Any = argparse.SUPPRESS if on_subcommand else None
    group = parser.add_argument_group("server options")
    group.add_argument("--target", metavar="HOST:PORT", default=default,
                       help=f"the server [env TANNERY_TARGET; default {DEFAULT_TARGET}]")
    group.add_argument("--token", metavar="TOKEN", default=default,
                       help="bearer token sent with every call [env TANNERY_TOKEN]")
    group.add_argument("--tls", action="store_true", default=default,
                       help="connect with TLS (system roots unless --tls-ca) [env TANNERY_TLS=1]")
    group.add_argument("--tls-ca", metavar="PEM", default=default,
                       help="CA certificates that sign the server's, a PEM file; implies --tls [env TANNERY_TLS_CA]")
    group.add_argument("--tls-cert", metavar="PEM", default=default,
                       help="client certificate for mutual TLS, a PEM file; implies --tls [env TANNERY_CLIENT_CERT]")
    group.add_argument("--tls-key", metavar="PEM", default=default,
                       help="the client certificate's private key, a PEM file [env TANNERY_CLIENT_KEY]")
    group.add_argument("--transport", choices=("auto", "local", "tcp", "grpc"), default=default,
                       help="how push, pull and get move tensor bytes: 'local' through the server's Unix socket "
                            "(same host: stored files mapped, no copy through a socket), 'tcp' through its data "
                            "port, 'grpc' the gRPC streams; 'auto' takes the first that reaches the server "
                            "[env TANNERY_TRANSPORT; default auto]")
    group.add_argument("--retries", metavar="N", type=int, default=default,
                       help="times a call that finds the server unreachable (restarting, a connection lost "
                            "midway) is tried again, after pauses that grow to 5 s (6 to 12.5 s in all for 5); a "
                            "push is sent again from its start, a pull resumes after the entries it has; each "
                            "retry is noted on stderr; 0 for none. Given neither this nor TANNERY_RETRIES, at a "
                            "terminal (stderr) a server this command has not reached yet is an error at once, "
                            "with no retry [env TANNERY_RETRIES; default 5]")
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="no progress bars or progress notes on stderr (results and errors still print)")


def target_of(args: argparse.Namespace) -> str:
    """The server address: --target, then TANNERY_TARGET, then localhost:50051."""
    return getattr(args, "target", None) or os.environ.get("TANNERY_TARGET") or DEFAULT_TARGET


#: gRPC target schemes whose part after the colon is no port (``unix:/run/t.sock``).
_SCHEMES = frozenset({"unix", "unix-abstract", "vsock", "ipv4", "ipv6", "dns"})


def check_target(target: str, source: str) -> str:
    """``target``, or a CommandError when it is a malformed HOST:PORT (a port that is not a
    number): that is no server to wait for, so the message says so, with no retry hint."""
    host, sep, port = target.rpartition(":")
    bare_ipv6 = ":" in host and not host.startswith("[")
    if not sep or "/" in target or host in _SCHEMES or bare_ipv6:
        return target
    if not port.isdigit():
        where = {"--target": "--target ", "TANNERY_TARGET": "TANNERY_TARGET="}.get(source, "the address ")
        raise CommandError(f"{where}{target}: a malformed address: HOST:PORT expected, the port a number",
                           hint="give the server's address as HOST:PORT, e.g. --target localhost:50051 "
                                "(or TANNERY_TARGET)")
    return target


def target_source(args: argparse.Namespace) -> str:
    """Where :func:`target_of` found the address: ``"--target"``, ``"TANNERY_TARGET"`` or ``"default"``."""
    if getattr(args, "target", None):
        return "--target"
    return "TANNERY_TARGET" if os.environ.get("TANNERY_TARGET") else "default"


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise CommandError(f"{name}={os.environ[name]!r}: not a yes or no",
                       hint=f"set {name} to 1/0, true/false, yes/no or on/off (or unset it)")


def tls_options(args: argparse.Namespace) -> dict[str, str] | None:
    """The TLS settings as ``TLS`` keywords (ca, cert, key: PEM file paths), None for plaintext."""
    from tannery.rpc.connection import ENV_TLS

    ca, cert, key = (getattr(args, f"tls_{field}", None) or os.environ.get(ENV_TLS[field]) or None
                     for field in ("ca", "cert", "key"))
    wanted = bool(getattr(args, "tls", None)) or _env_flag("TANNERY_TLS") or any((ca, cert, key))
    if not wanted:
        return None
    if bool(cert) != bool(key):
        raise CommandError("--tls-cert without --tls-key, or --tls-key without --tls-cert",
                           hint="give both: a client certificate and its key (or TANNERY_CLIENT_CERT and TANNERY_CLIENT_KEY)")
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path and not os.path.isfile(path):
            raise CommandError(f"{flag} {path}: no such file")
    return {"ca": ca, "cert": cert, "key": key}


def at_terminal_retries() -> Any:
    """The retries of a command that was given none (no --retries, no TANNERY_RETRIES): when
    stderr is a terminal, none until the server has answered once (a server never started fails
    at once, with its hint, instead of after 6 to 12 s of retries), the usual ones after; else
    None, the library's (a script rides out a restart)."""
    import sys

    if os.environ.get("TANNERY_RETRIES", "").strip() or not _isatty(sys.stderr):
        return None
    from tannery.rpc.retries import RetryPolicy

    return RetryPolicy(until_reached=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def connect(args: argparse.Namespace) -> Any:
    """A :class:`tannery.Client` for the global options (a context manager)."""
    from tannery import Client, TLS

    tls = tls_options(args)
    token = getattr(args, "token", None) or os.environ.get("TANNERY_TOKEN") or None
    transport = getattr(args, "transport", None) or os.environ.get("TANNERY_TRANSPORT") or None
    if transport is not None and transport not in ("auto", "local", "tcp", "grpc"):
        raise CommandError(f"TANNERY_TRANSPORT={transport!r}: not a transport",
                           hint="set it to auto, local, tcp or grpc (or unset it)")
    target = check_target(target_of(args), target_source(args))
    retries = getattr(args, "retries", None)
    if retries is not None and retries < 0:
        raise CommandError(f"--retries {retries}: not a number of retries", hint="give 0 (no retries) or more")
    try:
        return Client(target, token=token, tls=TLS(**tls) if tls is not None else None, transport=transport,
                      retries=at_terminal_retries() if retries is None else retries)
    except ValueError as exc:
        if "TANNERY_RETRIES" not in str(exc):
            raise
        raise CommandError(str(exc), hint="set TANNERY_RETRIES to 0 or more (or unset it)") from None
