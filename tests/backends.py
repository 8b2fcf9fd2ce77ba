"""Fixtures of the storage backends that run as their own servers (a pytest plugin that
tests/conftest.py registers): a private PostgreSQL for the session, a database per test."""

from __future__ import annotations

import itertools
import os

import pytest

from .postgres_harness import PostgresServer, postgres_bin

_databases = itertools.count(1)


@pytest.fixture(scope="session")
def postgres_server():
    """A :class:`tests.postgres_harness.PostgresServer`, started once for the session.

    Without PostgreSQL's binaries the tests that need it skip, except in CI (``CI`` set),
    where they fail: CI must run them.
    """
    if postgres_bin() is None:
        reason = ("PostgreSQL is not installed (no initdb on PATH, in /usr/lib/postgresql/*/bin or "
                  "$TANNERY_POSTGRES_BIN): install Debian's postgresql package (make test does)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def postgres_url(postgres_server):
    """The URL of a new, empty database on :func:`postgres_server`, dropped after the test
    (PostgreSQL is started again first if the test left it stopped)."""
    name = f"test_{os.getpid()}_{next(_databases)}"
    url = postgres_server.create_database(name)
    yield url
    if not postgres_server.running:
        postgres_server.start()
    postgres_server.drop_database(name)
