"""Sign-ins of the web page: the cookie holds an opaque random value, which this server maps to
the token it was opened with, never the token itself (a cookie read off a disk or a proxy's log
opens nothing once signed out, and names no token). Kept in this server's memory: a restart, or
a replica the browser did not sign in to, asks for the token again."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

#: Sign-ins kept at most (the oldest forgotten first): a bound on memory whatever the form is sent.
MOST = 10_000


class Sessions:
    """Opaque cookie values and the tokens they stand for."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self._tokens: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, token: str) -> str:
        """A new opaque value standing for ``token`` (256 random bits)."""
        value = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[value] = token
            while len(self._tokens) > self.most:
                self._tokens.popitem(last=False)
        return value

    def token(self, value: str) -> str | None:
        """The token ``value`` stands for; None when it stands for none (signed out, or never signed in here)."""
        with self._lock:
            return self._tokens.get(value)

    def close(self, value: str) -> None:
        """Sign out: ``value`` stands for nothing from now on."""
        with self._lock:
            self._tokens.pop(value, None)


__all__ = ["MOST", "Sessions"]
