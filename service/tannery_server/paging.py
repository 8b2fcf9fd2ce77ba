"""Pages of the listing RPCs (List, ListAliases): how many items a page holds, and the opaque
tokens that say where the next page begins. Every listing is paged, so no answer grows with the
store: a client asks again with the token until it comes back empty."""

from __future__ import annotations

import base64
import binascii
import json

from .failures import Malformed

#: Archives in a List page when the request asks for none (older clients), and at most.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: Aliases in a ListAliases page, by default and at most: older clients, which asked for every
#: alias in one answer, get the first page whole.
ALIAS_PAGE = 1000


def page_limit(asked: int, default: int = DEFAULT_PAGE, most: int = MAX_PAGE) -> int:
    """The items a page holds: ``asked`` (0: ``default``), at most ``most``."""
    return min(asked or default, most)


def name_token(last_name: str) -> str:
    """The token of a List page that ended at archive ``last_name``."""
    return base64.urlsafe_b64encode(b"v1:" + last_name.encode()).decode()


def after_name(token: str) -> str:
    """The archive name a List token ends at ("" for none); Malformed for a token this server never gave."""
    if not token:
        return ""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if raw.startswith(b"v1:"):
            return raw[3:].decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise _foreign(token)


def alias_token(target: str, alias: str) -> str:
    """The token of a ListAliases page that ended at alias ``alias`` (of archive ``target``)."""
    return base64.urlsafe_b64encode(b"a1:" + json.dumps([target, alias]).encode()).decode()


def after_alias(token: str) -> tuple[str, str] | None:
    """``(target, alias)`` of the alias a ListAliases token ends at (None for none); Malformed
    for a token this server never gave."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if raw.startswith(b"a1:"):
            target, alias = json.loads(raw[3:].decode())
            if isinstance(target, str) and isinstance(alias, str):
                return target, alias
    except (binascii.Error, UnicodeDecodeError, ValueError, TypeError):
        pass
    raise _foreign(token)


def _foreign(token: str) -> Malformed:
    return Malformed(f"page_token {token[:40]!r} is not one this server gave: send the next_page_token of the "
                     "previous page of the same request, or none for the first page")


__all__ = ["ALIAS_PAGE", "DEFAULT_PAGE", "MAX_PAGE", "after_alias", "after_name", "alias_token", "name_token",
           "page_limit"]
