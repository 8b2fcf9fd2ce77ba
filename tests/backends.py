"""Fixtures of the storage backends that run as their own servers (a pytest plugin that
tests/conftest.py registers): a private PostgreSQL for the session, a database per test."""

from __future__ import annotations

import itertools
import os

import pytest

from .needs import require, started
from .postgres_harness import PostgresServer, postgres_bin

_databases = itertools.count(1)


@pytest.fixture(scope="session")
def postgres_server():
    """A :class:`tests.postgres_harness.PostgresServer`, started once for the session.

    Without PostgreSQL's binaries the tests that need it skip, except in CI (``CI`` set),
    where they fail: CI must run them.
    """
    require(postgres_bin() is not None,
            "PostgreSQL is not installed (no initdb on PATH, in /usr/lib/postgresql/*/bin or "
            "$TANNERY_POSTGRES_BIN): install Debian's postgresql package (make test does)")
    with started(PostgresServer()) as server:
        yield server


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


#: The storage backends the service tests run against: the embedded store (SQLite and files
#: in the data directory) and the shared one (PostgreSQL and a bucket, as replicas use it).
BACKENDS = ("embedded", "shared")
#: A shared store's timings in tests: leases expire and unreferenced blobs go within seconds.
SHARED_TIMINGS = {"lease_seconds": 2.0, "gc_grace_seconds": 0.0, "health_check_seconds": 0.2}


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> dict:
    """Server settings (``running_server`` keywords) of one storage backend: none for the
    embedded store; a fresh PostgreSQL database and blob store for the shared one."""
    if request.param == "embedded":
        return {}
    return {"catalog": request.getfixturevalue("postgres_url"), "blobs": shared_blobs_url(request, tmp_path),
            **SHARED_TIMINGS}


def shared_blobs_url(request, tmp_path) -> str:
    """Where a shared store's blobs go in tests: a fresh bucket of the session's SeaweedFS."""
    return request.getfixturevalue("s3_url")


@pytest.fixture(scope="session")
def nats_server():
    """A :class:`tests.nats_harness.NatsServer`, started once for the session (skips without
    Debian's nats-server, except in CI, where it fails). A test that stops it starts it again."""
    from .nats_harness import NatsServer, nats_server_bin

    require(nats_server_bin() is not None,
            "nats-server is not installed: install Debian's nats-server package (make test does)")
    with started(NatsServer()) as server:
        yield server


@pytest.fixture
def nats_url(nats_server) -> str:
    """The URL of the session's NATS server, running (started again if a test left it stopped)."""
    if not nats_server.running:
        nats_server.start()
    yield nats_server.url
    if not nats_server.running:
        nats_server.start()
