"""Bearer tokens with roles, checked by a server interceptor before any handler runs.

A client sends ``authorization: Bearer <token>`` metadata. Each known token has a role:
``read`` may call the RPCs the protos mark ``idempotency_level = NO_SIDE_EFFECTS`` (List,
Describe, Fetch, DataPaths, Resolve, ListAliases, Watch and Subscribe); ``write`` may call
everything (Store, Union, Derive, Delete, Tag, Untag, Publish).
Health and reflection answer without a token. With no token configured the server is
open (and :func:`app.start` says so in a warning).

Tokens come from a file and/or the ``TANNERY_TOKENS`` setting. A file has one token a
line, then its role; ``#`` starts a comment (so a token has no ``#``, white space or
comma)::

    # the token itself (anyone who can read this file can use it) ...
    k8Jq2vX0-ingest-job      write
    # ... or its SHA-256 in hex, as printed by: printf %s "$TOKEN" | sha256sum
    sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae read

``TANNERY_TOKENS`` holds the same, comma-separated, with a colon before the role:
``k8Jq2vX0-ingest-job:write,sha256:2c26...e7ae:read``.

Only SHA-256 digests are kept in memory; a presented token is hashed and compared with
every known digest by :func:`hmac.compare_digest`, so the time taken says nothing about
which token, or how much of one, matched. No token is ever logged or put in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import grpc
from google.protobuf import descriptor_pb2

from tannery_protocol.v1 import archives_pb2, channels_pb2

READ = "read"
WRITE = "write"
ROLES = (READ, WRITE)



def _read_methods() -> frozenset[str]:
    """The RPCs the protos mark ``idempotency_level = NO_SIDE_EFFECTS``: what a ``read`` token may call."""
    no_side_effects = descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS
    return frozenset(
        f"/{service.full_name}/{method.name}"
        for module in (archives_pb2, channels_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
        if method.GetOptions().idempotency_level == no_side_effects
    )


#: The RPCs a ``read`` token may call; every other RPC needs ``write``.
READ_METHODS = _read_methods()
_READ_NAMES = ", ".join(sorted(path.rsplit("/", 1)[1] for path in READ_METHODS))
#: Services that answer without a token (an orchestrator's probe has none).
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

HASH_PREFIX = "sha256:"
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")

TOKENS_HELP = (
    f"Tokens file format: one token a line, then its role (read: {_READ_NAMES}; write: "
    "everything), '#' starts a comment; a token has no '#', comma or white space. A token is written as itself, or as sha256:<64 hex digits> of it "
    "(printf %s \"$TOKEN\" | sha256sum). TANNERY_TOKENS holds the same comma-separated with a colon before the "
    "role: 'tok1:write,sha256:<hex>:read'. Clients send 'authorization: Bearer <token>'. Without tokens the "
    "server is open to anyone who can reach it."
)


class TokenError(ValueError):
    """A tokens file or setting that cannot be read; the message never contains a token."""


@dataclass(frozen=True)
class Tokens:
    """Known tokens as (SHA-256 digest, role) pairs."""

    entries: tuple[tuple[bytes, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def role_of(self, token: str) -> str | None:
        """The role of ``token``, or None; compares with every known digest in constant time."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        role = None
        for known, known_role in self.entries:
            if hmac.compare_digest(digest, known):
                role = known_role
        return role

    def count(self, role: str) -> int:
        return sum(1 for _, r in self.entries if r == role)


def _digest_of(written: str, where: str) -> bytes:
    """The SHA-256 of a token written as itself or as ``sha256:<hex>``."""
    if written.startswith(HASH_PREFIX):
        hex_digits = written[len(HASH_PREFIX):]
        if not _HEX_DIGEST.fullmatch(hex_digits):
            raise TokenError(f"{where}: '{HASH_PREFIX}' must be followed by 64 hex digits "
                             f"(got {len(hex_digits)} characters)")
        return bytes.fromhex(hex_digits)
    return hashlib.sha256(written.encode("utf-8")).digest()


def _check_role(role: str, where: str) -> str:
    if role not in ROLES:
        raise TokenError(f"{where}: role {role!r} is not 'read' or 'write'")
    return role


