"""tests/busy_ports.py: under TANNERY_CI_BUSY_PORTS=1 the suite runs beside a default server."""

from __future__ import annotations

import grpc
import pytest

from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import archives_pb2_grpc
from tannery_server.app import port_in_use

from . import busy_ports
from .server_harness import free_port


def _refused_without_a_token(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            archives_pb2_grpc.ArchivesStub(channel).List(pb.ListRequest(), timeout=30)
        except grpc.RpcError as error:
            return error.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


@pytest.mark.skipif(not busy_ports.wanted(), reason="runs only under TANNERY_CI_BUSY_PORTS=1, not set here (.ci/run "
                                                   "sets it, to hold the default ports for the whole session)")
def test_the_default_ports_are_busy_the_whole_session(pytestconfig: pytest.Config) -> None:
    """What .ci/run relies on: every test of the run ran beside these busy ports."""
    busy = pytestconfig.stash[busy_ports._KEY]
    for name, port in busy_ports.DEFAULT_PORTS.items():
        assert port_in_use(busy_ports.HOST, port), (name, port, busy.notes)
    if busy.server is not None:
        assert _refused_without_a_token(f"localhost:{busy_ports.DEFAULT_PORTS['grpc']}")


def _three_free_ports() -> dict[str, int]:
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    return dict(zip(busy_ports.DEFAULT_PORTS, sorted(ports)))


@pytest.mark.slow
def test_holding_starts_a_server_that_wants_a_token_and_releasing_frees_its_ports(monkeypatch) -> None:
    ports = _three_free_ports()  # stand-ins for the defaults, which a developer's server may hold
    monkeypatch.setattr(busy_ports, "DEFAULT_PORTS", ports)
    busy = busy_ports.hold()
    try:
        assert busy.server is not None and busy.sockets == [], busy.notes
        assert all(port_in_use(busy_ports.HOST, port) for port in ports.values())
        assert _refused_without_a_token(f"127.0.0.1:{ports['grpc']}")
        assert "token required" in busy.notes[0] and f"127.0.0.1:{ports['metrics']}" in busy.notes[0]
    finally:
        busy.release()
    assert not any(port_in_use(busy_ports.HOST, port) for port in ports.values())
    assert not busy.scratch.exists()


def test_a_port_already_taken_is_noted_and_the_free_ones_held_with_sockets(monkeypatch) -> None:
    """A developer's own `make serve` on 50051: the session goes on, noting it."""
    import socket

    ports = _three_free_ports()
    monkeypatch.setattr(busy_ports, "DEFAULT_PORTS", ports)
    with socket.socket() as taken:
        taken.bind((busy_ports.HOST, ports["grpc"]))
        taken.listen()
        busy = busy_ports.hold()
        try:
            assert busy.server is None and len(busy.sockets) == 2, busy.notes
            assert busy.notes[0].startswith("no default server: tannery serve:"), busy.notes
            assert f"127.0.0.1:{ports['grpc']} (grpc) was already in use: left to whoever holds it" in busy.notes
            assert all(port_in_use(busy_ports.HOST, port) for port in ports.values())
        finally:
            busy.release()
        assert not port_in_use(busy_ports.HOST, ports["data"]) and not port_in_use(busy_ports.HOST, ports["metrics"])
