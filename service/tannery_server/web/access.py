"""Who may see the pages: on a server with tokens, a request carries one the server knows (a read
token suffices), as ``Authorization: Bearer`` or the cookie the sign-in form sets, which holds an
opaque value standing for the token (:mod:`.sessions`), never the token. Without one the page
asks for it (401, a form); an unknown one, or a cookie that stands for none (signed out), is
refused (403). Sign-out (POST /logout) ends the cookie's sign-in. Without tokens the pages are
open, as the gRPC services are. The style and script files (/static/) are open to all."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from ..auth import Tokens
from .inputs import PageProblem, local_path
from .sessions import Sessions

COOKIE = "tannery_token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenRequired(PageProblem):
    """No token, or an unknown one: the page says so and shows the form that asks for one."""

    def __init__(self, status: int, message: str, remedy: str, next_path: str) -> None:
        super().__init__(status, "Unauthorized" if status == 401 else "Forbidden", message, remedy)
        self.next_path = next_path


#: What a cookie that stands for no sign-in is taken as: no token any server knows.
SIGNED_OUT = "\x00signed out"
#: Paths answered without a token: the sign-in and sign-out forms, the style and the script.
OPEN_PATHS = ("/login", "/logout")


def token_of(request: web.Request, sessions: Sessions) -> str | None:
    """The token a request carries: its bearer header, else the one its cookie stands for
    (:data:`SIGNED_OUT` when it stands for none); None: neither."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    cookie = request.cookies.get(COOKIE)
    if not cookie:
        return None
    return sessions.token(cookie) or SIGNED_OUT


def middleware(tokens: Tokens, sessions: Sessions) -> Callable:
    """The middleware that lets a request through only with a known token (when there are tokens)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not tokens or request.path in OPEN_PATHS or request.path.startswith("/static/"):
            return await handler(request)
        token = token_of(request, sessions)
        here = local_path(request.path_qs)
        if token is None:
            raise TokenRequired(401, "this server asks for a token: give one of its tokens (a read token is enough)",
                                "paste it below; the page keeps it in a cookie of this site until the browser closes",
                                here)
        if token == SIGNED_OUT:
            raise TokenRequired(403, "refused: this browser's sign-in is not one this server knows (signed out, or "
                                "the server restarted since)", "give the token again below", here)
        if tokens.role_of(token) is None:
            raise TokenRequired(403, "refused: the token given is not one of this server's tokens",
                                "give a token from the server's tokens file (TANNERY_TOKENS_FILE); a read token is enough",
                                here)
        return await handler(request)

    return check


async def sign_in(request: web.Request, tokens: Tokens, sessions: Sessions, secure: bool) -> web.StreamResponse:
    """POST /login: a known token opens a sign-in, whose opaque value the cookie keeps, and the
    browser goes back to its page; an unknown one is refused (403), the form shown again."""
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
    response.set_cookie(COOKIE, sessions.open(token), httponly=True, samesite="Strict", secure=secure, path="/")
    raise response


async def sign_out(request: web.Request, sessions: Sessions) -> web.StreamResponse:
    """POST /logout: the cookie's sign-in ends (its value opens nothing from now on), the cookie is
    removed, and the browser goes to the list, which asks for a token again."""
    cookie = request.cookies.get(COOKIE)
    if cookie:
        sessions.close(cookie)
    response = web.HTTPSeeOther("/archives")
    response.del_cookie(COOKIE, path="/")
    raise response


__all__ = ["COOKIE", "OPEN_PATHS", "SIGNED_OUT", "TokenRequired", "middleware", "sign_in", "sign_out", "token_of"]