def parse_tokens_file(text: str, name: str = "tokens file") -> list[tuple[bytes, str]]:
    """The (digest, role) pairs of a tokens file's text (format in the module docstring)."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        where = f"{name}, line {number}"
        fields = content.split()
        if len(fields) != 2:
            raise TokenError(f"{where}: expected a token and a role separated by white space, "
                             f"found {len(fields)} field{'s' if len(fields) != 1 else ''}")
        pairs.append((_digest_of(fields[0], where), _check_role(fields[1], where)))
    return pairs


def parse_tokens_setting(spec: str, name: str = "TANNERY_TOKENS") -> list[tuple[bytes, str]]:
    """The (digest, role) pairs of ``token:role,sha256:<hex>:role``."""
    pairs = []
    for index, item in enumerate(spec.split(","), 1):
        item = item.strip()
        if not item:
            continue
        where = f"{name}, item {index}"
        token, colon, role = item.rpartition(":")
        if not colon or not token:
            raise TokenError(f"{where}: expected <token>:<role> (role 'read' or 'write')")
        pairs.append((_digest_of(token, where), _check_role(role.strip(), where)))
    return pairs


def load_tokens(tokens_file: Path | None, spec: str = "") -> Tokens:
    """Every token of ``tokens_file`` and ``spec``; TokenError for a malformed line, an empty
    file (an unreadable or empty file must not leave the server open) or a token listed twice."""
    pairs: list[tuple[bytes, str]] = []
    if tokens_file is not None:
        try:
            text = Path(tokens_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"cannot read the tokens file {tokens_file}: {exc}") from None
        from_file = parse_tokens_file(text, f"tokens file {tokens_file}")
        if not from_file:
            raise TokenError(f"tokens file {tokens_file} lists no token")
        pairs += from_file
    pairs += parse_tokens_setting(spec)
    seen: dict[bytes, str] = {}
    for digest, role in pairs:
        if digest in seen:
            raise TokenError(f"the same token is listed twice (as {seen[digest]} and as {role}): list each once")
        seen[digest] = role
    return Tokens(tuple(pairs))


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadatum, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def refusal(tokens: Tokens, method: str, metadata: Iterable[Any] | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a call to ``method`` with ``metadata`` is refused (status code, message), or None."""
    if not tokens or method.startswith(OPEN_SERVICES):
        return None
    token = bearer_token(metadata)
    if token is None:
        return grpc.StatusCode.UNAUTHENTICATED, "this server needs a token: send 'authorization: Bearer <token>'"
    role = tokens.role_of(token)
    if role is None:
        return grpc.StatusCode.UNAUTHENTICATED, "the token is not one this server knows"
    if role != WRITE and method not in READ_METHODS:
        name = method.rsplit("/", 1)[-1]
        return grpc.StatusCode.PERMISSION_DENIED, f"{name} needs a write token; this token's role is {role}"
    return None


def mover(tokens: Tokens, metadata: Iterable[Any] | None) -> str:
    """Who a call that moves aliases is, for their history: ``write token sha256:1a2b3c4d`` (the
    role and the first 8 hex digits of the token's SHA-256, which name it to whoever holds the
    tokens file, and reveal nothing of the token); "" on an open server."""
    token = bearer_token(metadata) if tokens else None
    if token is None:
        return ""
    role = tokens.role_of(token) or "unknown"
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    return f"{role} token {HASH_PREFIX}{digest[:8]}"


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by one that ends the call with ``code``."""
    if handler.response_streaming:

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext):
            await context.abort(code, message)
            yield  # pragma: no cover - abort raises; this makes an async generator

        behaviour = refuse_stream
    else:

        async def refuse(request: Any, context: grpc.aio.ServicerContext):
            await context.abort(code, message)

        behaviour = refuse
    kind = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary")
    return handler._replace(**{kind: behaviour})


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known token (UNAUTHENTICATED) or whose token's role does not
    allow the method (PERMISSION_DENIED); allowed calls get their handler untouched."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        refused = refusal(self.tokens, handler_call_details.method, handler_call_details.invocation_metadata)
        return handler if refused is None else _refusing(handler, *refused)


__all__ = [
    "AuthInterceptor", "READ", "READ_METHODS", "ROLES", "TOKENS_HELP", "TokenError", "Tokens", "WRITE",
    "bearer_token", "load_tokens", "mover", "parse_tokens_file", "parse_tokens_setting", "refusal",
]
