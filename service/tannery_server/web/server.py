"""The web server: an aiohttp application on the server's event loop, bound to ``web_host``
(loopback unless told otherwise) and ``web_port``, over TLS when the server has TLS, behind the
server's tokens. It answers GET (and the sign-in and sign-out forms' POST) only, and writes nothing."""

from __future__ import annotations

import logging
import ssl
from typing import Any

from aiohttp import web

from ..auth import Tokens
from ..config import Config
from ..storage import Storage, StorageUnavailable
from . import access, assets, downloads, hosts, pages, versions
from .inputs import PageProblem
from .sessions import Sessions
from .templates import Renderer
from .traffic import Traffic

log = logging.getLogger("tannery_server.web")
#: The policy of every page: the style and script files this server serves (no inline script or
#: style, so not even a name escaping missed could run), inline SVG, nothing from elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; "
                               "img-src data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: Largest request body (the sign-in form's).
MAX_BODY = 16 << 10


def ssl_context(config: Config) -> ssl.SSLContext | None:
    """The server's TLS certificate for HTTPS (client certificates required with a client CA); None without TLS."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    if config.tls_client_ca is not None:
        context.load_verify_locations(str(config.tls_client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _problems(renderer: Renderer) -> Any:
    """The middleware that turns refusals into pages: a PageProblem, an unknown path (404), a
    method other than GET (405); each says what is wrong and what to do."""

    @web.middleware
    async def handle(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except PageProblem as problem:
            response = _problem_page(renderer, problem)
        except web.HTTPNotFound:
            response = _problem_page(renderer, PageProblem(
                404, "Not Found", f"there is no page at {request.path[:200]!r}",
                "the pages are /archives, /archive?name=..., /entry?archive=...&name=..., /diff, /alias?name=... and /server"))
        except web.HTTPMethodNotAllowed:
            response = _problem_page(renderer, PageProblem(
                405, "Method Not Allowed", f"{request.method[:20]} is not answered: these pages are read-only",
                "open the page with GET (follow a link or type its address)"))
        except web.HTTPException:
            raise  # redirects (the sign-in's) and aiohttp's own answers
        except StorageUnavailable as exc:
            response = _problem_page(renderer, PageProblem(
                503, "Service Unavailable", f"the storage does not answer: {exc}",
                "the Server page says which part; try again once it answers"))
        except Exception as exc:
            log.exception("web page %s failed", request.path)
            response = _problem_page(renderer, PageProblem(
                500, "Internal Server Error", f"this page failed: {type(exc).__name__}: {exc}",
                "the server's log has the details; report it with the page's address"))
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        return response

    return handle


def _problem_page(renderer: Renderer, problem: PageProblem) -> web.Response:
    asks = isinstance(problem, access.TokenRequired)
    text = renderer.page("problem", status=problem.status, title=problem.title, message=problem.message,
                         remedy=problem.remedy, ask_token=asks, next=getattr(problem, "next_path", "/archives"))
    response = web.Response(status=problem.status, text=text, content_type="text/html")
    if asks and problem.status == 403:
        response.del_cookie(access.COOKIE, path="/")
    return response


class WebServer:
    """The running web page; :meth:`close` stops it."""

    def __init__(self, site: pages.Site, tokens: Tokens, ssl_ctx: ssl.SSLContext | None,
                 allowed: hosts.AllowedHosts) -> None:
        self.site = site
        self.ssl = ssl_ctx
        sessions = Sessions()
        app = web.Application(middlewares=[_problems(site.renderer), hosts.middleware(allowed),
                                           access.middleware(tokens, sessions)],
                              client_max_size=MAX_BODY)
        app[pages.SITE] = site

        async def sign_in(request: web.Request) -> web.StreamResponse:
            return await access.sign_in(request, tokens, sessions, ssl_ctx is not None)

        async def sign_out(request: web.Request) -> web.StreamResponse:
            return await access.sign_out(request, sessions)

        async def home(request: web.Request) -> web.StreamResponse:
            raise web.HTTPFound("/archives")

        app.router.add_get("/", home)
        app.router.add_get("/archives", pages.archives_page)
        app.router.add_get("/archive", pages.archive_page)
        app.router.add_get("/entry", pages.entry_page)
        app.router.add_get("/tree", pages.tree_part)
        app.router.add_get("/file", pages.file_page)
        app.router.add_get("/diff", versions.diff_page)
        app.router.add_get("/alias", versions.alias_page)
        app.router.add_get("/download/entry", downloads.entry_download)
        app.router.add_get("/download/archive", downloads.archive_download)
        app.router.add_get("/server", pages.server_page)
        app.router.add_get("/static/{name}", assets.static_file)
        app.router.add_post("/login", sign_in)
        app.router.add_post("/logout", sign_out)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self.port: int | None = None
        self.host = ""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port. OSError naming the address."""
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=self.ssl, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise OSError(exc.errno, f"cannot serve the web page on {host}:{port}: {exc.strerror or exc} "
                          "(choose another port with --web-port or TANNERY_WEB_PORT: auto for a free one)") from None
        self.site.traffic.start()
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1] if sockets else port
        self.host = host
        return self.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl else 'http'}://{host}:{self.port}/"

    async def close(self) -> None:
        await self.site.traffic.close()
        await self.runner.cleanup()


async def start_web(config: Config, storage: Storage, tokens: Tokens, target: str, metrics: Any,
                    channels: Any) -> WebServer:
    """Start the web page of a server (``config.web_port`` set): its URL is logged."""
    site = pages.Site(storage, config, target, Renderer(target, bool(tokens)), Traffic(metrics), channels)
    server = WebServer(site, tokens, ssl_context(config), hosts.AllowedHosts.of(config))
    assert config.web_port is not None
    await server.start(config.web_host, config.web_port)
    log.info("web page on %s", server.url)
    return server


__all__ = ["WebServer", "ssl_context", "start_web"]
