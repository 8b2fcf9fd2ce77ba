"""Summaries of one tensor for ``tannery get``: statistics and a short preview.

Statistics are computed a chunk of elements at a time, so a large tensor costs a
chunk's worth of float64 memory, not a float64 copy of itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

#: Elements summarised at a time.
CHUNK = 1 << 20


@dataclass
class Stats:
    """Statistics of a tensor's elements (its keys are the JSON keys of ``tannery get --json``).

    ``of`` is ``"values"``, or ``"abs"`` for complex tensors (statistics of the magnitudes).
    ``min``, ``max``, ``mean`` and ``std`` (population, ddof=0) cover the finite elements,
    None when there is none; ``nan`` and ``inf`` count the others, None for dtypes that
    have neither (integers, bool). Booleans count as 0 and 1.
    """

    count: int
    of: str
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    nan: int | None
    inf: int | None

    def as_dict(self) -> dict:
        return asdict(self)


class _Moments:
    """Count, mean and sum of squared deviations, merged chunk by chunk (Chan et al.)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, values: np.ndarray) -> None:
        n = values.size
        if not n:
            return
        mean = float(values.mean())
        m2 = float(((values - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def std(self) -> float:
        return math.sqrt(self.m2 / self.count)


def statistics(array: np.ndarray) -> Stats:
    """The statistics of an array of any dtype of the format (ml_dtypes' included)."""
    flat = array.reshape(-1)
    kind = flat.dtype.kind
    floating = kind in "fc" or flat.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    moments = _Moments()
    low = high = None
    nan = inf = 0
    for start in range(0, flat.size, CHUNK):
        chunk = flat[start : start + CHUNK]
        if kind == "c":
            chunk = chunk.astype(np.complex128)
            nan += int(np.count_nonzero(np.isnan(chunk)))
            inf += int(np.count_nonzero(np.isinf(chunk) & ~np.isnan(chunk)))
            values = np.abs(chunk[np.isfinite(chunk)])
        elif floating:
            chunk = chunk.astype(np.float64)
            finite = np.isfinite(chunk)
            nan += int(np.count_nonzero(np.isnan(chunk)))
            inf += int(np.count_nonzero(np.isinf(chunk)))
            values = chunk[finite]
        else:
            values = chunk
        if values.size:
            lo, hi = values.min(), values.max()
            lo, hi = (float(lo), float(hi)) if floating else (int(lo), int(hi))
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
            moments.add(values.astype(np.float64))
    return Stats(
        count=int(flat.size),
        of="abs" if kind == "c" else "values",
        min=low,
        max=high,
        mean=moments.mean if moments.count else None,
        std=moments.std() if moments.count else None,
        nan=nan if floating else None,
        inf=inf if floating else None,
    )


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
