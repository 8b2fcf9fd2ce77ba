"""The shared catalog's connections to PostgreSQL: a pool, and statements run on it with
every driver error raised as :class:`~.errors.StorageUnavailable` naming the catalog
(``postgresql://user@host:port/db``, never a password) and what failed.

A deadlock or serialization failure rolls its whole transaction back, so such writes are run
again (up to three times); other writes are never retried (a lost COMMIT has an unknown
outcome). Reads are retried once on a connection that broke.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Mapping, TypeVar

try:
    import psycopg
    from psycopg import Cursor
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
except ImportError as _error:  # pragma: no cover: the embedded server never imports this module
    raise ImportError(
        f"the PostgreSQL catalog needs psycopg and psycopg-pool, in the scale extra: pip install '.[scale]' in "
        f"a clone of tannery, or the wheel make dist builds with [scale] ({_error})"
    ) from _error

from .errors import StorageUnavailable

log = logging.getLogger("tannery_server.storage.postgres_catalog")
T = TypeVar("T")
#: A unique constraint violated: what its name means, as the exception to raise (given what failed).
ConstraintErrors = Mapping[str, Callable[[str], BaseException]]
UniqueViolation = pg_errors.UniqueViolation
#: Writes run again after a deadlock or a serialization failure, at most this many times in all.
_WRITE_ATTEMPTS = 3


def safe_name(url: str) -> str:
    """``postgresql://user@host:port/db`` of a connection URL or DSN: how messages name the
    catalog (never with its password)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "postgresql://(unparsable URL)"
    user = params.get("user", "")
    host = params.get("host", "") or "localhost"
    port = params.get("port", "") or "5432"
    return f"postgresql://{user + '@' if user else ''}{host}:{port}/{params.get('dbname', '')}"


def reason(exc: BaseException) -> str:
    """The first line of a driver's message, without libpq's "connection to server ... failed: "
    nor the server's severity ("FATAL:  database "x" does not exist" is "database "x" does not exist")."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = text.rsplit("failed: ", 1)[-1].strip() or text
    text = re.sub(r"^(FATAL|ERROR|PANIC):\s+", "", text)
    return text[:1].lower() + text[1:]


class PostgresPool:
    """Pooled connections to ``url`` (a libpq URL or DSN), ``min_size`` to ``max_size`` of them.

    ``timeout``: seconds a call waits for a connection before it fails (PostgreSQL down:
    StorageUnavailable after that long); a broken connection is replaced in the background,
    so calls succeed again by themselves once PostgreSQL is back. ``constraints``: the unique
    constraints a write may violate, each with the error it means (not StorageUnavailable).
    """

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 8, timeout: float = 5.0,
                 constraints: ConstraintErrors | None = None) -> None:
        self.url = url
        self.name = safe_name(url)
        self.timeout = timeout
        self._constraints = dict(constraints or {})
        self._pool = ConnectionPool(
            url, min_size=min_size, max_size=max_size, open=False, name=self.name, timeout=timeout,
            # Gives up a failing reconnection soon: the next call then starts a fresh one, instead
            # of waiting for an exponential back-off grown long while PostgreSQL was down.
            reconnect_timeout=max(2.0, timeout),
            check=ConnectionPool.check_connection,
            # TCP keepalives: a PostgreSQL host that vanished (no reset) is noticed in about 20 s.
            # client_encoding UTF8: text comes back as str whatever the database's encoding (one
            # in SQL_ASCII, initdb's default without a UTF-8 locale, would give bytes).
            kwargs={"autocommit": True, "connect_timeout": max(1, round(timeout)), "keepalives_idle": 10,
                    "keepalives_interval": 5, "keepalives_count": 2, "client_encoding": "UTF8"},
        )
        self._pool.open(wait=False)

    def run(self, what: str, work: Callable[[Cursor], T], *, write: bool, retry: bool = True,
            timeout: float | None = None) -> T:
        """``work(cursor)`` on a pooled connection, in one transaction when ``write``; driver
        errors raised as StorageUnavailable saying ``what`` failed."""
        attempt = 0
        while True:
            attempt += 1
            broken = False
            try:
                with self._pool.connection(timeout) as conn:
                    try:
                        with conn.cursor() as cur:
                            if not write:
                                return work(cur)
                            with conn.transaction():
                                return work(cur)
                    finally:
                        broken = conn.broken
            except PoolTimeout:
                raise self._unreachable(what) from None
            except PoolClosed:
                raise StorageUnavailable(f"catalog {self.name} is closed ({what})") from None
            except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as exc:
                if write and retry and attempt < _WRITE_ATTEMPTS:
                    log.info("catalog %s: %s: %s; running it again", self.name, what, reason(exc))
                    continue
                raise self._failed(what, exc) from exc
            except pg_errors.UniqueViolation as exc:
                meaning = self._constraints.get(exc.diag.constraint_name or "")
                if meaning is not None:
                    raise meaning(what) from None
                raise self._failed(what, exc) from exc
            except psycopg.OperationalError as exc:
                if not write and broken and attempt < 2:
                    continue  # a read is idempotent: once more, on a new connection
                raise self._failed(what, exc) from exc
            except psycopg.Error as exc:
                raise self._failed(what, exc) from exc

    def read(self, what: str, work: Callable[[Cursor], T]) -> T:
        return self.run(what, work, write=False)

    def write(self, what: str, work: Callable[[Cursor], T], *, retry: bool = True) -> T:
        return self.run(what, work, write=True, retry=retry)

    def _failed(self, what: str, exc: BaseException) -> StorageUnavailable:
        return StorageUnavailable(f"catalog {self.name}: {what} failed: {reason(exc)}")

    def _unreachable(self, what: str) -> StorageUnavailable:
        """No connection within the timeout: say why, from a connection attempt of our own."""
        try:
            with psycopg.connect(self.url, connect_timeout=max(1, round(min(self.timeout, 3)))):
                pass
        except psycopg.Error as exc:
            return StorageUnavailable(f"catalog {self.name} unreachable: {reason(exc)} ({what})")
        return StorageUnavailable(
            f"catalog {self.name}: no connection free within {self.timeout:g} s ({what}); "
            f"{self._pool.max_size} in use, or being re-established"
        )

    def close(self) -> None:
        self._pool.close()


__all__ = ["ConstraintErrors", "Cursor", "PostgresPool", "UniqueViolation", "reason", "safe_name"]
