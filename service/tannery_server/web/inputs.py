"""What a page accepts from its URL: the query parameters it knows, each once, as text without
control characters and no longer than a name may be. Anything else is refused (400) naming the
parameter and what to do, before the catalog is read."""

from __future__ import annotations

from typing import Mapping

from multidict import MultiMapping


class PageProblem(Exception):
    """A page that cannot be shown: its HTTP status, what is wrong, and the remedy."""

    def __init__(self, status: int, title: str, message: str, remedy: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message
        self.remedy = remedy


def query(params: MultiMapping[str], allowed: Mapping[str, int], page: str) -> dict[str, str]:
    """The parameters of ``params`` that ``page`` takes, by name; ``allowed`` gives each one's
    most UTF-8 bytes. PageProblem (400) for an unknown, repeated, too long or control-laden one."""
    values: dict[str, str] = {}
    for key in params.keys():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise PageProblem(400, "Bad Request", f"the {page} page takes no parameter {key[:80]!r}",
                              f"remove it from the address; this page's parameters: {known}")
        if key in values or len(params.getall(key)) > 1:
            raise PageProblem(400, "Bad Request", f"parameter {key!r} is given more than once",
                              "give it once")
        value = params.getone(key)
        values[key] = checked_text(key, value, allowed[key])
    return values


def checked_text(key: str, value: str, max_bytes: int) -> str:
    """``value`` when it is fit to look up: UTF-8 of at most ``max_bytes`` bytes, no control characters."""
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        raise PageProblem(400, "Bad Request", f"parameter {key!r} is not valid UTF-8",
                          "give the name as it is written") from None
    if len(encoded) > max_bytes:
        raise PageProblem(400, "Bad Request", f"parameter {key!r} has {len(encoded)} bytes; names have at most "
                          f"{max_bytes}", "give a shorter name")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise PageProblem(400, "Bad Request", f"parameter {key!r} holds control characters, which no name has",
                          "give the name as it is written, without control characters")
    return value


def required(values: Mapping[str, str], key: str, page: str, example: str) -> str:
    """The non-empty value of ``key``, or PageProblem (400) saying how to give it."""
    value = values.get(key, "")
    if not value:
        raise PageProblem(400, "Bad Request", f"the {page} page needs the parameter {key!r}",
                          f"give it in the address, e.g. {example}")
    return value


def local_path(target: str) -> str:
    """Where to go after signing in: a path of this site (``/...``), never another site."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target or any(ord(c) < 32 for c in target):
        return "/archives"
    return target


__all__ = ["PageProblem", "checked_text", "local_path", "query", "required"]
