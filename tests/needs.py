"""What the fixtures of the servers tests need (PostgreSQL, SeaweedFS, NATS) share."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest


def require(installed: bool, reason: str) -> None:
    """Skip the test when a server it needs is not installed, except in CI (``CI`` set), where
    that fails it: CI must run every test."""
    if installed:
        return
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@contextmanager
def started(server):
    """``server`` started, and closed (stopped, its files removed) at the end."""
    try:
        server.start()
        yield server
    finally:
        server.close()
