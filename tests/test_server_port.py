"""One server per port, and the metrics endpoint's default port.

gRPC turns SO_REUSEPORT on by default: a second server then binds a port beside a running
one and clients get answers from either at random. The server turns it off, so a busy
port fails the start with a message naming it and the remedy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tannery.codec import encode_numpy
from tannery.v1 import archives_pb2 as pb
from tannery_server import app
from tannery_server.cli import build_parser
from tannery_server.config import Config

from .server_harness import HOST, InProcessServer, ServerProcess, running_server, store_requests

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = encode_numpy(__import__("numpy").arange(16, dtype="float32"))
BUSY = r"cannot listen on 127\.0\.0\.1:{port}: the port is already in use by another process.*--port or TANNERY_PORT"


def test_a_second_server_on_a_busy_port_fails_to_start(tmp_path):
    with running_server(tmp_path / "one") as first:
        second = Config(host=HOST, port=first.port, metrics_port=0, data_dir=tmp_path / "two" / "data")
        with pytest.raises(app.AddressInUse, match=BUSY.format(port=first.port)):
            InProcessServer(second).stop()
        # The first server still answers every call, and they all reach it.
        for n in range(5):
            first.archives().Store(store_requests(f"a{n}", {"w": PAYLOAD}))
        names = [a.name for a in first.archives().List(pb.ListRequest()).archives]
        assert names == [f"a{n}" for n in range(5)]
    assert not list((tmp_path / "two" / "data" / "blobs").rglob("*")), "the refused server stored nothing"


def test_tannery_serve_on_a_busy_port_prints_one_line_and_exits_non_zero(tmp_path):
    with ServerProcess(tmp_path / "first") as first:
        port = int(first.target.rsplit(":", 1)[1])
        env = {**os.environ, "TANNERY_METRICS_PORT": "0"}
        result = subprocess.run(
            [sys.executable, "-m", "tannery_server", "serve", "--host", HOST, "--port", str(port),
             "--data-dir", str(tmp_path / "second")],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert result.returncode == 1, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("tannery serve:")]
        assert len(lines) == 1, result.stderr
        assert re.fullmatch("tannery serve: " + BUSY.format(port=port), lines[0]), lines[0]
        assert "Traceback" not in result.stderr and "add_port" not in result.stderr, result.stderr
        first.archives().List(pb.ListRequest())  # the first one is untouched


class _FakeServer:
    """Stands for a grpc.aio.Server whose add_insecure_port fails as grpcio does."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def add_insecure_port(self, address: str) -> int:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize("answer", [RuntimeError("Failed to bind to address"), 0], ids=["raises", "returns-0"])
def test_a_port_taken_between_the_probe_and_the_bind_is_named_too(monkeypatch, answer):
    probes = iter([False, True])  # free when probed first, taken when gRPC binds
    monkeypatch.setattr(app, "port_in_use", lambda host, port: next(probes))
    with pytest.raises(app.AddressInUse, match=BUSY.format(port=50999)):
        app.bind(_FakeServer(answer), "127.0.0.1", 50999, None)


@pytest.mark.parametrize("answer", [RuntimeError("Failed to bind to address"), 0], ids=["raises", "returns-0"])
def test_other_bind_failures_name_the_address(monkeypatch, answer):
    monkeypatch.setattr(app, "port_in_use", lambda host, port: False)
    with pytest.raises(OSError, match="cannot listen on 127.0.0.1:50999") as caught:
        app.bind(_FakeServer(answer), "127.0.0.1", 50999, None)
    assert not isinstance(caught.value, app.AddressInUse)


def test_port_in_use_sees_a_listening_socket():
    import socket

    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert app.port_in_use(HOST, port)
    assert not app.port_in_use(HOST, port)
    assert not app.port_in_use(HOST, 0)


def test_the_metrics_port_is_not_prometheus_nor_an_exporter_default():
    port = Config().metrics_port
    assert port == 20051
    assert not 9090 <= port <= 9999, "Prometheus's own port and the exporters' allocations"
    assert port < 32768, "below Linux's ephemeral ports"
    assert port != Config().port
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert "default 20051" in " ".join(serve.format_help().split())


def test_the_docker_files_use_the_default_metrics_port():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 50051 50052 20051$", dockerfile, re.M)  # gRPC, the data port, metrics
    assert "TANNERY_METRICS_PORT=20051" in dockerfile
    assert f"TANNERY_DATA_PORT={Config().data_port}" in dockerfile
    assert '"20051:20051"' in (ROOT / "docker" / "compose.yaml").read_text()
    for name in ("Dockerfile", "compose.yaml", "smoke-test.sh"):
        assert "9090" not in (ROOT / "docker" / name).read_text().replace("not 9090", ""), name
