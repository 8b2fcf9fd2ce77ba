"""Rules for archive and entry names, checked before any data is accepted."""

from __future__ import annotations

import unicodedata

from tannery.names import join as joined, owns  # the owned-names rule, shared with the client

from .failures import InvalidArgument

__all__ = ["check_archive_name", "check_entry_name", "check_prefix", "joined", "owns"]


def _control_character(name: str) -> str | None:
    for ch in name:
        if unicodedata.category(ch) == "Cc":
            return ch
    return None


def _check_common(what: str, name: str, max_bytes: int) -> None:
    if not name:
        raise InvalidArgument(f"{what}: an empty name")
    size = len(name.encode("utf-8"))
    if size > max_bytes:
        raise InvalidArgument(f"{what} {name[:64]!r}...: {size} bytes, over the limit of {max_bytes}")
    bad = _control_character(name)
    if bad is not None:
        raise InvalidArgument(f"{what} {name!r}: control character {bad!r} is not allowed in names")


def check_archive_name(name: str, max_bytes: int) -> str:
    """An archive name: non-empty, at most ``max_bytes`` of UTF-8, no control characters,
    and, read as a path of ``/``-separated segments, no empty, ``.`` or ``..`` segment
    (so that a blob store keyed by names, such as S3, can never be walked out of)."""
    _check_common("archive name", name, max_bytes)
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(
                f"archive name {name!r}: segments between '/' must not be empty, '.' or '..'"
            )
    if "\\" in name:
        raise InvalidArgument(f"archive name {name!r}: '\\' is not allowed")
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
