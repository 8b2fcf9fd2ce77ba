"""What a sweeper remembers of the blobs it could not collect: when to try each again.

A blob whose removal failed (the bucket refused its DELETE, or timed out) is skipped until its
next try, and the wait doubles with each failure up to a bound, so one stuck object neither
stops collection nor is hammered. Kept in memory per replica: a restart tries everything once
again, which is cheap. Counters for the metrics (``tannery_collection_failures_total``,
``tannery_collection_stuck_blobs``)."""

from __future__ import annotations

import dataclasses
import threading

NS = 1_000_000_000


@dataclasses.dataclass
class _Failure:
    """One blob's failures in a row, the last error, and the earliest time to try it again."""

    attempts: int
    error: str
    next_try_ns: int


class CollectBackoff:
    """Failed collections by digest, with the next time each may be tried (exponential backoff
    from ``first_seconds``, at most ``max_seconds``)."""

    def __init__(self, first_seconds: float = 5.0, max_seconds: float = 600.0) -> None:
        self.first_ns = int(first_seconds * NS)
        self.max_ns = int(max_seconds * NS)
        #: Every failed removal since start, for the metric.
        self.failures_total = 0
        self._failed: dict[str, _Failure] = {}
        self._lock = threading.Lock()

    def waiting(self, now_ns: int) -> set[str]:
        """The digests not to try before a later time."""
        with self._lock:
            return {d for d, f in self._failed.items() if f.next_try_ns > now_ns}

    def failed(self, digest: str, error: str, now_ns: int) -> float:
        """Record a failed removal; the seconds until the next try."""
        with self._lock:
            attempts = self._failed[digest].attempts + 1 if digest in self._failed else 1
            wait = min(self.first_ns * 2 ** (attempts - 1), self.max_ns)
            self._failed[digest] = _Failure(attempts, error, now_ns + wait)
            self.failures_total += 1
            return wait / NS

    def done(self, digest: str) -> None:
        """Forget ``digest``: collected, or no longer collectable."""
        with self._lock:
            self._failed.pop(digest, None)

    def forget_due_except(self, candidates: set[str], now_ns: int) -> None:
        """Forget the blobs due for a try that were no longer candidates (referenced or leased
        again, or collected by another replica): they are not stuck any more."""
        with self._lock:
            for digest in [d for d, f in self._failed.items() if f.next_try_ns <= now_ns and d not in candidates]:
                del self._failed[digest]

    def stuck(self) -> dict[str, str]:
        """The blobs whose last removal failed, with that error."""
        with self._lock:
            return {d: f.error for d, f in self._failed.items()}
