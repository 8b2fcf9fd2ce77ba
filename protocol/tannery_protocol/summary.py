"""Statistics of a tensor's elements, merged a chunk at a time: what ``tannery get`` prints
(the client, over a tensor it fetched) and the server's web page shows (over stored bytes).

One :class:`Summary` takes chunks of elements (:meth:`Summary.add`) and holds a chunk's worth of
float64 memory at most, never a float64 copy of the tensor. ``min``, ``max``, ``mean`` and
``std`` (population, ddof=0) cover the finite elements, None when there is none; ``nan`` and
``inf`` count the others, None for dtypes that have neither (integers, bool). Booleans count as
0 and 1; complex tensors give the statistics of their magnitudes (``of`` is ``"abs"``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ._lazy import lazy_module

np = lazy_module("numpy")
#: ml_dtypes' floats, which numpy does not all call floating (kind "V").
_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


class Summary:
    """Count, mean and squared deviations merged chunk by chunk (Chan et al.), min, max, and the
    NaN and Inf counts of elements of numpy dtype ``dtype``."""

    def __init__(self, dtype: Any) -> None:
        dtype = np.dtype(dtype)
        self.complex = dtype.kind == "c"
        #: Whether the elements are floating (or complex): they have NaN and Inf, and float bounds.
        self.floating = dtype.kind in "fc" or dtype.name in _ML_FLOATS
        self.count, self.mean, self.m2 = 0, 0.0, 0.0
        self.low: float | int | None = None
        self.high: float | int | None = None
        self.nan = self.inf = 0

    def add(self, chunk: Any) -> Any:
        """Summarise a flat array of elements; returns the values it summarised (the finite ones,
        or magnitudes), for a caller that keeps some of them (a histogram)."""
        if self.complex:
            wide = chunk.astype(np.complex128)
            self.nan += int(np.count_nonzero(np.isnan(wide)))
            self.inf += int(np.count_nonzero(np.isinf(wide) & ~np.isnan(wide)))
            values = np.abs(wide[np.isfinite(wide)])
        elif self.floating:
            wide = chunk.astype(np.float64)
            self.nan += int(np.count_nonzero(np.isnan(wide)))
            self.inf += int(np.count_nonzero(np.isinf(wide)))
            values = wide[np.isfinite(wide)]
        else:
            values = chunk
        if not values.size:
            return values
        lo, hi = values.min(), values.max()
        lo, hi = (float(lo), float(hi)) if self.floating else (int(lo), int(hi))
        self.low = lo if self.low is None else min(self.low, lo)
        self.high = hi if self.high is None else max(self.high, hi)
        wide = values.astype(np.float64)
        n = wide.size
        mean = float(wide.mean())
        m2 = float(((wide - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        return values

    def result(self) -> dict[str, Any]:
        """``of``, ``min``, ``max``, ``mean``, ``std``, ``nan``, ``inf`` (``tannery get --json``'s keys
        but ``count``, which is the tensor's, not how many were summarised)."""
        return {
            "of": "abs" if self.complex else "values",
            "min": self.low, "max": self.high,
            "mean": self.mean if self.count else None,
            "std": math.sqrt(self.m2 / self.count) if self.count else None,
            "nan": self.nan if self.floating else None,
            "inf": self.inf if self.floating else None,
        }


@dataclass
class Stats:
    """Statistics of a tensor's elements (its keys are the JSON keys of ``tannery get --json``'s,
    and of the web page's entry statistics): ``count`` elements; the rest as :meth:`Summary.result`."""

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


__all__ = ["Stats", "Summary"]
