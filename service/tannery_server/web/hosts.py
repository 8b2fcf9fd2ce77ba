"""Which names the web page answers for, and which origins may post its forms.

A page bound to loopback is still reachable by any web site a local user opens, through DNS
rebinding: the attacker's name is made to resolve to 127.0.0.1, and the browser sends it as
the Host. So the page answers only the names it was started for (its bind address,
``localhost`` and the loopback addresses when bound to loopback, an address literal or this
host's name when bound to every interface, and ``--web-allowed-hosts``); any other Host gets
421, tokens or not. A POST (the sign-in and sign-out forms) from another origin gets 403: a
cross-site page cannot sign a browser in with a token of its choosing.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from ..config import Config
from .inputs import PageProblem

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The names of this host's loopback interface.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: Bind addresses that mean every interface.
WILDCARDS = ("0.0.0.0", "::", "")


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``name`` as an IP address, None when it is a host name."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    address = _address(host)
    return host == "localhost" or (address is not None and address.is_loopback)


class AllowedHosts:
    """The names a web page started on ``web_host`` answers for (lowercase, without port)."""

    def __init__(self, web_host: str, extra: str = "") -> None:
        self.web_host = web_host.strip().lower()
        self.wildcard = self.web_host in WILDCARDS
        names = {self.web_host.strip("[]")} if not self.wildcard else set()
        if self.wildcard or _is_loopback(self.web_host):
            names.update(LOOPBACK_NAMES)
        if self.wildcard:
            names.update(n.lower() for n in (socket.gethostname(), socket.getfqdn()) if n)
        names.update(n.strip().lower() for n in extra.split(",") if n.strip())
        self.names = frozenset(names)

    @classmethod
    def of(cls, config: Config) -> "AllowedHosts":
        return cls(config.web_host, config.web_allowed_hosts)

    def allows(self, host: str) -> bool:
        """Whether a Host header's name (a port after it is ignored) is one this page answers:
        one of :attr:`names`, or, bound to every interface, any address literal (rebinding
        always brings a name)."""
        name = host_name(host)
        return name in self.names or (self.wildcard and _address(name) is not None)

    def describe(self) -> str:
        listed = ", ".join(sorted(self.names))
        return listed + (" and this host's addresses" if self.wildcard else "")


def host_name(host: str) -> str:
    """The name of a Host header's value: lowercase, its port and an IPv6 address's brackets gone."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def misdirected(host: str, allowed: AllowedHosts) -> PageProblem:
    """The 421 of a Host this page does not answer, with the remedy."""
    return PageProblem(421, "Misdirected Request",
                       f"this page does not answer for the host {host[:200]!r}: it answers for {allowed.describe()} "
                       "(a name it was not started for may be a DNS-rebinding page reaching it through the browser)",
                       "open the page at the address the server's start line gives, or start the server with "
                       f"--web-allowed-hosts {host_name(host)[:100]} (TANNERY_WEB_ALLOWED_HOSTS) if that name is yours")


def cross_site(origin: str) -> PageProblem:
    """The 403 of a form posted from another origin."""
    return PageProblem(403, "Forbidden", f"refused: this form was posted from another site ({origin[:200]!r}), "
                       "which may not sign this browser in or out",
                       "sign in from this server's own page (open it at the address the start line gives)")


def same_origin(request: web.Request) -> bool:
    """Whether a request comes from this page itself. A browser's ``Sec-Fetch-Site`` (which no
    page can set) must be ``same-origin`` (or ``none``: typed by the user); its ``Origin`` must
    be this scheme and Host, except ``null``, which a same-origin form sends under this page's
    ``Referrer-Policy: no-referrer`` and is taken only beside ``Sec-Fetch-Site``. A request with
    neither header comes from no browser page (a script)."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None or (origin == "null" and fetch_site is not None):
        return True
    parts = urlsplit(origin)
    return parts.scheme == request.scheme and parts.netloc.lower() == request.headers.get("Host", "").lower()


def middleware(allowed: AllowedHosts) -> Callable:
    """The middleware that answers only the allowed Hosts (421) and same-origin POSTs (403)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and not allowed.allows(host):
            raise misdirected(host, allowed)
        if request.method == "POST" and not same_origin(request):
            raise cross_site(request.headers.get("Origin", ""))
        return await handler(request)

    return check


__all__ = ["AllowedHosts", "host_name", "middleware", "same_origin"]
