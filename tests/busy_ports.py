"""The default ports held for the whole session, when ``TANNERY_CI_BUSY_PORTS=1`` (.ci/run sets it):
a pytest plugin that tests/conftest.py registers.

`make serve` and `make test` may run at once: the server `make serve` starts listens on the
default ports (gRPC on 50051; the container image also fixes the data port 50052 and metrics
20051), so no server a test starts may need one of them, nor may a test reach a server at the
default target by accident. Under this variable the session starts, before collection, a
`tannery serve` on 127.0.0.1 with those three ports (a temporary data directory) and stops it
at the end, so the whole suite runs beside a default server and proves it.

That server asks for a token no test knows: a test that talks to ``localhost:50051`` by
mistake gets UNAUTHENTICATED and fails instead of passing against a server not its own.

A port already in use (a developer's own `make serve`) is noted in the header and left alone:
the ports that are free are then held with plain listening sockets, and the suite goes on.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOST = "127.0.0.1"
#: gRPC (the server's default), the data port and metrics as the image fixes them
#: (docker/Dockerfile): `tannery serve` alone takes free ports for the last two.
DEFAULT_PORTS = {"grpc": 50051, "data": 50052, "metrics": 20051}
VARIABLE = "TANNERY_CI_BUSY_PORTS"


def wanted() -> bool:
    return os.environ.get(VARIABLE) == "1"


@dataclass
class BusyPorts:
    """What this session holds: a default server, or sockets on the ports that were free."""

    scratch: Path
    server: object | None = None  # a tests.server_harness.ServerProcess
    sockets: list[socket.socket] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        if self.server is not None:
            self.server.stop()  # type: ignore[attr-defined]
        for held in self.sockets:
            held.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _default_server(scratch: Path):
    """`tannery serve` as `make serve` runs it (the script beside this Python when installed),
    with none of the caller's TANNERY_* settings: the ports (the defaults, said explicitly),
    127.0.0.1 and a token instead."""
    from .server_harness import ServerProcess

    process = ServerProcess(scratch / "data")
    script = Path(sys.executable).parent / "tannery"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "tannery.cli"]
    process.command = lambda: [*command, "serve", "--data-dir", str(scratch / "data")]  # type: ignore[method-assign]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
    environment.update(TANNERY_HOST=HOST, TANNERY_PORT=str(DEFAULT_PORTS["grpc"]),
                       TANNERY_DATA_PORT=str(DEFAULT_PORTS["data"]), TANNERY_METRICS_PORT=str(DEFAULT_PORTS["metrics"]),
                       TANNERY_TOKENS=f"{secrets.token_hex(16)}:write")
    process.environment = lambda: environment  # type: ignore[method-assign]
    return process


def _listen(port: int) -> socket.socket | None:
    """A socket listening on HOST:port, None when the port is taken."""
    held = socket.socket()
    try:
        held.bind((HOST, port))
        held.listen()
    except OSError:
        held.close()
        return None
    return held


def hold() -> BusyPorts:
    busy = BusyPorts(Path(tempfile.mkdtemp(prefix="tannery-busy-ports-")))
    server = _default_server(busy.scratch)
    try:
        server.start()
    except RuntimeError as error:
        refused = [line for line in str(error).splitlines() if line.startswith("tannery serve:")]
        busy.notes.append(f"no default server: {refused[0] if refused else error}")
    else:
        busy.server = server
        busy.notes.append(f"a default `tannery serve` (pid {server.pid}, token required) holds "
                          + ", ".join(f"{HOST}:{port}" for port in DEFAULT_PORTS.values()))
        return busy
    for name, port in DEFAULT_PORTS.items():
        held = _listen(port)
        if held is None:
            busy.notes.append(f"{HOST}:{port} ({name}) was already in use: left to whoever holds it")
        else:
            busy.sockets.append(held)
            busy.notes.append(f"{HOST}:{port} ({name}) held by a listening socket")
    return busy


_KEY = pytest.StashKey[BusyPorts]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if wanted():
        session.config.stash[_KEY] = hold()


def pytest_report_header(config: pytest.Config) -> list[str]:
    busy = config.stash.get(_KEY, None)
    return [f"{VARIABLE}=1: {note}" for note in busy.notes] if busy is not None else []


def pytest_sessionfinish(session: pytest.Session) -> None:
    busy = session.config.stash.get(_KEY, None)
    if busy is not None:
        busy.release()
