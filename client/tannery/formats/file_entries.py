"""How the entry of a file kept with an archive is named (``@file:NAME``, under a prefix
``P.@file:NAME``): what the records and the archive-files module both read, so neither
imports the other for it (docs/model-folders.md)."""

from __future__ import annotations

from tannery_protocol.names import SEPARATOR, join

#: What the entry name of a kept file starts with (after its prefix and a dot).
MARK = "@file:"


def entry_name(file: str, prefix: str = "") -> str:
    """The entry that holds ``file``: ``@file:config.json``, under ``prefix`` ``enc.@file:config.json``."""
    return join(prefix, MARK + file)


def split_entry(name: str) -> tuple[str, str] | None:
    """``(prefix, file)`` of an entry that holds a file, None for a tensor's entry."""
    if name.startswith(MARK):
        return "", name[len(MARK):]
    at = name.find(SEPARATOR + MARK)
    if at < 0:
        return None
    return name[:at], name[at + len(SEPARATOR + MARK):]


def is_file_entry(name: str) -> bool:
    """Whether entry ``name`` holds a kept file (and is no tensor of the archive's)."""
    return split_entry(name) is not None


__all__ = ["MARK", "entry_name", "is_file_entry", "split_entry"]
