"""Summaries of one tensor for ``tannery get``: statistics and a short preview.

Statistics are computed a chunk of elements at a time (:class:`tannery_protocol.summary.Summary`,
which the server's web page uses too), so a large tensor costs a chunk's worth of float64
memory, not a float64 copy of itself.
"""

from __future__ import annotations

import numpy as np

from tannery_protocol.summary import Stats, Summary

#: Elements summarised at a time.
CHUNK = 1 << 20


def statistics(array: np.ndarray) -> Stats:
    """The statistics of an array of any dtype of the format (ml_dtypes' included)."""
    flat = array.reshape(-1)
    summary = Summary(flat.dtype)
    for start in range(0, flat.size, CHUNK):
        summary.add(flat[start : start + CHUNK])
    return Stats(count=int(flat.size), **summary.result())


def preview(array: np.ndarray, width: int = 100, max_lines: int = 16) -> str:
    """A few elements of an array as numpy prints it: the edges of each dimension, blank lines
    dropped, at most ``max_lines`` lines."""
    edge = 3 if array.ndim <= 2 else 2
    text = np.array2string(array, max_line_width=width, threshold=24, edgeitems=edge, precision=4, separator=", ")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def format_number(value: float | int | None) -> str:
    """A statistic for people: integers exactly, floats to 6 significant digits, ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


__all__ = ["Stats", "format_number", "preview", "statistics"]
