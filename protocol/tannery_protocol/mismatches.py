"""The messages of an ask that an archive's entry does not match, written once.

A local archive (:mod:`tannery.archive`), a remote one checking before it sends
(:mod:`tannery.remote`) and the server checking what it is asked (``tannery_server.fetching``)
say the same thing in the same words: ``{where}: {name}: ...``, shapes as Python lists, dtypes
by their short names. Torch-free, for the server.
"""

from __future__ import annotations

from collections.abc import Sequence

from .codec import format_shape

#: The dtypes ``Archive.float`` reads and casts to.
FLOATS_TEXT = "float16, bfloat16, float32 or float64"


def no_entry(where: str, name: str, suggestion: str = "") -> str:
    """No entry of that name (``suggestion``: a did-you-mean, or what else the name is)."""
    return f"{where}: {name}: no entry in the archive{suggestion}"


def shape_differs(where: str, name: str, stored: Sequence[int], asked: Sequence[int], by: str = "asked for") -> str:
    """The entry's shape is not the one asked for (or ``by`` another: ``"in the value"``)."""
    return f"{where}: {name}: shape {format_shape(stored)} in the archive, {format_shape(asked)} {by}"


def dtype_differs(where: str, name: str, stored: str, asked: str, by: str = "asked for") -> str:
    """The entry's dtype is not the one asked for (or ``by`` another: ``"in the value"``)."""
    return f"{where}: {name}: {stored} in the archive, {asked} {by}"


def not_float(where: str, name: str, stored: str) -> str:
    """A float read of an entry whose dtype is not a float."""
    return f"{where}: {name}: {stored} in the archive, not {FLOATS_TEXT}"


def rows_of_scalar(where: str, name: str, start: int, stop: int) -> str:
    return f"{where}: {name}: rows [{start}, {stop}) asked for, but the entry is a scalar"


def rows_past_end(where: str, name: str, start: int, stop: int, shape: Sequence[int]) -> str:
    return (f"{where}: {name}: rows [{start}, {stop}) asked for, {shape[0]} rows in the archive "
            f"(shape {format_shape(shape)})")


__all__ = ["FLOATS_TEXT", "dtype_differs", "no_entry", "not_float", "rows_of_scalar", "rows_past_end", "shape_differs"]
