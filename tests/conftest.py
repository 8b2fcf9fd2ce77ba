"""Fixtures shared by the whole suite."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest

from .s3_fixtures import s3_url, seaweedfs  # noqa: F401  (the S3 bucket fixtures, issue 15)

ROOT = Path(__file__).resolve().parents[1]
#: The atheris targets of ``make fuzz`` are scripts run under libFuzzer, not tests.
collect_ignore = ["fuzz"]
#: Fixtures of the backends that run as servers of their own (PostgreSQL); the default ports
#: held for the session under TANNERY_CI_BUSY_PORTS=1 (.ci/run), beside a default server.
pytest_plugins = ["tests.backends", "tests.busy_ports"]
#: Read-only data from other programs, beside the project; tests that use it skip without it.
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "tannic-nn"
#: The suite's clients take the gRPC streams unless a test asks for a data path: what those
#: tests check (messages, chunk counts) is about gRPC. tests/test_data_paths.py runs the
#: clients on every transport, "auto" included.
os.environ.setdefault("TANNERY_TRANSPORT", "grpc")
#: Clients (and the `tannery` commands tests run) give up at the first UNAVAILABLE unless a
#: test asks for retries: the many tests of unreachable or stopped servers check the error,
#: which the default retries would delay by 6 to 12 s each. tests/test_retries.py runs them.
os.environ.setdefault("TANNERY_RETRIES", "0")


#: Fixtures of the servers outside the project the suite starts (PostgreSQL, SeaweedFS's S3,
#: NATS): every test that uses one, itself or through another fixture, is marked ``external``
#: (``make test-quick`` leaves those out).
EXTERNAL_FIXTURES = frozenset({"postgres_server", "postgres_url", "seaweedfs", "s3_url", "nats_server", "nats_url"})
#: Parameters that take one of those fixtures at run time (``request.getfixturevalue``), which
#: collection cannot see: the parameter's name and the values that do.
EXTERNAL_PARAMS = {"backend": {"shared", "replica"}, "catalog": {"postgres"}}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (EXTERNAL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or any(params.get(name) in values for name, values in EXTERNAL_PARAMS.items())):
            item.add_marker(pytest.mark.external)


def peer(module: str) -> ModuleType:
    """``module`` of another program the suite compares tannery with (pytannic, installed by
    make's setup), imported. Missing, it fails the test that needs it, unless
    ``TANNERY_ALLOW_MISSING_PEERS=1`` says this environment may lack it: then that test skips."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if os.environ.get("TANNERY_ALLOW_MISSING_PEERS") == "1":
            pytest.skip(f"{module} is not installed ({error}) and TANNERY_ALLOW_MISSING_PEERS=1")
        raise


@pytest.fixture
def tannic_nn() -> Path:
    """The directory of real .tannic pairs written by pytannic (skips when absent)."""
    if not FIXTURES.is_dir():
        pytest.skip(f"{FIXTURES} is absent")
    return FIXTURES


@pytest.fixture
def server(tmp_path: Path):
    """A real tannery server in this process: 127.0.0.1, a free port, data in ``tmp_path / "data"``.

    Yields a :class:`tests.server_harness.InProcessServer` (``.target``, ``.data_dir``,
    ``.archives()``, ``.channel()``, ``.stop()``); see that module for other settings.
    """
    from .server_harness import running_server

    with running_server(tmp_path) as running:
        yield running


@pytest.fixture
def server_process(tmp_path: Path):
    """A :class:`tests.server_harness.ServerProcess` on ``tmp_path / "data"``, not started yet;
    killed at the end of the test."""
    from .server_harness import ServerProcess

    process = ServerProcess(tmp_path / "data")
    yield process
    process.kill()


@pytest.fixture
def no_client_environment(monkeypatch):
    """The clients' defaults come from TANNERY_* variables: none of the caller's apply (for
    tests that give ``transport=`` and the rest themselves; use it with ``usefixtures``)."""
    for variable in ("TANNERY_TARGET", "TANNERY_TOKEN", "TANNERY_TLS", "TANNERY_TLS_CA", "TANNERY_CLIENT_CERT",
                     "TANNERY_CLIENT_KEY", "TANNERY_TRANSPORT"):
        monkeypatch.delenv(variable, raising=False)
