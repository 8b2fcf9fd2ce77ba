"""Rules for archive and entry names, checked before any data is accepted."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

from .failures import Malformed

__all__ = ["check_archive_name", "check_entry_name", "check_metadata", "check_prefix"]

#: Bounds of an archive's metadata (StoreBegin.metadata, UnionRequest.metadata): it is a small
#: map kept in the catalog's archive row and returned whole by every Describe.
MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_BYTES = 64 << 10


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


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """An archive's metadata: at most :data:`MAX_METADATA_KEYS` keys, each non-empty, at most
    :data:`MAX_METADATA_KEY_BYTES` of UTF-8 and free of control characters, and at most
    :data:`MAX_METADATA_BYTES` of keys and values in all. Malformed naming the key otherwise."""
    items = dict(metadata)
    if len(items) > MAX_METADATA_KEYS:
        raise Malformed(f"metadata: {len(items)} keys, over the limit of {MAX_METADATA_KEYS} "
                        "(keep the archive's metadata small: a few keys like format)")
    total = 0
    for key in sorted(items):
        _check_common("metadata key", key, MAX_METADATA_KEY_BYTES)
        total += len(key.encode("utf-8")) + len(items[key].encode("utf-8"))
        if total > MAX_METADATA_BYTES:
            raise Malformed(f"metadata: keys and values over the limit of {MAX_METADATA_BYTES} bytes in all "
                            f"(at key {key[:64]!r}; keep large values in entries or elsewhere)")
    return items
