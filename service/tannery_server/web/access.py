"""Who may see the pages: on a server with tokens, a request carries one the server knows (a read
token suffices), as ``Authorization: Bearer`` or the cookie the sign-in form sets. Without one the
page asks for it (401, a form); an unknown one is refused (403). Without tokens the pages are open,
as the gRPC services are."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from ..auth import Tokens
from .inputs import PageProblem, local_path

COOKIE = "tannery_token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenRequired(PageProblem):
    """No token, or an unknown one: the page says so and shows the form that asks for one."""

    def __init__(self, status: int, message: str, remedy: str, next_path: str) -> None:
        super().__init__(status, "Unauthorized" if status == 401 else "Forbidden", message, remedy)
        self.next_path = next_path


def token_of(request: web.Request) -> str | None:
    """The token a request carries: its bearer header, else its cookie (None: neither)."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


def middleware(tokens: Tokens) -> Callable:
    """The middleware that lets a request through only with a known token (when there are tokens)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not tokens or request.path == "/login":
            return await handler(request)
        token = token_of(request)
        here = local_path(request.path_qs)
        if token is None:
            raise TokenRequired(401, "this server asks for a token: give one of its tokens (a read token is enough)",
                                "paste it below; the page keeps it in a cookie of this site until the browser closes",
                                here)
        if tokens.role_of(token) is None:
            raise TokenRequired(403, "refused: the token given is not one of this server's tokens",
                                "give a token from the server's tokens file (TANNERY_TOKENS_FILE); a read token is enough",
                                here)
        return await handler(request)

    return check


async def sign_in(request: web.Request, tokens: Tokens, secure: bool) -> web.StreamResponse:
    """POST /login: a known token is kept in a cookie and the browser goes back to its page; an
    unknown one is refused (403), the form shown again."""
    form = await request.post()
    token = str(form.get("token", "")).strip()
    next_path = local_path(str(form.get("next", "/archives")))
    if not tokens:
        raise web.HTTPSeeOther(next_path)
    if not token:
        raise TokenRequired(401, "no token was given", "paste one of the server's tokens (a read token is enough)",
                            next_path)
    if tokens.role_of(token) is None:
        raise TokenRequired(403, "refused: the token given is not one of this server's tokens",
                            "give a token from the server's tokens file (TANNERY_TOKENS_FILE); a read token is enough",
                            next_path)
    response = web.HTTPSeeOther(next_path)
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=secure, path="/")
    raise response


__all__ = ["COOKIE", "TokenRequired", "middleware", "sign_in", "token_of"]
