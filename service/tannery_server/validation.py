"""Rules for archive and entry names, checked before any data is accepted."""

from __future__ import annotations

import unicodedata

from .failures import Malformed

__all__ = ["check_archive_name", "check_entry_name", "check_prefix"]


def _control_character(name: str) -> str | None:
    for ch in name:
        if unicodedata.category(ch) == "Cc":
            return ch
    return None


def _check_common(what: str, name: str, max_bytes: int) -> None:
    if not name:
        raise Malformed(f"{what}: an empty name")
    size = len(name.encode("utf-8"))
    if size > max_bytes:
        raise Malformed(f"{what} {name[:64]!r}...: {size} bytes, over the limit of {max_bytes}")
    bad = _control_character(name)
    if bad is not None:
        raise Malformed(f"{what} {name!r}: control character {bad!r} is not allowed in names")


def check_archive_name(name: str, max_bytes: int) -> str:
    """An archive name: non-empty, at most ``max_bytes`` of UTF-8, no control characters,
    and, read as a path of ``/``-separated segments, no empty, ``.`` or ``..`` segment and
    no ``\\``: names read as paths (``team/model/v3``) in listings, prefixes and shells, and
    ``a//b`` or ``a/../b`` would name one archive in two ways. (Blobs are keyed by digest,
    never by name, so this is about meaning, not about where bytes go.)"""
    _check_common("archive name", name, max_bytes)
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise Malformed(
                f"archive name {name!r}: segments between '/' must not be empty, '.' or '..'"
            )
    if "\\" in name:
        raise Malformed(f"archive name {name!r}: '\\' is not allowed")
    return name


def check_entry_name(name: str, max_bytes: int) -> str:
    """An entry name: non-empty, at most ``max_bytes`` of UTF-8, no control characters."""
    _check_common("entry name", name, max_bytes)
    return name


def check_prefix(prefix: str, max_bytes: int) -> str:
    """A prefix entries go under in a union: empty, or what an entry name may be."""
    if prefix:
        _check_common("prefix", prefix, max_bytes)
    return prefix
