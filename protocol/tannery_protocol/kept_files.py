"""How an archive's kept files are named among its entries (docs/model-folders.md). Torch-free.

A file kept with an archive (a pushed folder's ``config.json``) is an entry named ``@file:`` and
the file's name, under the Store's prefix as every entry (``enc.@file:config.json``). The client
names and reads them; the server tells them apart from tensors (Diff, the web page). One rule,
here, for both.
"""

from __future__ import annotations

from .names import SEPARATOR, join

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
